"""FSDP for expert parallel models: experts sharded over the ranks that hold the same experts.

An expert's parameters exist on the ``dp_size / ep`` data-parallel ranks with the same EP
rank (``Layout.expert_dp_groups``), a different group from every other parameter's, and
FSDP1 cannot mix two groups in one FlatParameter. So each experts module that
``tsm.transform`` split becomes its own FSDP unit on its own mesh, the one
``tsm.state.sharding_plan`` names for experts (the table in ``torch_sagemaker/sharding_plan.py``).
This module only builds those units:

- FSDP1: the patched ``FullyShardedDataParallel.__init__`` (``fsdp1``) extends the script's
  ``auto_wrap_policy`` so that experts modules are wrapped as units, and gives those units
  the plan's expert placement. Under mixed precision the routers of
  ``MoELayer`` are added to ``MixedPrecision._module_classes_to_ignore``: FSDP then wraps
  them as fp32 units, and ``MoELayer`` calls them on fp32 input, so the router stays in fp32.
- FSDP2: ``shard_model`` calls ``fully_shard_experts`` before wrapping the layers: each experts
  module gets ``fully_shard`` on the plan's expert mesh, each router an fp32 policy.

Gradients: see Note [Expert gradient scale] in ``torch_sagemaker.moe.experts``; FSDP's
average over the expert group then equals the mean over all data-parallel ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.moe.experts import is_split
from torch_sagemaker.moe.moe_layer import MoELayer
from torch_sagemaker.sharding import mixed_step
from torch_sagemaker.state import state


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
    plan = state.sharding_plan
    problem = plan.fsdp1_expert_problem(bool(kwargs.get("use_orig_params")))
    if problem:
        raise ValueError(problem)
    if plan.expert_group_size == 1:
        key = "ignored_states" if kwargs.get("ignored_states") is not None else "ignored_modules"
        kwargs[key] = [*(kwargs.get(key) or []), *targets]
        # FSDP never calls param_init_fn on ignored modules: delayed init happens here.
        init_fn = kwargs.get("param_init_fn")
        for module in targets:
            if init_fn is not None and any(p.is_meta for p in module.parameters()):
                init_fn(module)
        # Note [Optimizer steps over DTensor and plain parameters] in mixed_step.py.
        mixed_step.install()
        targets = []
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
    expert_mesh = state.mesh(state.sharding_plan.fsdp2_experts)
    extra: dict[str, Any] = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for module in expert_modules(model):
        fully_shard(module, mesh=expert_mesh, **extra, **kwargs)
        wrapped.append(module)
    if mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32):
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for router in routers(model):
            fully_shard(router, mesh=mesh, mp_policy=fp32, **kwargs)
            wrapped.append(router)
    return wrapped


__all__ = [
    "check_ready",
    "expert_modules",
    "fsdp1_root_kwargs",
    "fully_shard_experts",
    "routers",
]
