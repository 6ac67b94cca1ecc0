"""The offload engine: follows the forward and backward passes and carries out the schedule.

Events and what they trigger:

* root forward begins (``forward_pass``): a new ``PassRecord``; prefetched layers of older
  passes still waiting for their backward go back to the host (``on_new_forward``);
* a wrapped layer is entered/left (module hooks): a new unit, and a gradient hook on the
  layer's input that reports the end of the layer's backward;
* a tensor is saved inside a layer (``save_storage``): the storage is offloaded once,
  kept (small, or saved by several layers), or only counted when offloading is off;
* root forward ends: the last ``horizon`` layers are fetched back at once;
* a layer's first saved tensor is unpacked (``note_backward``): the layer's backward
  started; layers ahead of it are fetched so that ``horizon`` are resident or in flight;
* the gradient of a layer's input is complete: its device copies are released;
* the ``backward()`` call finishes (an autograd final callback): leftovers are released.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torch_sagemaker._torch_compat import autograd as autograd_compat
from torch_sagemaker._torch_compat.pytree import tree_leaves
from torch_sagemaker.offload import hooks as hooks_lib
from torch_sagemaker.offload.buffers import HostBufferPool
from torch_sagemaker.offload.records import (
    PassRecord,
    StorageKind,
    StorageRecord,
    UnitRecord,
    drop_resident,
    free_pass,
)
from torch_sagemaker.offload.schedule import PrefetchSchedule
from torch_sagemaker.offload.stats import OffloadStats, StatsRecorder
from torch_sagemaker.offload.streams import CudaStreamTransfer, SyncTransfer, make_transfer

# Default size of the forward stash: device bytes whose offload copy may be in flight
# before the compute stream is made to wait for the oldest copy (CUDA only).
DEFAULT_MAX_STASH_BYTES = 1 << 30


class OffloadEngine:
    """Offloads the saved activations of wrapped layers and prefetches them for backward.

    It is the ``hooks.SavedTensorSink`` the saved-tensor hooks report to.

    Args:
        horizon: Layers kept resident ahead of the layer whose backward runs.
        min_offload_bytes: Storages smaller than this stay on the device.
        offload: ``False`` records and counts everything but moves nothing (the
            no-offload baseline of the statistics).
        max_stash_bytes: Device bytes whose offload copy may be in flight (CUDA).
        trace: Keep an event log in ``self.trace`` (for tests and debugging).
    """

    def __init__(
        self,
        horizon: int,
        min_offload_bytes: int,
        offload: bool = True,
        max_stash_bytes: int = DEFAULT_MAX_STASH_BYTES,
        trace: bool = False,
    ) -> None:
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes={min_offload_bytes}: must be >= 0 (bytes).")
        PrefetchSchedule(horizon)  # validates the horizon with a readable error
        self.horizon = horizon
        self.min_offload_bytes = min_offload_bytes
        self.offload = offload
        self.max_stash_bytes = max_stash_bytes
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None
        self.stats = StatsRecorder()
        self._pools: dict[bool, HostBufferPool] = {}
        self._transfers: dict[torch.device, SyncTransfer | CudaStreamTransfer] = {}
        self._passes: list[weakref.ref[PassRecord]] = []
        self._active: PassRecord | None = None
        self._unit_stack: list[UnitRecord | None] = []
        self._module_state: set[tuple[torch.device, int]] = set()
        self._device_type: str | None = None
        self._stash: deque[StorageRecord] = deque()  # records whose offload copy is in flight
        self._stash_bytes = 0
        # _backward_finished is queued for the running backward. A backward that raises never
        # runs its callbacks, so a forward outside any backward clears a flag left set.
        self._callback_queued = False

    # ------------------------------------------------------------------ wiring
    def attach(self, layers: Iterable[nn.Module]) -> list[Any]:
        """Registers the layer-entry and layer-exit hooks; returns their handles."""
        handles = []
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(self._enter_layer, with_kwargs=True))
            handles.append(layer.register_forward_hook(self._exit_layer, always_call=True))
        return handles

    @contextlib.contextmanager
    def forward_pass(self, root: nn.Module) -> Iterator[None]:
        """Context of one forward pass of the wrapped root module."""
        if self._active is not None:  # the root called again inside its own forward
            yield
            return
        pass_record = self._begin_forward(root)
        try:
            with hooks_lib.OffloadHooks(self):
                yield
        finally:
            self._active = None
            self._unit_stack.clear()
        self._end_forward(pass_record)

    def snapshot(self) -> OffloadStats:
        """The counters since the last reset."""
        return self.stats.snapshot(sum(p.allocated_bytes for p in self._pools.values()))

    # ----------------------------------------------------------------- forward
    def _begin_forward(self, root: nn.Module) -> PassRecord:
        if autograd_compat.current_graph_task_id() == -1:
            self._callback_queued = False  # a backward that raised left it set
        for pass_record in self._live_passes():
            for unit in pass_record.schedule.on_new_forward():
                self._release_unit(pass_record, unit, "evict")
        state = [hooks_lib.split_dtensor(t)[0] for t in (*root.parameters(), *root.buffers())]
        self._module_state = {
            hooks_lib.storage_key(t) for t in state if t.untyped_storage().nbytes() > 0
        }
        # Only tensors on the model's device type are moved: in a CUDA run, CPU tensors a
        # layer saves are in host memory already. A model without state accepts any device.
        self._device_type = state[0].device.type if state else None
        pass_record = PassRecord(schedule=PrefetchSchedule(self.horizon))
        weakref.finalize(
            pass_record,
            free_pass,
            pass_record.storages,
            pass_record.units,
            self.stats,
            self._transfers,
        )
        self._passes.append(weakref.ref(pass_record))
        self._active = pass_record
        self.stats.add("forward_passes")
        return pass_record

    def _end_forward(self, pass_record: PassRecord) -> None:
        pass_record.forward_done = True
        self._log("forward_end", pass_record.pass_id)
        self._poll_stash()
        for unit in pass_record.schedule.on_forward_end():
            self._fetch_unit(pass_record, unit, demand=False)

    def active_pass(self) -> PassRecord:
        """The pass whose forward is running (only valid inside ``forward_pass``)."""
        assert self._active is not None, "active_pass() outside a forward pass"
        return self._active

    def current_unit(self) -> UnitRecord | None:
        """The innermost wrapped layer being run by the current forward pass, if any."""
        return self._unit_stack[-1] if self._unit_stack else None

    def on_compute_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device type whose memory offloading frees."""
        return self._device_type is None or tensor.device.type == self._device_type

    def is_module_state(self, key: tuple[torch.device, int]) -> bool:
        """Whether ``key`` is the storage of a parameter or buffer of the root module."""
        return key in self._module_state

    def _enter_layer(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        pass_record = self._active
        if pass_record is None:
            # Not our forward (e.g. the recomputation of a checkpointed layer in backward).
            self._unit_stack.append(None)
            return
        first_input = next(
            (
                t
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.requires_grad
            ),
            None,
        )
        index = pass_record.schedule.add_unit(has_end_signal=first_input is not None)
        unit = UnitRecord(index)
        if first_input is not None:
            # The gradient of the layer's input is complete exactly when the layer's
            # backward has finished (the hook runs before the producer's backward node).
            unit.grad_hook = first_input.register_hook(
                functools.partial(
                    _on_input_grad, weakref.ref(self), weakref.ref(pass_record), index
                )
            )
        pass_record.units.append(unit)
        self._unit_stack.append(unit)
        self.stats.add("layers")

    def _exit_layer(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._unit_stack:
            return  # the forward pass was aborted and its stack cleared
        unit = self._unit_stack.pop()
        if unit is not None and unit.offloaded and self.offload:
            self._log("offload", self.active_pass().pass_id, unit.index)
        self._poll_stash()

    def save_storage(
        self,
        unit: UnitRecord,
        local: torch.Tensor,
        tensor: torch.Tensor,
        key: tuple[torch.device, int],
    ) -> tuple[StorageRecord, bool]:
        """Records that ``unit`` saved ``tensor`` (data in ``local``, storage ``key``).

        Returns the storage's record and whether autograd should get the original tensor
        back as is (it is not offloaded).
        """
        pass_record = self.active_pass()
        record = pass_record.find(key)
        if record is None:
            record = self._new_record(pass_record, unit, local, key)
        elif record.owner != unit.index and record.kind is not StorageKind.SHARED:
            self._make_shared(pass_record, record, local)
        record.aliases.append(weakref.ref(tensor))
        return record, record.kind is not StorageKind.OFFLOAD

    def _new_record(
        self,
        pass_record: PassRecord,
        unit: UnitRecord,
        local: torch.Tensor,
        key: tuple[torch.device, int],
    ) -> StorageRecord:
        nbytes = local.untyped_storage().nbytes()
        if nbytes < self.min_offload_bytes:
            kind = StorageKind.SMALL
        else:
            kind = StorageKind.OFFLOAD if self.offload else StorageKind.MEASURE
        record = StorageRecord(
            key=key,
            nbytes=nbytes,
            device=local.device,
            owner=unit.index,
            kind=kind,
            resident=hooks_lib.flat_storage(local),
        )
        pass_record.by_key[key] = record
        pass_record.storages.append(record)
        self.stats.add("bytes_saved", nbytes)
        self.stats.change_resident(nbytes)
        if kind is StorageKind.SMALL:
            unit.small.append(record)
            self.stats.add("bytes_kept", nbytes)
        else:
            unit.offloaded.append(record)
        if kind is StorageKind.OFFLOAD:
            self._start_offload(record)
        return record

    def _make_shared(
        self, pass_record: PassRecord, record: StorageRecord, local: torch.Tensor
    ) -> None:
        """A second layer saved this storage: keep it on the device for the pass.

        It is needed until the last of those layers runs its backward, so offloading it cannot
        free memory.
        """
        owner = pass_record.units[record.owner]
        owned = owner.small if record.kind is StorageKind.SMALL else owner.offloaded
        if record in owned:  # a released owner has already let go of its small records
            owned.remove(record)
        if record.kind is not StorageKind.SMALL:
            self.stats.add("bytes_kept", record.nbytes)
        if record.resident is None:
            record.resident = hooks_lib.flat_storage(local)
            if record.in_flight is None:
                self.stats.change_resident(record.nbytes)
            # else: the stash still counts these bytes and leaves them to the record.
        record.kind = StorageKind.SHARED

    # --------------------------------------------------------- offload stash
    def _transfer(self, device: torch.device) -> SyncTransfer | CudaStreamTransfer:
        transfer = self._transfers.get(device)
        if transfer is None:
            transfer = make_transfer(
                device,
                self._pools,
                on_wait=lambda s: self.stats.add("wait_seconds", s),
                on_allocate=lambda n: self.stats.add("host_pool_new_bytes", n),
            )
            self._transfers[device] = transfer
        return transfer

    def _start_offload(self, record: StorageRecord) -> None:
        start = time.perf_counter()
        assert record.resident is not None  # only resident storages are offloaded
        ticket = self._transfer(record.device).start_offload(record.resident)
        self.stats.add("copy_seconds", time.perf_counter() - start)
        self.stats.add("bytes_offloaded", record.nbytes)
        record.host = ticket.block
        record.resident = None  # the ticket holds the source until the copy completes
        record.in_flight = ticket
        self._stash.append(record)
        self._stash_bytes += record.nbytes
        self._poll_stash()

    def _poll_stash(self) -> None:
        """Drops device sources whose copy completed; bounds the stash (see the note)."""
        while self._stash:
            record = self._stash[0]
            ticket = record.in_flight
            assert ticket is not None  # stashed records stay in flight until retired here
            transfer = self._transfer(record.device)
            if not transfer.offload_finished(ticket):
                if self._stash_bytes <= self.max_stash_bytes:
                    return
                transfer.wait_offload(ticket)
            self._stash.popleft()
            self._stash_bytes -= record.nbytes
            ticket.source = None
            record.in_flight = None
            if record.resident is None:  # not taken back meanwhile (shared or fetched)
                self.stats.change_resident(-record.nbytes)
            if record.orphaned:  # its pass died while the copy was in flight
                assert record.host is not None  # set with in_flight by _start_offload
                transfer.pool.release(record.host)
                record.host = None

    # ---------------------------------------------------------------- backward
    def note_backward(self, pass_record: PassRecord, unit: int) -> None:
        """A saved tensor of ``unit`` is being unpacked: maybe its backward just started."""
        self._queue_backward_callback()
        pass_record.backward_started = True
        decision = pass_record.schedule.on_backward_start(unit)
        if not decision.new_start:
            return
        self._log("backward_start", pass_record.pass_id, unit)
        for released in decision.release:
            self._release_unit(pass_record, released, "release")
        for fetched in decision.fetch:
            self._fetch_unit(pass_record, fetched, demand=decision.demand and fetched == unit)
        self.stats.record_lead(decision.lead)
        if decision.demand:
            self.stats.add("demand_fetches")

    def resident_storage(self, pass_record: PassRecord, record: StorageRecord) -> torch.Tensor:
        """The device storage of ``record``, fetched now if it is not resident."""
        if record.resident is None:  # released, then unpacked again (retain_graph)
            self._fetch_record(record, demand=True)
        if record.fetch is not None and not self._transfer(record.device).make_ready(record.fetch):
            self.stats.add("late_fetches")
        assert record.resident is not None  # fetched above
        return record.resident

    def end_layer_backward(self, pass_record: PassRecord, unit: int) -> None:
        """The gradient of ``unit``'s input is complete: release the unit."""
        for released in pass_record.schedule.on_backward_end(unit):
            self._release_unit(pass_record, released, "release")

    def _queue_backward_callback(self) -> None:
        if self._callback_queued:
            return
        try:
            autograd_compat.queue_callback(self._backward_finished)
        except RuntimeError:
            return  # unpacked outside a backward pass: nothing will finish
        self._callback_queued = True

    def _backward_finished(self) -> None:
        self._callback_queued = False
        self._log("backward_finished")
        pending = []
        for pass_record in self._live_passes():
            for unit in pass_record.schedule.on_backward_finished():
                self._release_unit(pass_record, unit, "release")
            if pass_record.forward_done and not pass_record.backward_started:
                pending.append(pass_record)
        if pending and pending[-1] is not self._active:
            # Several forwards ran before this backward: the newest one waiting for its
            # backward is next, so bring its last layers back now.
            for unit in pending[-1].schedule.on_forward_end():
                self._fetch_unit(pending[-1], unit, demand=False)

    # ------------------------------------------------------- fetch and release
    def _fetch_unit(self, pass_record: PassRecord, unit: int, demand: bool) -> None:
        self._log("fetch", pass_record.pass_id, unit, "demand" if demand else "prefetch")
        for record in pass_record.units[unit].offloaded:
            if record.resident is None and record.kind is StorageKind.OFFLOAD:
                self._fetch_record(record, demand)

    def _fetch_record(self, record: StorageRecord, demand: bool) -> None:
        if record.in_flight is not None:
            # Its offload copy has not been retired: the original is still here, reuse it.
            record.resident = record.in_flight.source
            return
        transfer = self._transfer(record.device)
        start = time.perf_counter()
        assert record.host is not None  # offloaded and not in flight: the host copy is done
        record.fetch = transfer.start_fetch(record.host, record.device)
        elapsed = time.perf_counter() - start
        self.stats.add("copy_seconds", elapsed)
        if demand and isinstance(transfer, SyncTransfer):
            self.stats.add("wait_seconds", elapsed)  # the backward waited for this copy
        record.resident = record.fetch.data
        self.stats.change_resident(record.nbytes)
        self.stats.add("bytes_fetched_on_demand" if demand else "bytes_prefetched", record.nbytes)

    def _release_unit(self, pass_record: PassRecord, unit: int, why: str) -> None:
        self._log(why, pass_record.pass_id, unit)
        unit_record = pass_record.units[unit]
        for record in unit_record.offloaded:
            drop_resident(record, self.stats, self._transfers)
        for record in unit_record.small:
            drop_resident(record, self.stats, self._transfers)
        unit_record.small.clear()  # autograd keeps the small tensors themselves

    # ------------------------------------------------------------------ helpers
    def _live_passes(self) -> list[PassRecord]:
        live = [p for p in (ref() for ref in self._passes) if p is not None]
        self._passes = [weakref.ref(p) for p in live]
        return live

    def _log(self, *event: Any) -> None:
        if self.trace is not None:
            self.trace.append(event)


def _on_input_grad(
    engine_ref: weakref.ref, pass_ref: weakref.ref, unit: int, grad: torch.Tensor
) -> None:
    engine, pass_record = engine_ref(), pass_ref()
    if engine is not None and pass_record is not None:
        engine.end_layer_backward(pass_record, unit)
