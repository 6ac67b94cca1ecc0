"""The ``saved_tensors_hooks`` glue: what a saved tensor is, and how to rebuild it.

``pack`` decides per tensor: tensors saved outside the wrapped layers, parameters, buffers
and tensor types we cannot move go back to autograd untouched; everything else is tied to
the *storage* it views and handed to the engine, which offloads each storage once.
``unpack`` rebuilds the exact view (dtype, size, stride, storage offset) on top of the
storage the engine makes resident, so two saved views of one storage still alias after the
round trip, and a DTensor is rebuilt around its local shard with its original mesh,
placements, shape and stride.

Note [In-place writes to saved activations]
    Autograd raises when a tensor it saved was written in place before backward reads it
    (its version counter moved). With ``saved_tensors_hooks`` that check is the hooks' job:
    autograd holds only what ``pack`` returned. Without it, a tensor kept on the device gave
    backward its new values (wrong gradients, no error), and an offloaded one gave the old
    values or, with the copy still in flight on a GPU, a mix. So ``pack`` records the
    tensor's version and ``unpack`` compares it, raising autograd's error. An offloaded
    tensor is held weakly: one freed before backward can no longer be written, and a write
    between its save and its release is not seen (autograd would have raised).

Note [Saved tensors handed back without their graph]
    What ``pack`` returns, autograd keeps in the graph. A tensor that is the output of the
    operation saving it (``log_softmax``'s result, saved by its own backward) holds that
    graph through its ``grad_fn``: handing it back as is made a cycle graph -> tensor ->
    graph through C++, which Python's collector cannot see. The graph of a forward whose
    backward never ran (a step skipped on a non-finite loss, a validation loss computed in
    training mode) then lived for good, and with it its pass: device activations and host
    buffers, every such step. Without the hooks autograd saves such outputs without their
    ``grad_fn``; ``pack`` now hands back a tensor kept as it is ``detach()``ed (same
    storage, same version counter, so the in-place check stands) and autograd restores the
    gradient edges when it unpacks.

The hooks talk to the engine through ``SavedTensorSink``, a protocol defined here: the
engine (``engine.OffloadEngine``) installs the hooks and implements the protocol, and this
module never imports the engine, so the two import one way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from torch_sagemaker._torch_compat import tensor as tensor_compat

if TYPE_CHECKING:
    from torch_sagemaker.offload.records import PassRecord, StorageRecord, UnitRecord
    from torch_sagemaker.offload.stats import StatsRecorder

_dtensor_type: Any = None


def _dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor``, imported on first use (it is a heavy import)."""
    global _dtensor_type
    if _dtensor_type is None:
        from torch.distributed.tensor import DTensor

        _dtensor_type = DTensor
    return _dtensor_type


@dataclass(frozen=True)
class DTensorMeta:
    """What ``DTensor.from_local`` needs to rebuild a DTensor around its local shard."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor, stride: tuple[int, ...] | None = None) -> torch.Tensor:
        """The DTensor around ``local``: this mesh, placements and shape.

        Args:
            local: The local shard.
            stride: The global stride, if not the recorded one (the shard's layout changed).
        """
        with torch.no_grad():  # wrapping only; no graph edge from the shard to the DTensor
            return _dtensor_class().from_local(
                local,
                self.mesh,
                self.placements,
                run_check=False,
                shape=self.shape,
                stride=self.stride if stride is None else stride,
            )


@dataclass(frozen=True)
class ViewSpec:
    """How a saved tensor views its storage."""

    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int
    dtensor: DTensorMeta | None = None

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved tensor as a view of ``flat`` (a ``uint8`` tensor over a whole storage)."""
        local = torch.empty(0, dtype=self.dtype, device=flat.device)
        local.set_(flat.untyped_storage(), self.storage_offset, self.size, self.stride)
        return local if self.dtensor is None else self.dtensor.wrap(local)


class SavedTensorSink(Protocol):
    """What ``pack``/``unpack`` need from the offload engine (``OffloadEngine`` is one)."""

    stats: StatsRecorder

    def current_unit(self) -> UnitRecord | None:
        """The innermost wrapped layer running in the current forward pass, if any."""
        ...

    def active_pass(self) -> PassRecord:
        """The pass whose forward is running."""
        ...

    def on_compute_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device type whose memory offloading frees."""
        ...

    def is_module_state(self, key: tuple[torch.device, int]) -> bool:
        """Whether ``key`` is the storage of a parameter or buffer of the root module."""
        ...

    def save_storage(
        self,
        unit: UnitRecord,
        local: torch.Tensor,
        tensor: torch.Tensor,
        key: tuple[torch.device, int],
    ) -> tuple[StorageRecord, bool]:
        """Records a saved tensor; returns its storage's record and whether to keep it as is."""
        ...

    def note_backward(self, pass_record: PassRecord, unit: int) -> None:
        """A saved tensor of ``unit`` is being unpacked (its backward may have started)."""
        ...

    def resident_storage(self, pass_record: PassRecord, record: StorageRecord) -> torch.Tensor:
        """The device storage of ``record``, fetched now if it is not resident."""
        ...


class SavedRef:
    """What autograd keeps instead of a saved tensor of a wrapped layer.

    Holding it keeps the pass (and so the host copies) alive; see ``records.py``.
    ``tensor`` is set when the original stays on the device and is returned as is;
    ``original`` is a weak reference to it otherwise. ``version`` is its write count when it
    was saved (Note [In-place writes to saved activations]).
    """

    __slots__ = ("pass_record", "record", "unit", "view", "tensor", "original", "version")

    def __init__(
        self,
        pass_record: PassRecord,
        record: StorageRecord,
        unit: int,
        view: ViewSpec,
        saved: torch.Tensor,
        keep: bool,
    ) -> None:
        self.pass_record = pass_record
        self.record = record
        self.unit = unit
        self.view = view
        self.tensor = _without_graph(saved) if keep else None
        self.original = None if keep else weakref.ref(saved)
        self.version = tensor_compat.write_count(saved)

    def check_unmodified(self) -> None:
        """Raises as autograd does if the saved tensor was written in place since it was saved.

        Raises:
            RuntimeError: The tensor (or another view of its storage) was modified in place.
        """
        saved = self.tensor if self.tensor is not None else cast(Any, self.original)()
        if saved is None:  # freed since: the original can no longer be written
            return
        now = tensor_compat.write_count(saved)
        if now != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{saved.dtype} {list(saved.shape)}] saved by wrapped layer "
                f"{self.unit} is at version {now}; expected version {self.version} instead. "
                "The offload wrapper checks this as autograd does without it: make the "
                "operation that writes it out-of-place (for example `x = x + y` instead of "
                "`x += y`), or clone the tensor before writing to it."
            )


