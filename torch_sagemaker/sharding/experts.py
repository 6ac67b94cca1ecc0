"""FSDP for expert parallel models: experts sharded over the ranks that hold the same experts.

An expert's parameters exist on the ``dp_size / ep`` data-parallel ranks with the same EP
rank (``Layout.expert_dp_groups``), a different group from every other parameter's, and
FSDP1 cannot mix two groups in one FlatParameter. So each experts module that
``tsm.transform`` split becomes its own FSDP unit on its own mesh:

| hybrid_shard_degree | other parameters (``fsdp1.resolve_sharding``) | experts |
|---------------------|--------------------------------------------|----------------------------------|
| 0 | the script's strategy over all dp ranks | same strategy over the shard group (it holds all
  their ranks) |
| 1 | NO_SHARD over the dp ranks | NO_SHARD over the same-expert replicas |
| k >= 2 | HYBRID_SHARD (k shards x replicas) | HYBRID_SHARD over ``tsm.state.expert_fsdp_mesh`` (k
  shards x same-expert replicas); FULL_SHARD over the shard group when there is one such replica |

- FSDP1: the patched ``FullyShardedDataParallel.__init__`` (``fsdp1``) extends the script's
  ``auto_wrap_policy`` so that experts modules are wrapped as units, and gives those units
  the mesh above (``fsdp1_expert_sharding``). Under mixed precision the routers of
  ``MoELayer`` are added to ``MixedPrecision._module_classes_to_ignore``: FSDP then wraps
  them as fp32 units, and ``MoELayer`` calls them on fp32 input, so the router stays in fp32.
- FSDP2: ``shard_model`` calls ``fully_shard_experts`` before wrapping the layers: each experts
  module gets ``fully_shard(mesh=expert_fsdp2_mesh())``, each router an fp32 policy.

Gradients: see Note [Expert gradient scale] in ``torch_sagemaker.moe.experts``; FSDP's
average over the expert group then equals the mean over all data-parallel ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.moe.experts import is_split
from torch_sagemaker.moe.moe_layer import MoELayer
from torch_sagemaker.state import state

_ZERO2 = (ShardingStrategy.SHARD_GRAD_OP, fsdp1_compat.HYBRID_SHARD_ZERO2)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model`` that ``tsm.transform`` split over the EP ranks."""
    return [m for m in model.modules() if is_split(m)]


def routers(model: nn.Module) -> list[nn.Module]:
    """The routers of the ``MoELayer`` modules of ``model``."""
    return [getattr(m, m.spec.router) for m in model.modules() if isinstance(m, MoELayer)]


def check_ready(model: nn.Module) -> bool:
    """Whether ``model`` has split experts; raises if expert parallelism is on but it has none.

    Raises:
        ValueError: If ``expert_parallel_degree > 1`` and ``tsm.transform`` did not split the
            model's experts (every rank would train all experts on different data).
    """
    found = bool(expert_modules(model))
    if state.initialized and state.ep_size > 1 and not found:
        raise ValueError(
            f"expert_parallel_degree={state.ep_size}, but {type(model).__name__} "
            "has no experts split "
            "over the expert parallel ranks. "
            "Call model = tsm.transform(model, config=MoEConfig(...)) "
            "before wrapping it with FSDP, or set expert_parallel_degree=1."
        )
    return found


def fsdp1_expert_sharding(strategy: ShardingStrategy) -> tuple[ShardingStrategy, DeviceMesh]:
    """Strategy and mesh of an experts unit, given the strategy of the other units (table above)."""
    layout = state.layout
    zero2 = strategy in _ZERO2
    if layout.requested_hybrid_shard_degree == 1 or strategy is ShardingStrategy.NO_SHARD:
        return ShardingStrategy.NO_SHARD, state.expert_fsdp_mesh["edp_replicate"]
    if layout.edp_replicate == 1:
        return (
            ShardingStrategy.SHARD_GRAD_OP if zero2 else ShardingStrategy.FULL_SHARD
        ), state.fsdp_shard_mesh
    return (
        fsdp1_compat.HYBRID_SHARD_ZERO2 if zero2 else ShardingStrategy.HYBRID_SHARD
    ), state.expert_fsdp_mesh


class _WithExperts(fsdp1_compat.WrapPolicy):
    """A ``_Policy`` (e.g. ``ModuleWrapPolicy``) that also wraps the given experts modules."""

    def __init__(self, inner: fsdp1_compat.Policy, targets: list[nn.Module]) -> None:
        self._inner, self._targets = inner, targets

    def run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        """The inner policy's units, plus every target module that is not ignored."""
        result = fsdp1_compat.run_policy(self._inner, root_module, ignored_modules, root_kwargs)
        for module in self._targets:
            if module not in ignored_modules:
                result.setdefault(module, dict(root_kwargs))
        return result


