"""A reusable pool of host buffers that hold offloaded activations.

Every training step offloads the same set of storage sizes, so buffers are kept per exact
byte size and handed out again in the next step instead of being allocated (and, on CUDA,
pinned, which is slow) every time. A buffer goes back to the pool when the forward pass
that filled it is gone (see ``Note [Offload stash lifetime]`` in ``streams.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(eq=False)
class HostBlock:
    """One host buffer of ``nbytes`` bytes (a 1-D ``uint8`` tensor).

    Attributes:
        data: The host memory; pinned when the pool pins.
        write_done: CUDA event recorded after the last device-to-host copy into ``data``
            (``None`` on the synchronous path). Host-to-device copies from ``data`` wait on it.
        read_done: CUDA event recorded after the last host-to-device copy out of ``data``.
            The next device-to-host copy into a reused block waits on it, so a block is
            never overwritten while a prefetch still reads it.
    """

    data: torch.Tensor
    write_done: Any = None
    read_done: Any = None

    @property
    def nbytes(self) -> int:
        """Size of the block in bytes."""
        return self.data.numel()


class HostBufferPool:
    """Host buffers kept by exact byte size and reused across steps.

    Args:
        pin_memory: Allocate page-locked memory (needed for asynchronous CUDA copies).

    Example:
        >>> pool = HostBufferPool(pin_memory=False)
        >>> block = pool.acquire(1024)
        >>> pool.release(block)
        >>> pool.acquire(1024) is block
        True
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[HostBlock]] = defaultdict(list)
        self.allocated_bytes = 0  # bytes of every block this pool ever created and still owns
        self.in_use_bytes = 0  # bytes of blocks handed out and not yet released
        self.reuses = 0  # acquisitions served from the free lists

    def acquire(self, nbytes: int) -> HostBlock:
        """Returns a block of exactly ``nbytes`` bytes, reusing a free one when possible."""
        free = self._free.get(nbytes)
        if free:
            block = free.pop()
            self.reuses += 1
        else:
            data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            block = HostBlock(data)
            self.allocated_bytes += nbytes
        self.in_use_bytes += nbytes
        return block

    def release(self, block: HostBlock) -> None:
        """Returns ``block`` to the pool; its CUDA events still order the next use."""
        self.in_use_bytes -= block.nbytes
        self._free[block.nbytes].append(block)

    @property
    def free_bytes(self) -> int:
        """Bytes held in free blocks, ready for reuse."""
        return self.allocated_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Drops the free blocks; blocks in use stay valid and rejoin the pool when released."""
        self.allocated_bytes -= self.free_bytes
        self._free.clear()
