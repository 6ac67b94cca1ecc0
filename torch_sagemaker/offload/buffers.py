"""A reusable pool of host buffers that hold offloaded activations.

Every training step offloads the same set of storage sizes, so buffers are kept per exact
byte size and handed out again in the next step instead of being allocated (and, on CUDA,
pinned, which is slow) every time. A buffer goes back to the pool when the forward pass
that filled it is gone (see ``Note [Offload stash lifetime]`` in ``streams.py``). What the
pool keeps between steps is bounded (``Note [Host pool trimming]``).

Note [Host pool trimming]
-------------------------
Blocks are matched by exact size, so a block is reused only when a later step saves a
storage of the same size. When the shapes change from step to step (unpadded or bucketed
batches, a sequence length per step), every new size used to add blocks that nothing ever
asked for again: the pool grew without bound while a step needed a fixed amount.

The pool therefore trims itself at the end of each *cycle*: the moment no block is in use
any more, which in training is the end of every forward/backward pair (each micro-batch
under gradient accumulation; several passes in flight at once make one cycle). The
*footprint* of a cycle is the bytes of the distinct blocks it acquired. At the end of a
cycle the free blocks are kept most recently acquired first while their total stays within
``retain_factor`` times the largest footprint of the last ``history`` cycles, and the others
are dropped. Consequences:

* Fixed shapes: a cycle acquires exactly the blocks the previous one did (blocks are handed
  out last in, first out, so a cycle needing ``n`` blocks of a size touches the same ``n``),
  its footprint is its own need and lies within the budget, so nothing is dropped and no
  block is allocated after the first cycle.
* Varying shapes: between cycles the pool holds at most ``retain_factor`` (2) times the
  largest recent footprint. The slack keeps the blocks of sizes that recur (a few sequence
  buckets; micro-batches of two lengths that alternate) instead of allocating them again;
  the history lets a large cycle's blocks survive a few smaller cycles, and once shapes
  shrink for good the budget follows them after ``history`` cycles.
* A pool that never becomes idle (a graph of an earlier step kept alive) is not trimmed
  until it is.

On CUDA a dropped block is a pinned tensor whose last copies may still be queued. PyTorch's
caching host allocator records the copy streams of pinned tensors (``non_blocking`` copies
do), so the memory is not handed out again before those copies finish. It stays pinned in
that allocator's cache, which rounds sizes up to powers of two: a later pinned allocation of
a similar size (a block this pool allocates again) is served from it rather than pinned
anew. (Not run here: these machines have no GPU.)
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Default bound of the idle blocks, in footprints (Note [Host pool trimming]).
DEFAULT_RETAIN_FACTOR = 2.0
#: Default number of recent cycles whose largest footprint sets the bound.
DEFAULT_HISTORY = 4


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
        last_cycle: The pool cycle that acquired the block last (Note [Host pool trimming]).
    """

    data: torch.Tensor
    write_done: Any = None
    read_done: Any = None
    last_cycle: int = -1

    @property
    def nbytes(self) -> int:
        """Size of the block in bytes."""
        return self.data.numel()


class HostBufferPool:
    """Host buffers kept by exact byte size, reused across steps, trimmed when idle.

    Args:
        pin_memory: Allocate page-locked memory (needed for asynchronous CUDA copies).
        retain_factor: Idle blocks kept at the end of a cycle, in multiples of the largest
            recent footprint (Note [Host pool trimming]); at least 1, so that a cycle
            always keeps its own blocks.
        history: Cycles whose largest footprint sets the bound.
        on_allocate: Called with the size of every newly allocated block (statistics).

    Example:
        >>> pool = HostBufferPool(pin_memory=False)
        >>> block = pool.acquire(1024)
        >>> pool.release(block)
        >>> pool.acquire(1024) is block
        True
    """

    def __init__(
        self,
        pin_memory: bool = False,
        retain_factor: float = DEFAULT_RETAIN_FACTOR,
        history: int = DEFAULT_HISTORY,
        on_allocate: Callable[[int], None] | None = None,
    ) -> None:
        if not retain_factor >= 1:
            raise ValueError(
                f"retain_factor={retain_factor}: must be >= 1, or a step would drop blocks the "
                "next step of the same shapes needs."
            )
        if history < 1:
            raise ValueError(f"history={history}: must be >= 1 (cycles).")
        self.pin_memory = pin_memory
        self.retain_factor = retain_factor
        self._on_allocate = on_allocate or (lambda nbytes: None)
        self._free: dict[int, list[HostBlock]] = defaultdict(list)
        self.allocated_bytes = 0  # bytes of every block this pool ever created and still owns
        self.in_use_bytes = 0  # bytes of blocks handed out and not yet released
        self.reuses = 0  # acquisitions served from the free lists
        self.allocations = 0  # blocks created
        self.dropped_bytes = 0  # bytes of free blocks let go by trimming
        self._in_use_blocks = 0  # the cycle ends when this returns to 0
        self._cycle = 0
        self._cycle_bytes = 0  # footprint of the running cycle
        self._footprints: deque[int] = deque(maxlen=history)

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
            self.allocations += 1
            self._on_allocate(nbytes)
        if block.last_cycle != self._cycle:
            block.last_cycle = self._cycle
            self._cycle_bytes += nbytes
        self.in_use_bytes += nbytes
        self._in_use_blocks += 1
        return block

    def release(self, block: HostBlock) -> None:
        """Returns ``block`` to the pool; its CUDA events still order the next use.

        Releasing the last block in use ends a cycle and trims the free blocks.
        """
        self.in_use_bytes -= block.nbytes
        self._in_use_blocks -= 1
        self._free[block.nbytes].append(block)
        if self._in_use_blocks == 0:
            self._end_cycle()

    @property
    def free_bytes(self) -> int:
        """Bytes held in free blocks, ready for reuse."""
        return self.allocated_bytes - self.in_use_bytes

    @property
    def retained_limit(self) -> int:
        """Bytes of free blocks the last trim could keep (0 before the first cycle ends)."""
        return int(self.retain_factor * max(self._footprints, default=0))

    def _end_cycle(self) -> None:
        """Keeps the most recently acquired free blocks within the budget; drops the rest."""
        self._footprints.append(self._cycle_bytes)
        self._cycle += 1
        self._cycle_bytes = 0
        budget = self.retained_limit
        blocks = [b for free in self._free.values() for b in free]
        # Newest first; the sort is stable, so blocks of one cycle keep the lists' order.
        blocks.sort(key=lambda b: b.last_cycle, reverse=True)
        kept = 0
        for i, block in enumerate(blocks):
            if kept + block.nbytes > budget:
                self._drop({id(b) for b in blocks[i:]})
                return
            kept += block.nbytes

    def _drop(self, dropped: set[int]) -> None:
        """Lets go of the free blocks whose ``id`` is in ``dropped``; the rest keep their order."""
        for nbytes in list(self._free):
            free = self._free[nbytes]
            kept = [b for b in free if id(b) not in dropped]
            gone = (len(free) - len(kept)) * nbytes
            self.allocated_bytes -= gone
            self.dropped_bytes += gone
            if kept:
                self._free[nbytes] = kept
            else:
                del self._free[nbytes]

    def clear(self) -> None:
        """Drops the free blocks; blocks in use stay valid and rejoin the pool when released."""
        self.dropped_bytes += self.free_bytes
        self.allocated_bytes -= self.free_bytes
        self._free.clear()
