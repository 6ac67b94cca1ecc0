"""FSDP1 (``FullyShardedDataParallel``) following ``hybrid_shard_degree``.

This is the one place that changes FSDP's defaults; what it changes them to is decided by
``tsm.state.sharding_plan`` (``torch_sagemaker/sharding_plan.py``, whose docstring has the table).

SMP v2 users keep calling ``FSDP(model, sharding_strategy=..., auto_wrap_policy=..., ...)``
and expect sharding to follow the SMP config. After ``tsm.init()`` this module wraps
``FullyShardedDataParallel.__init__`` (installed by ``install()``, undone by
``uninstall()``) so that FSDP gets the strategy and the mesh of the plan.

Why: without groups, FSDP1 shards over the whole default group (so TP ranks would be
sharded together) and, on CPU, HYBRID_SHARD silently degenerates to NO_SHARD over a group of
one (ranks never synchronise). Experts modules split by ``tsm.transform`` become units of
their own on the expert groups (``sharding/experts.py``).

Note [Which FSDP1 instances the patch changes]
    Only the ones that follow the SMP config: a root ``FullyShardedDataParallel(model)``
    called **without** ``process_group`` and ``device_mesh``, on a model not marked with
    ``exempt(model)``, and the units its auto-wrap policy builds inside it. An instance given
    an explicit ``process_group`` or ``device_mesh`` (a teacher or EMA model, a third-party
    wrapper) keeps the strategy and the groups its caller chose; so does every instance on an
    ``exempt`` model. Both still accept SMP's ``post_param_init_fn`` keyword, and a unit
    given a ``device_mesh`` sliced out of ``tsm.state``'s meshes still gets the state-dict
    layout of Note [FSDP1 sharded state dict layout] (unless exempt): without it its sharded
    checkpoints would be wrong. Before ``tsm.init`` (and after ``tsm.state.reset()``) every
    instance is left alone.

In a job over several hosts, a root that follows the SMP config and has replicas
(HYBRID_SHARD, or NO_SHARD over the replicas) gets ``fsdp1_replicas.FSDP1ReplicaReduction``:
the all-reduce across replicas runs while backward computes (Note [FSDP1 deferred replica
reduction]; ``TSM_OVERLAP_REPLICA_REDUCTION``: ``0`` keeps FSDP1's synchronous one, ``1``
defers on one host too).

It also accepts SMP's extra keyword ``post_param_init_fn(module)``: called once on the
module being wrapped after ``param_init_fn`` has materialised its last meta tensor (or
before wrapping when nothing is on meta), e.g. to re-tie shared weights before FSDP flattens
them. The resolved sharding is logged once.

Every other change this library makes to PyTorch objects (when it is installed, why, how to
undo it) is listed once, in docs/architecture.md ("Side effects and patches").

The explicit spelling that needs none of this (and works without ``tsm.init``'s patch):

    FSDP(model, device_mesh=tsm.state.fsdp_mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    FSDP(model, device_mesh=tsm.state.fsdp_shard_mesh)               # FULL_SHARD over dp ranks
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from torch_sagemaker.context_parallel import check_prepared
from torch_sagemaker.logger import log_rank0
from torch_sagemaker.moe.experts import is_split
from torch_sagemaker.sharding import (
    cache_flush,
    experts,
    fsdp1_layout,
    fsdp1_local_state_dict,
    fsdp1_replicas,
    fsdp1_tied,
)
from torch_sagemaker.state import state

_original_init = FullyShardedDataParallel.__init__
# Per construction: nesting depth (auto-wrap constructs child FSDP units recursively) and
# whether the root being built is left alone (Note [Which FSDP1 instances the patch changes]).
_local = threading.local()
_logged: set[tuple] = set()
_EXEMPT_ATTR = "_tsm_fsdp1_exempt"


def exempt(module: nn.Module) -> nn.Module:
    """Marks ``module`` so that ``tsm.init``'s FSDP1 patch leaves its FSDP units alone.

    For a second model in the same process (a teacher, an EMA copy) that must not follow
    the SMP config: ``FSDP(exempt(teacher), ...)`` then runs PyTorch's constructor as called
    (Note [Which FSDP1 instances the patch changes]).

    Args:
        module: The module to be wrapped with FSDP1.

    Returns:
        ``module`` itself, marked.
    """
    setattr(module, _EXEMPT_ATTR, True)
    return module


def is_exempt(module: nn.Module) -> bool:
    """Whether ``exempt(module)`` marked ``module``."""
    return bool(getattr(module, _EXEMPT_ATTR, False))


def _wrap_post_param_init(
    module: nn.Module, param_init_fn: Callable | None, post_param_init_fn: Callable
) -> Callable | None:
    """Calls ``post_param_init_fn(module)`` once no meta tensor is left in ``module``.

    That is right away if ``module`` has none, else after the ``param_init_fn`` call that
    materialised the last meta-device parameter or buffer.
    """

    def has_meta() -> bool:
        return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))

    if param_init_fn is None or not has_meta():
        post_param_init_fn(module)
        return param_init_fn

    done = False

    @functools.wraps(param_init_fn)
    def init_then_post(submodule: nn.Module) -> None:
        nonlocal done
        param_init_fn(submodule)
        if not done and not has_meta():
            done = True
            post_param_init_fn(module)

    return init_then_post


def _refuse_explicit_group_for_split_model(module: nn.Module) -> None:
    """Refuses an explicit group or mesh for a model whose parts need the plan's own meshes.

    An explicit ``process_group`` or ``device_mesh`` opts the instance out of the SMP config
    (this module's docstring), but split experts must be FSDP units over the expert
    data-parallel ranks and a context-parallel model over the data x context ranks: one user
    group for the whole model would average gradients across experts, or shard across
    context ranks, and train wrongly without an error.

    Raises:
        ValueError: ``module`` has experts split by ``tsm.transform``, or context parallelism
            is on.
    """
    why = []
    if experts.expert_modules(module):
        why.append("its experts are split over the expert parallel ranks")
    if state.cp_size > 1:
        why.append(f"context_parallel_degree={state.cp_size}")
    if why:
        raise ValueError(
            f"FSDP({type(module).__name__}, process_group=... or device_mesh=...): "
            f"{' and '.join(why)}, so this model needs the meshes tsm chooses from its config "
            "(experts and context ranks get their own), which an explicit group opts out of. "
            "Leave process_group and device_mesh out, or, if you manage every group yourself, "
            "mark the model with torch_sagemaker.sharding.exempt(model)."
        )


def _patched_init(
    self: FullyShardedDataParallel,
    module: nn.Module,
    process_group: Any = None,
    sharding_strategy: ShardingStrategy | None = None,
    *args: Any,
    post_param_init_fn: Callable | None = None,
    **kwargs: Any,
) -> None:
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.explicit = process_group is not None or kwargs.get("device_mesh") is not None
        _local.exempt = is_exempt(module)
    _local.depth = depth + 1
    try:
        if post_param_init_fn is not None:
            kwargs["param_init_fn"] = _wrap_post_param_init(
                module, kwargs.get("param_init_fn"), post_param_init_fn
            )
        follows = state.initialized and not (_local.explicit or _local.exempt)
        if depth == 0 and state.initialized and _local.explicit and not _local.exempt:
            _refuse_explicit_group_for_split_model(module)
        if follows:
            if depth == 0:
                check_prepared(module, state.cp_size, "FSDP")
                # hybrid_shard_degree=0 on several hosts: the strategy picks the layout.
                state.settle_degree_zero(sharding_strategy)
            if depth == 0 and experts.check_ready(module):
                experts.fsdp1_root_kwargs(module, kwargs)  # experts and fp32 routers as own units
            # Auto-wrapped children get the root's resolved strategy, which the plan maps to
            # itself; an experts unit gets its own placement (sharding/experts.py).
            placement = state.sharding_plan.fsdp1(sharding_strategy, experts=is_split(module))
            mesh = state.mesh(placement.mesh)
            process_group, kwargs["device_mesh"] = None, mesh
            sharding_strategy = placement.strategy
            key = (placement.strategy, tuple(mesh.shape))
            if depth == 0 and key not in _logged:
                _logged.add(key)
                log_rank0(
                    f"FSDP: {placement.strategy.name} over mesh {placement.mesh} "
                    f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)} (hybrid_shard_degree="
                    f"{state.layout.requested_hybrid_shard_degree})"
                )
        frozen = fsdp1_layout.frozen_parameters(module)  # (before FSDP1 flattens them)
        _original_init(self, module, process_group, sharding_strategy, *args, **kwargs)
        if state.initialized and not _local.exempt and kwargs.get("device_mesh") is not None:
            fsdp1_layout.adapt(self, frozen)
            fsdp1_local_state_dict.allow(self)  # Note [LOCAL_STATE_DICT on SMP's meshes]
        if follows and depth == 0 and state.fsdp_cache_flush_warnings:
            cache_flush.watch(self)
        if (
            follows
            and depth == 0
            and fsdp1_replicas.wanted(several_hosts=state.local_world_size < state.world_size)
        ):
            # Note [FSDP1 deferred replica reduction]; a root without replicas gets none.
            reduction = fsdp1_replicas.FSDP1ReplicaReduction(self)
            if reduction.units:  # it logs at the first backward
                self.replica_reduction = reduction  # type: ignore[assignment]
    finally:
        _local.depth = depth


def install() -> None:
    """Makes ``FullyShardedDataParallel(...)`` follow the SMP config (idempotent).

    Also makes FSDP1 keep tied tensor-parallel parameters tied (Note [Tied DTensor
    parameters under FSDP1] in ``fsdp1_tied``) and lets its units give local state dicts
    (Note [LOCAL_STATE_DICT on SMP's meshes] in ``fsdp1_local_state_dict``).
    """
    FullyShardedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]
    fsdp1_tied.install()
    fsdp1_local_state_dict.install()


def uninstall() -> None:
    """Restores PyTorch's own ``FullyShardedDataParallel.__init__`` and flattening."""
    FullyShardedDataParallel.__init__ = _original_init  # type: ignore[method-assign]
    fsdp1_tied.uninstall()
    fsdp1_local_state_dict.uninstall()
    fsdp1_replicas.uninstall()