def _expert_group_size() -> int:
    layout = state.layout
    return layout.edp_replicate * layout.hybrid_shard_degree


def fsdp1_root_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Extends the root FSDP1 call's ``auto_wrap_policy`` and ``mixed_precision`` in place.

    Note [FSDP1 experts on one rank]: when no other rank holds this rank's experts
    (``ep == dp_size``) there is nothing to shard or average, and PyTorch's FSDP1 cannot
    keep DTensor parameters in a unit that degenerates to NO_SHARD with
    ``use_orig_params=True`` (it re-creates the DTensor views on every unshard and then
    refuses to write them back). The experts are then left out of FSDP
    (``ignored_modules``): they stay local fp32 DTensors, compute in the dtype of the tokens
    they receive, and their gradients need no reduction (Note [Expert gradient scale]).

    Raises:
        ValueError: For ``hybrid_shard_degree=1`` (NO_SHARD) with several ranks per expert
            and ``use_orig_params=True``, which FSDP1 cannot run (see above); FSDP2 can.
    """
    targets = expert_modules(model)
    if _expert_group_size() == 1:
        key = "ignored_states" if kwargs.get("ignored_states") is not None else "ignored_modules"
        kwargs[key] = [*(kwargs.get(key) or []), *targets]
        # FSDP never calls param_init_fn on ignored modules: delayed init happens here.
        init_fn = kwargs.get("param_init_fn")
        for module in targets:
            if init_fn is not None and any(p.is_meta for p in module.parameters()):
                init_fn(module)
        targets = []
    elif state.layout.requested_hybrid_shard_degree == 1 and kwargs.get("use_orig_params"):
        raise ValueError(
            "hybrid_shard_degree=1 (NO_SHARD) with expert_parallel_degree="
            f"{state.ep_size} and use_orig_params=True: PyTorch's FSDP1 cannot keep the expert "
            "DTensors in NO_SHARD units (Note [FSDP1 experts on one rank] in "
            "torch_sagemaker/sharding/experts.py). Use hybrid_shard_degree >= 2 or 0, or FSDP2 "
            "(torch_sagemaker.sharding.shard_model)."
        )
    ids = {id(m) for m in targets}
    policy = kwargs.get("auto_wrap_policy")
    wrap_experts = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)
    if not targets:
        pass
    elif policy is None:
        kwargs["auto_wrap_policy"] = wrap_experts
    elif isinstance(policy, fsdp1_compat.Policy):
        kwargs["auto_wrap_policy"] = _WithExperts(policy, targets)
    else:
        kwargs["auto_wrap_policy"] = functools.partial(
            fsdp1_compat.or_policy, policies=[policy, wrap_experts]
        )
    mp = kwargs.get("mixed_precision")
    router_classes = {type(r) for r in routers(model)}
    if (
        isinstance(mp, MixedPrecision)
        and router_classes
        and mp.param_dtype not in (None, torch.float32)
    ):
        ignored = tuple(set(fsdp1_compat.module_classes_to_ignore(mp)) | router_classes)
        kwargs["mixed_precision"] = fsdp1_compat.with_module_classes_to_ignore(mp, ignored)


def expert_fsdp2_mesh() -> DeviceMesh:
    """The mesh ``fully_shard`` gets for experts.

    2-D when there are same-expert replicas, else the shard mesh.
    """
    if state.layout.edp_replicate > 1:
        return state.expert_fsdp_mesh
    return state.fsdp_shard_mesh


def fully_shard_experts(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None, **kwargs: Any
) -> list[nn.Module]:
    """FSDP2 units for experts modules (expert mesh) and, under mixed precision, fp32 routers.

    Args:
        model: The model, before its layers are wrapped.
        mesh: The mesh of the other parameters (routers are sharded like them).
        mp_policy: The mixed precision policy of the other units.
        **kwargs: Other ``fully_shard`` arguments.

    Returns:
        The modules wrapped here.
    """
    if not check_ready(model):
        return []
    wrapped = []
    extra: dict[str, Any] = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for module in expert_modules(model):
        fully_shard(module, mesh=expert_fsdp2_mesh(), **extra, **kwargs)
        wrapped.append(module)
    if mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32):
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for router in routers(model):
            fully_shard(router, mesh=mesh, mp_policy=fp32, **kwargs)
            wrapped.append(router)
    return wrapped


__all__ = [
    "check_ready",
    "expert_fsdp2_mesh",
    "expert_modules",
    "fsdp1_expert_sharding",
    "fsdp1_root_kwargs",
    "fully_shard_experts",
    "routers",
]
