"""``DistributedDataParallel`` refuses a model with DTensor parameters (split experts, TP).

Note [DDP and DTensor parameters]
    DDP treats every parameter as one replica of the same plain tensor: at wrap time it
    broadcasts rank 0's values over its group, and after each backward it averages the
    gradients over it. ``tsm.transform`` leaves DTensor parameters, which break that in two
    ways, and PyTorch's DDP fails on both with an error about mixing ``torch.Tensor`` and
    ``DTensor`` in ``aten.cat`` that names neither cause nor fix:

    - Split experts (``expert_parallel_degree > 1``): each rank holds other experts, on the
      EP mesh. DDP would broadcast rank 0's experts over ranks that hold other experts, and
      average expert gradients over every data-parallel rank instead of over the ranks that
      hold the same experts (sharding/experts.py).
    - Tensor parallelism (``tensor_parallel_degree > 1``): every parameter is a DTensor on
      the TP mesh, a shard or a replica. PyTorch's composition helper,
      ``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``, hands DDP the local
      tensors as plain parameters and rebuilds the DTensors in a forward pre-hook. It keeps
      the model's state wrong for everything but the forward: before the first forward
      ``state_dict()`` holds each rank's local shard as a plain tensor under the full name (a
      checkpoint would save one TP rank's shard as the whole weight); the pre-hook sets the
      rebuilt DTensors as plain attributes, so after the first forward ``parameters()`` and
      ``state_dict()`` are empty (tiny Llama, tp 2 x dp 2, torch 2.13: 21 parameters
      before, 0 after); a tied weight is localized under one name only; and a gradient
      norm over plain local shards differs per TP rank. FSDP1 and FSDP2 keep the DTensors
      and reduce over the data-parallel ranks alone.

    So ``install()`` (called by ``tsm.init``) wraps ``DistributedDataParallel.__init__`` to
    raise before DDP does anything when the module holds split experts or any DTensor
    parameter, naming FSDP as the fix (with ``hybrid_shard_degree=1`` FSDP replicates
    without sharding, as DDP does). Every other module goes to PyTorch's ``__init__``
    unchanged. The check reads the model, not ``tsm.state``: DTensor parameters are wrong
    under DDP whatever the state.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from torch_sagemaker.moe.experts import is_split

_original_init = DistributedDataParallel.__init__

_FSDP_FIX = (
    "wrap the model with torch_sagemaker.sharding.shard_model(model) (FSDP2) or "
    "FullyShardedDataParallel(model, auto_wrap_policy=..., use_orig_params=True) (FSDP1)"
)


def check_no_split_experts(module: nn.Module) -> None:
    """Raises if ``module`` holds experts split over the expert parallel ranks.

    Raises:
        ValueError: If ``tsm.transform`` split experts of ``module`` (Note [DDP and DTensor
            parameters]).
    """
    names = [name for name, m in module.named_modules() if is_split(m)]
    if not names:
        return
    raise ValueError(
        f"DistributedDataParallel({type(module).__name__}): tsm.transform split the experts "
        f"of {len(names)} MoE layer(s) (first: {names[0] or 'the module itself'}) over the "
        "expert parallel ranks, so each rank holds other experts. DDP would broadcast rank "
        "0's experts to every rank and average expert gradients over all data-parallel "
        f"ranks instead of the ranks that hold the same experts. Expert parallelism needs "
        f"FSDP: {_FSDP_FIX}, or set expert_parallel_degree=1 to use DDP."
    )


def check_no_dtensor_parameters(module: nn.Module) -> None:
    """Raises if ``module`` has DTensor parameters (tensor parallelism, for one).

    Raises:
        ValueError: If a parameter of ``module`` is a DTensor (Note [DDP and DTensor
            parameters]).
    """
    found = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if not found:
        return
    name, param = found[0]
    mesh = param.device_mesh
    dims: tuple[object, ...] = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    raise ValueError(
        f"DistributedDataParallel({type(module).__name__}): {len(found)} of its parameters "
        f"are DTensors (first: {name}, placements {tuple(param.placements)} on mesh "
        f"dimensions {dims} of sizes {tuple(mesh.shape)}), as tsm.transform leaves them with "
        "tensor_parallel_degree > 1. DDP takes plain tensors only: it would broadcast and "
        "average them as whole replicas, and PyTorch's helper that hands it the local "
        "tensors instead drops them from parameters() and state_dict() after the first "
        f"forward. Tensor parallelism needs FSDP, which reduces over tsm.state's data-"
        f"parallel ranks: {_FSDP_FIX}; tsm.init(..., hybrid_shard_degree=1) replicates "
        "without sharding, as DDP does. Or set tensor_parallel_degree=1 to use DDP."
    )


def _patched_init(self: DistributedDataParallel, module: nn.Module, *args: Any, **kwargs: Any):
    check_no_split_experts(module)
    check_no_dtensor_parameters(module)
    _original_init(self, module, *args, **kwargs)


def install() -> None:
    """Makes ``DistributedDataParallel(...)`` refuse DTensor parameters (idempotent)."""
    DistributedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]


def uninstall() -> None:
    """Restores PyTorch's own ``DistributedDataParallel.__init__``."""
    DistributedDataParallel.__init__ = _original_init  # type: ignore[method-assign]
