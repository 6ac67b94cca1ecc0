"""Bookkeeping records of activation offloading: one per forward pass, layer call and storage.

Reference structure (it decides lifetimes, see ``Note [Offload stash lifetime]``)::

    autograd graph --> SavedRef --> PassRecord --> UnitRecord --> StorageRecord
                           '-------------------------------------------^

A ``PassRecord`` is alive exactly as long as autograd holds one of its saved tensors; the
engine and the hooks it registers refer to it only weakly. ``StorageRecord`` and
``UnitRecord`` never refer back to their pass, so the pass's finalizer (which keeps the
storage list alive until it runs) cannot keep the pass alive.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_sagemaker._torch_compat import tensor as tensor_compat
from torch_sagemaker.offload.buffers import HostBlock
from torch_sagemaker.offload.schedule import PrefetchSchedule
from torch_sagemaker.offload.streams import FetchTicket, OffloadTicket

_pass_ids = itertools.count()


class StorageKind(enum.Enum):
    """What the engine does with one saved storage."""

    OFFLOAD = "offload"  # copied to the host in forward, fetched back for backward
    SMALL = "small"  # below the size threshold: kept on the device
    SHARED = "shared"  # saved by several layers: needed until the last of them, kept
    MEASURE = "measure"  # offloading disabled: only counted (the no-offload baseline)


@dataclass(eq=False)
class StorageRecord:
    """One device storage saved by the wrapped layers of one forward pass.

    Attributes:
        key: ``(device, data_ptr)`` of the storage when it was saved.
        nbytes: Size of the whole storage (what is copied; views of it are rebuilt).
        device: The compute device.
        owner: Index of the unit that saved it first.
        kind: See ``StorageKind``.
        resident: Flat ``uint8`` view of the storage on the device while the engine holds
            it (the original before offloading, a fetched copy during backward).
        host: The host block holding the offloaded bytes.
        in_flight: The offload ticket while its copy is in the forward stash.
        fetch: The fetch ticket of ``resident`` when it is a fetched copy.
        orphaned: Its pass is gone while the offload copy was in flight; the host block
            goes back to the pool when the copy completes.
        aliases: Weak references to the tensors saved with this storage; while one of them
            is alive (or ``resident`` is the original), the data pointer cannot have been
            reused by another storage.
    """

    key: tuple[torch.device, int]
    nbytes: int
    device: torch.device
    owner: int
    kind: StorageKind
    resident: torch.Tensor | None = None
    host: HostBlock | None = None
    in_flight: OffloadTicket | None = None
    fetch: FetchTicket | None = None
    orphaned: bool = False
    aliases: list[weakref.ref] = field(default_factory=list)

    def same_storage_alive(self, ptr: int) -> bool:
        """Whether a storage at ``ptr`` is still the storage this record describes."""
        if self.resident is not None and self.fetch is None:
            return True  # we hold the original storage, so its address is not reused
        for ref in self.aliases:
            tensor = ref()
            if tensor is not None and _storage_ptr(tensor) == ptr:
                return True
        return False


@dataclass(eq=False)
class UnitRecord:
    """One call of a wrapped layer in one forward pass.

    Attributes:
        index: Position in forward order (the schedule's unit id).
        offloaded: Records of kind ``OFFLOAD`` or ``MEASURE`` this unit owns.
        small: Records of kind ``SMALL`` this unit owns (released with the unit).
        grad_hook: Handle of the hook that reports the end of this unit's backward.
    """

    index: int
    offloaded: list[StorageRecord] = field(default_factory=list)
    small: list[StorageRecord] = field(default_factory=list)
    grad_hook: Any = None


@dataclass(eq=False)
class PassRecord:
    """One forward pass of the wrapped root and the activations its layers saved.

    Attributes:
        schedule: The prefetch policy over this pass's units.
        units: Units in forward order.
        storages: Every record of this pass (the finalizer releases them).
        by_key: Lookup of records by storage key, for aliasing and repeated saves.
        pass_id: A process-unique number, for traces.
        forward_done: The root forward that recorded this pass has returned.
        backward_started: A backward pass has unpacked one of its saved tensors.
    """

    schedule: PrefetchSchedule
    units: list[UnitRecord] = field(default_factory=list)
    storages: list[StorageRecord] = field(default_factory=list)
    by_key: dict[tuple[torch.device, int], StorageRecord] = field(default_factory=dict)
    pass_id: int = field(default_factory=lambda: next(_pass_ids))
    forward_done: bool = False
    backward_started: bool = False

    def find(self, key: tuple[torch.device, int]) -> StorageRecord | None:
        """The live record of the storage at ``key``, or ``None``."""
        record = self.by_key.get(key)
        if record is not None and record.same_storage_alive(key[1]):
            return record
        return None


def drop_resident(record: StorageRecord, stats: Any, transfers: dict[torch.device, Any]) -> None:
    """Drops the engine's device reference of ``record`` (see Note [Offload stash lifetime]).

    Args:
        record: The storage record.
        stats: The ``StatsRecorder`` whose resident byte count follows the reference.
        transfers: The engine's transfers by device (a fetched buffer is retired first).
    """
    if record.resident is None:
        return
    if record.fetch is not None:
        transfers[record.device].retire_fetch(record.fetch)
        record.fetch = None
    record.resident = None
    if record.in_flight is None:
        stats.change_resident(-record.nbytes)
    # else: the bytes go back to the stash, which subtracts them when the copy completes.


def free_pass(
    storages: list[StorageRecord],
    units: list[UnitRecord],
    stats: Any,
    transfers: dict[torch.device, Any],
) -> None:
    """Finalizer of a ``PassRecord``: autograd holds none of its saved tensors any more.

    Removes the layers' gradient hooks, drops the device references and returns the host
    blocks to their pool (a block whose offload copy is still in flight is returned by the
    stash once the copy completes).
    """
    for unit in units:
        if unit.grad_hook is not None:
            unit.grad_hook.remove()
    for record in storages:
        drop_resident(record, stats, transfers)
        if record.host is None:
            continue
        if record.in_flight is None:
            transfers[record.device].pool.release(record.host)
            record.host = None
        else:
            record.orphaned = True  # the stash releases the block when the copy completes


def _storage_ptr(tensor: torch.Tensor) -> int:
    local = tensor_compat.local_tensor_or_self(tensor)  # a DTensor's local shard
    return local.untyped_storage().data_ptr()
