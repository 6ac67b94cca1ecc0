"""Copies between the compute device and host buffers: synchronous, or on CUDA side streams.

Both transfer classes expose the same five operations, so the engine (and the schedule it
follows) is the same code on every device:

* ``start_offload(source)`` copies a device storage into a pooled host block;
* ``offload_finished(ticket)`` / ``wait_offload(ticket)`` tell when the device storage may
  be dropped;
* ``start_fetch(block, device)`` copies a host block back into a new device buffer;
* ``make_ready(ticket)`` orders the compute stream after that copy, before the buffer is
  used; ``retire_fetch(ticket)`` is called before the engine drops the device buffer.

``SyncTransfer`` serves the CPU (the "device" is host memory too, so the whole schedule
runs and is tested there) and any device without streams. ``CudaStreamTransfer`` overlaps
the copies with compute.

Note [Offload stash lifetime]
-----------------------------
Who keeps what alive, and until when:

1. The *device storage* of a saved activation is referenced by the offload ticket (the
   "forward stash") until its device-to-host copy has completed; only then is the reference
   dropped. On the synchronous path that is immediately after the copy. On CUDA the engine
   polls ``offload_finished`` at every pack and at the end of each layer, and when the stash
   grows past its byte limit it makes the compute stream wait for the oldest copy instead
   (``wait_offload``), which bounds device memory without blocking the host.
2. The *host block* lives as long as the forward pass that filled it: autograd may unpack
   a saved tensor again (``retain_graph=True``), so the host copy is the source of truth
   until the pass's saved tensors are all gone. The engine then returns the block to the
   pool (``HostBufferPool.release``); its CUDA events travel with it.
3. A *fetched device buffer* is referenced by the engine from the prefetch until the
   layer's backward has ended. Autograd holds its own references to the views it unpacked,
   so dropping ours never frees memory that a running backward node still reads.

Note [Offload stream ordering]
------------------------------
On CUDA, with the compute stream C (the current stream of the forward, and of the backward,
which autograd runs on the stream the forward used), an offload stream O and a prefetch
stream P:

* Offload: an event recorded on C after the source was produced; O waits on it, then copies
  into the pinned block and records ``block.write_done``. If the block is being reused, O
  first waits on ``block.read_done`` so a pending prefetch from its previous contents
  finishes before it is overwritten.
* Fetch: the device buffer is allocated *on C* (so the caching allocator ties it to the
  stream that will use and free it), an event recorded on C marks it free to write; P waits
  on that event and on ``block.write_done``, copies, and records ``fetch.done``, which is
  also stored as ``block.read_done``.
* Use: before a fetched buffer is handed to autograd, C waits on ``fetch.done``
  (``make_ready``). The wait is on the GPU; the host does not block.
* Drop: a fetched buffer that C never waited on (evicted or released unused) is made ready
  first (``retire_fetch``), because once dropped the allocator may give its memory to new
  work on C while P is still writing into it.

``Tensor.record_stream`` is the usual alternative to the explicit references above; it is
avoided because it delays the reuse of memory until the allocator happens to check the
recorded streams, which makes the device peak depend on timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torch_sagemaker.offload.buffers import HostBlock, HostBufferPool


@dataclass(eq=False)
class OffloadTicket:
    """A device-to-host copy in progress.

    Attributes:
        block: The host block receiving the bytes.
        source: The device storage (flat ``uint8``) kept alive until the copy completes;
            ``None`` once it may be dropped.
        done: CUDA event recorded after the copy, or ``None`` on the synchronous path.
    """

    block: HostBlock
    source: torch.Tensor | None
    done: Any = None


@dataclass(eq=False)
class FetchTicket:
    """A host-to-device copy in progress.

    Attributes:
        data: The device buffer (flat ``uint8``) being filled.
        done: CUDA event recorded after the copy, or ``None`` on the synchronous path.
        ready: Whether the compute stream has been ordered after the copy.
    """

    data: torch.Tensor
    done: Any = None
    ready: bool = False


class SyncTransfer:
    """Blocking copies: used for CPU "devices" and for devices without CUDA streams.

    Args:
        pool: Where host blocks come from.
    """

    def __init__(self, pool: HostBufferPool) -> None:
        self.pool = pool

    def start_offload(self, source: torch.Tensor) -> OffloadTicket:
        """Copies ``source`` into a pooled block; the copy is complete on return."""
        block = self.pool.acquire(source.numel())
        block.data.copy_(source)
        return OffloadTicket(block=block, source=None)

    def offload_finished(self, ticket: OffloadTicket) -> bool:
        """Always ``True``: the copy completed inside ``start_offload``."""
        return True

    def wait_offload(self, ticket: OffloadTicket) -> None:
        """Nothing to wait for on the synchronous path."""

    def start_fetch(self, block: HostBlock, device: torch.device) -> FetchTicket:
        """Copies ``block`` into a new buffer on ``device``; complete on return."""
        data = torch.empty(block.nbytes, dtype=torch.uint8, device=device)
        data.copy_(block.data)
        return FetchTicket(data=data, ready=True)

    def make_ready(self, ticket: FetchTicket) -> bool:
        """Returns whether the copy had completed before it was needed (always here)."""
        return True

    def retire_fetch(self, ticket: FetchTicket) -> None:
        """Nothing in flight on the synchronous path."""


class CudaStreamTransfer:
    """Asynchronous copies on two side streams; see ``Note [Offload stream ordering]``.

    Args:
        pool: A pool of *pinned* host blocks (``HostBufferPool(pin_memory=True)``).
        device: The CUDA device whose compute stream is overlapped.
        on_wait: Called with the seconds the host spent blocked in a wait.
    """

    def __init__(
        self,
        pool: HostBufferPool,
        device: torch.device,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        if not pool.pin_memory:
            raise ValueError(
                "CudaStreamTransfer got a pool with pin_memory=False: asynchronous copies need "
                "page-locked host memory; build the pool with HostBufferPool(pin_memory=True)."
            )
        self.pool = pool
        self.device = device
        self._on_wait = on_wait or (lambda seconds: None)
        # Side stream for device-to-host copies, so offloading overlaps forward compute.
        self.offload_stream = torch.cuda.Stream(device=device)
        # Side stream for host-to-device copies, so prefetching overlaps backward compute.
        self.prefetch_stream = torch.cuda.Stream(device=device)

    def _compute_stream(self) -> torch.cuda.Stream:
        # The stream autograd runs the current forward or backward node on.
        return torch.cuda.current_stream(self.device)

    def start_offload(self, source: torch.Tensor) -> OffloadTicket:
        """Enqueues the copy of ``source`` on the offload stream; see the notes above."""
        block = self.pool.acquire(source.numel())
        # Marks the point on the compute stream after which ``source`` holds its final bytes.
        produced = torch.cuda.Event()
        produced.record(self._compute_stream())
        self.offload_stream.wait_event(produced)
        if block.read_done is not None:
            # A reused block: its previous prefetch must finish reading before we overwrite.
            self.offload_stream.wait_event(block.read_done)
        with torch.cuda.stream(self.offload_stream):
            block.data.copy_(source, non_blocking=True)
        # Recorded after the copy: the host block is complete and ``source`` may be dropped.
        done = torch.cuda.Event()
        done.record(self.offload_stream)
        block.write_done = done
        return OffloadTicket(block=block, source=source, done=done)

    def offload_finished(self, ticket: OffloadTicket) -> bool:
        """Whether the copy has completed (a non-blocking query)."""
        return ticket.done.query()

    def wait_offload(self, ticket: OffloadTicket) -> None:
        """Orders the compute stream after the copy so ``source`` can be dropped now.

        Dropping returns the memory to the allocator on the compute stream; work enqueued
        on that stream afterwards runs after the copy, so it cannot overwrite the bytes
        being read. The host does not block.
        """
        self._compute_stream().wait_event(ticket.done)

    def start_fetch(self, block: HostBlock, device: torch.device) -> FetchTicket:
        """Enqueues the copy of ``block`` into a new device buffer on the prefetch stream."""
        compute = self._compute_stream()
        # Allocated on the compute stream: that stream uses the buffer and frees it.
        data = torch.empty(block.nbytes, dtype=torch.uint8, device=device)
        # Marks the allocation point on the compute stream; earlier users of this memory
        # are finished once the prefetch stream passes this event.
        allocated = torch.cuda.Event()
        allocated.record(compute)
        self.prefetch_stream.wait_event(allocated)
        if block.write_done is not None:
            # The offload into this block must be complete before we read it.
            self.prefetch_stream.wait_event(block.write_done)
        with torch.cuda.stream(self.prefetch_stream):
            data.copy_(block.data, non_blocking=True)
        # Recorded after the copy: the compute stream waits on it before using ``data``.
        done = torch.cuda.Event()
        done.record(self.prefetch_stream)
        block.read_done = done
        return FetchTicket(data=data, done=done)

    def make_ready(self, ticket: FetchTicket) -> bool:
        """Orders the compute stream after the copy; returns whether it had already finished."""
        finished = ticket.done.query()
        if not ticket.ready:
            self._compute_stream().wait_event(ticket.done)
            ticket.ready = True
        return finished

    def retire_fetch(self, ticket: FetchTicket) -> None:
        """Makes a never-used buffer safe to drop (see the last rule of the ordering note)."""
        if not ticket.ready:
            self._compute_stream().wait_event(ticket.done)
            ticket.ready = True

    def synchronize(self) -> None:
        """Blocks the host until both side streams are idle (used by tests and shutdown)."""
        start = time.perf_counter()
        self.offload_stream.synchronize()
        self.prefetch_stream.synchronize()
        self._on_wait(time.perf_counter() - start)


def make_transfer(
    device: torch.device,
    pools: dict[bool, HostBufferPool],
    on_wait: Callable[[float], None] | None = None,
    on_allocate: Callable[[int], None] | None = None,
) -> SyncTransfer | CudaStreamTransfer:
    """Picks the transfer for ``device``: CUDA streams on CUDA, synchronous copies elsewhere.

    Args:
        device: The device the saved activations live on.
        pools: Pools by ``pin_memory``; the one needed is created on first use.
        on_wait: Called with the seconds the host spent blocked in a wait.
        on_allocate: Given to a pool created here: called with the size of each new block.
    """
    pin = device.type == "cuda"
    pool = pools.get(pin)
    if pool is None:
        pool = pools[pin] = HostBufferPool(pin_memory=pin, on_allocate=on_allocate)
    if pin:
        return CudaStreamTransfer(pool, device, on_wait)
    return SyncTransfer(pool)