def split_dtensor(tensor: torch.Tensor) -> tuple[torch.Tensor, DTensorMeta | None]:
    """Returns the tensor holding the data (a DTensor's local shard) and the DTensor metadata."""
    if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
        return tensor, None
    if isinstance(tensor, _dtensor_class()):
        # ``_local_tensor`` is the shard object itself; ``to_local()`` would make a new view
        # per call, whose weak references die at once (see StorageRecord.aliases).
        meta = DTensorMeta(
            tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride())
        )
        return tensor_compat.local_tensor(tensor), meta
    return tensor, None


def is_parameter_like(tensor: torch.Tensor) -> bool:
    """Whether autograd saved a parameter, a leaf that requires grad, or a view of either.

    These live as long as the model (or the caller) anyway: offloading them would spend
    copies and host memory and free nothing. FSDP1 hands modules plain-tensor views of its
    flat parameter, hence the look at ``_base``. The test is on the view's base because a
    view made inside a custom ``Function.forward`` can itself claim to be a leaf that
    requires grad.
    """
    base = tensor_compat.view_base(tensor)
    root = base if base is not None else tensor
    return isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad)


def is_movable(local: torch.Tensor) -> bool:
    """Whether the storage behind ``local`` can be copied byte for byte and rebuilt."""
    return (
        type(local) is torch.Tensor
        and local.layout == torch.strided
        and local.device.type not in ("meta", "lazy")
        and not local.is_conj()
        and not local.is_neg()
        and local.untyped_storage().nbytes() > 0
    )


def storage_key(local: torch.Tensor) -> tuple[torch.device, int]:
    """``(device, data_ptr)`` of the storage behind ``local``."""
    return local.device, local.untyped_storage().data_ptr()


def flat_storage(local: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over the whole storage of ``local`` (shares its memory)."""
    flat = torch.empty(0, dtype=torch.uint8, device=local.device)
    return flat.set_(local.untyped_storage())


def view_spec(local: torch.Tensor, meta: DTensorMeta | None) -> ViewSpec:
    """The ``ViewSpec`` that rebuilds ``local`` (and its DTensor) from its storage."""
    offset = cast(int, local.storage_offset())  # an int in eager mode (SymInt when traced)
    return ViewSpec(local.dtype, local.size(), tuple(local.stride()), offset, meta)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Logical size in bytes (used for the counters of tensors that are not moved)."""
    return tensor.numel() * tensor.element_size()


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """``saved_tensors_hooks`` that route the wrapped layers' saved tensors to ``engine``."""

    def __init__(self, engine: SavedTensorSink) -> None:
        engine_ref = weakref.ref(engine)  # the hooks outlive nothing, but avoid a cycle

        def pack(tensor: torch.Tensor) -> Any:
            return _pack(engine_ref(), tensor)

        def unpack(packed: Any) -> torch.Tensor:
            return _unpack(engine_ref(), packed)

        super().__init__(pack, unpack)


def _without_graph(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as autograd may keep it (Note [Saved tensors handed back without their graph])."""
    return tensor.detach() if tensor.grad_fn is not None else tensor


def _pack(engine: SavedTensorSink | None, tensor: torch.Tensor) -> Any:
    unit = engine.current_unit() if engine is not None else None
    if unit is None:
        if engine is not None:
            engine.stats.add("bytes_outside_layers", tensor_bytes(tensor))
        return _without_graph(tensor)
    assert engine is not None  # the unit came from it
    local, meta = split_dtensor(tensor)
    if is_parameter_like(tensor) or is_parameter_like(local):
        return _without_graph(tensor)
    if not is_movable(local) or not engine.on_compute_device(local):
        engine.stats.add("bytes_kept", tensor_bytes(tensor))
        return _without_graph(tensor)
    key = storage_key(local)
    if engine.is_module_state(key):
        return tensor  # a buffer (or a view of one): the module keeps it alive anyway
    record, keep_original = engine.save_storage(unit, local, tensor, key)
    return SavedRef(
        engine.active_pass(), record, unit.index, view_spec(local, meta), tensor, keep_original
    )


def _unpack(engine: SavedTensorSink | None, packed: Any) -> torch.Tensor:
    if not isinstance(packed, SavedRef):
        return packed
    if engine is None:
        raise RuntimeError(
            "An offloaded activation was unpacked after its offload wrapper was deleted; keep "
            "the wrapped model alive until backward has run."
        )
    packed.check_unmodified()
    engine.note_backward(packed.pass_record, packed.unit)
    if packed.tensor is not None:
        return packed.tensor
    flat = engine.resident_storage(packed.pass_record, packed.record)
    return packed.view.rebuild(flat)
