"""PyTorch's offload-everything wrapper, able to save DTensors (``sm_activation_offloading`` off).

With ``sm_activation_offloading`` false, and for a model with no layers to prefetch for,
``offload_wrapper`` gives PyTorch's ``OffloadWrapper`` semantics: every tensor autograd saves
goes to the host when it is saved and comes back when backward reads it, with no prefetch.
``NativeOffloadWrapper`` is that wrapper (a subclass, so ``isinstance``, attribute forwarding
and state-dict keys are PyTorch's) with one difference: it can save DTensors.

Note [DTensors under PyTorch's offload wrapper]
    PyTorch's ``OffloadWrapper`` runs its module under ``save_on_cpu(pin_memory=True)``,
    whose pack hook copies each saved tensor into a new plain host tensor with ``copy_``. A
    DTensor (under tensor parallelism: the parameters and most activations) refuses to be
    copied into a plain tensor ("aten.copy_.default got mixed torch.Tensor and DTensor"), so
    a tensor-parallel model failed at its first forward. Here the same PyTorch hooks run on a
    DTensor's local shard, and the DTensor is rebuilt around the fetched shard with its mesh,
    placements and global shape, as the prefetching offloader does (``hooks.py``). Every
    other tensor goes through PyTorch's hooks untouched, so a model without DTensors is
    offloaded exactly as by PyTorch's wrapper. PyTorch's host copy is contiguous whatever
    the original's layout, and comes back so; when that changed the shard's layout (a saved
    transposed weight), the DTensor is given the global stride of a contiguous tensor, the
    one ``DTensor.from_local`` derives from a contiguous shard, so that its global and local
    layouts agree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from torch_sagemaker._torch_compat import checkpoint_wrapper as cw_compat
from torch_sagemaker.offload.hooks import DTensorMeta, split_dtensor


class _PackedDTensor:
    """What autograd keeps for a saved DTensor: PyTorch's packed shard and the metadata."""

    __slots__ = ("local_stride", "meta", "packed")

    def __init__(self, meta: DTensorMeta, local_stride: tuple[int, ...], packed: Any) -> None:
        self.meta = meta
        self.local_stride = local_stride
        self.packed = packed


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as ``torch.empty(shape).stride()``)."""
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class SaveOnCpuWithDTensors(saved_tensors_hooks):
    """``save_on_cpu(pin_memory=True)`` that saves DTensors by their local shard.

    Note [DTensors under PyTorch's offload wrapper].
    """

    def __init__(self) -> None:
        native = save_on_cpu(pin_memory=True)  # what PyTorch's OffloadWrapper uses
        pack_native, unpack_native = native.pack_hook, native.unpack_hook

        def pack(tensor: torch.Tensor) -> Any:
            local, meta = split_dtensor(tensor)
            if meta is None:
                return pack_native(tensor)
            return _PackedDTensor(meta, tuple(local.stride()), pack_native(local))

        def unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, _PackedDTensor):
                return unpack_native(packed)
            local = unpack_native(packed.packed)
            if tuple(local.stride()) == packed.local_stride:
                return packed.meta.wrap(local)
            return packed.meta.wrap(local, stride=_contiguous_stride(packed.meta.shape))

        super().__init__(pack, unpack)


class NativeOffloadWrapper(cw_compat.OffloadWrapper):
    """PyTorch's ``OffloadWrapper`` that also saves DTensors (tensor parallelism).

    Every tensor the wrapped module saves for backward is copied to (pinned, on CUDA) host
    memory and copied back when backward reads it. Note [DTensors under PyTorch's offload
    wrapper].

    Args:
        module: The module to wrap.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module with its saved tensors kept on the host."""
        with SaveOnCpuWithDTensors():
            return cw_compat.wrapped_module(self)(*args, **kwargs)


__all__ = ["NativeOffloadWrapper", "SaveOnCpuWithDTensors"]
