"""FSDP1 (``FullyShardedDataParallel``) following ``hybrid_shard_degree``.

This is the one place that changes FSDP's defaults.

SMP v2 users keep calling ``FSDP(model, sharding_strategy=..., auto_wrap_policy=..., ...)``
and expect sharding to follow the SMP config. After ``tsm.init()`` this module wraps
``FullyShardedDataParallel.__init__`` (installed by ``install()``, undone by
``uninstall()``) so that, **when the caller passes neither ``process_group`` nor
``device_mesh``**, FSDP gets the groups of ``tsm.state``:

| hybrid_shard_degree | strategy asked | what FSDP gets |
|---------------------|-----------------------|---------------------------------------------------------|
| 0 | FULL_SHARD (default), SHARD_GRAD_OP, NO_SHARD | unchanged strategy over every data-parallel
  rank (``tsm.state.fsdp_shard_mesh``; the TP axis is left out) |
| 0 | HYBRID_SHARD, _HYBRID_SHARD_ZERO2 | shard within a host (``LOCAL_WORLD_SIZE`` / tp ranks),
  replicate across hosts |
| 1 | any | NO_SHARD over the data-parallel ranks |
| k >= 2 | any but _HYBRID_SHARD_ZERO2 | HYBRID_SHARD on ``tsm.state.fsdp_mesh`` (k shard ranks x
  replicas) |
| k >= 2 | _HYBRID_SHARD_ZERO2 | _HYBRID_SHARD_ZERO2 on ``tsm.state.fsdp_mesh`` |

Why: without groups, FSDP1 shards over the whole default group (so TP ranks would be
sharded together) and, on CPU, HYBRID_SHARD silently degenerates to NO_SHARD over a group of
one (ranks never synchronise). A ``process_group``/``device_mesh`` that the caller passes
is kept if it matches the table and refused with a ``ValueError`` if it contradicts it.
Experts modules split by ``tsm.transform`` become units of their own on the expert groups
(``sharding/experts.py``); with ``hybrid_shard_degree=0`` and expert parallelism the other
parameters are sharded over every data-parallel rank (``tsm.state.dp_mesh``).

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

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.context_parallel import check_prepared
from torch_sagemaker.logger import log_rank0
from torch_sagemaker.moe.experts import is_split
from torch_sagemaker.sharding import cache_flush, experts, fsdp1_layout
from torch_sagemaker.state import state

_HYBRID = (ShardingStrategy.HYBRID_SHARD, fsdp1_compat.HYBRID_SHARD_ZERO2)
_original_init = FullyShardedDataParallel.__init__
_local = threading.local()  # nesting depth: auto-wrap constructs child FSDP units recursively
_logged: set[tuple] = set()
_host_meshes: dict[tuple[int, int], DeviceMesh] = {}


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _host_mesh() -> DeviceMesh:
    """(replicate, shard) mesh sharding within a host, for HYBRID_SHARD with degree 0."""
    layout = state.layout
    shard = max(1, state.local_world_size // layout.tp)
    if layout.dp_size % shard:
        shard = layout.dp_size
    key = (shard, layout.dp_size // shard)
    if key not in _host_meshes:
        # Built on demand (a collective: every rank constructs FSDP); TP stays innermost.
        mesh = init_device_mesh(
            state.device_mesh.device_type,
            (key[1], shard, layout.tp),
            mesh_dim_names=("host_replicate", "host_shard", "host_tp"),
        )
        _host_meshes[key] = mesh["host_replicate", "host_shard"]
    return _host_meshes[key]


def resolve_sharding(strategy: ShardingStrategy | None) -> tuple[ShardingStrategy, DeviceMesh]:
    """Returns the strategy and mesh FSDP1 should use under the current SMP config."""
    strategy = strategy or ShardingStrategy.FULL_SHARD
    requested = state.layout.requested_hybrid_shard_degree
    if requested == 0:
        if strategy in _HYBRID:
            return strategy, _host_mesh()
        # With expert parallelism the resolved shard group is one of ``ep`` replicas; the
        # other parameters are sharded over every data-parallel rank.
        return strategy, state.fsdp_shard_mesh if state.layout.dp_replicate == 1 else state.dp_mesh
    if requested == 1:
        return ShardingStrategy.NO_SHARD, state.device_mesh["dp_replicate"]
    if strategy is not fsdp1_compat.HYBRID_SHARD_ZERO2:
        strategy = ShardingStrategy.HYBRID_SHARD
    return strategy, state.fsdp_mesh


def _check_explicit(
    strategy: ShardingStrategy, mesh: DeviceMesh, process_group: Any, device_mesh: DeviceMesh | None
) -> None:
    """Refuses an explicit group or mesh that contradicts the SMP config."""
    if strategy in _HYBRID:
        # (shard ranks, replicate ranks) here, a rank list below: compared and shown only.
        expected: object = (_ranks(mesh.get_group(1)), _ranks(mesh.get_group(0)))
        got: object
        if device_mesh is not None:
            got = (
                _ranks(device_mesh.get_group(device_mesh.ndim - 1)),
                _ranks(device_mesh.get_group(0)),
            )
        elif isinstance(process_group, tuple):
            got = (_ranks(process_group[0]), _ranks(process_group[1]))
        else:
            got = (_ranks(process_group), [])
        what = "(shard ranks, replicate ranks)"
    else:
        expected = _ranks(mesh.get_group(0))
        got = _ranks(device_mesh.get_group(0)) if device_mesh is not None else _ranks(process_group)
        what = "ranks"
    if got != expected:
        raise ValueError(
            f"FSDP was given a process_group/device_mesh with {what} {got}, but the SMP config "
            f"(hybrid_shard_degree={state.layout.requested_hybrid_shard_degree}, "
            f"tensor_parallel_degree={state.layout.tp}) puts this rank's {strategy.name} group at "
            f"{expected}. Drop the argument (tsm fills it in), "
            "pass device_mesh=tsm.state.fsdp_mesh, "
            "or change hybrid_shard_degree."
        )


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
    _local.depth = depth + 1
    try:
        if post_param_init_fn is not None:
            kwargs["param_init_fn"] = _wrap_post_param_init(
                module, kwargs.get("param_init_fn"), post_param_init_fn
            )
        if state.initialized:
            if depth == 0:
                check_prepared(module, state.cp_size, "FSDP")
            if depth == 0 and experts.check_ready(module):
                experts.fsdp1_root_kwargs(module, kwargs)  # experts and fp32 routers as own units
            strategy, mesh = resolve_sharding(sharding_strategy)
            device_mesh = kwargs.get("device_mesh")
            if is_split(module):  # an experts unit: its own group (sharding/experts.py)
                strategy, mesh = experts.fsdp1_expert_sharding(strategy)
                process_group, kwargs["device_mesh"] = None, mesh
            elif process_group is not None or device_mesh is not None:
                _check_explicit(strategy, mesh, process_group, device_mesh)
            else:
                kwargs["device_mesh"] = mesh
            sharding_strategy = strategy
            key = (strategy, tuple(mesh.shape))
            if depth == 0 and key not in _logged:
                _logged.add(key)
                log_rank0(
                    f"FSDP: {strategy.name} over mesh {mesh.mesh_dim_names} of shape "
                    f"{tuple(mesh.shape)} (hybrid_shard_degree="
                    f"{state.layout.requested_hybrid_shard_degree})"
                )
        _original_init(self, module, process_group, sharding_strategy, *args, **kwargs)
        if state.initialized and kwargs.get("device_mesh") is not None:
            fsdp1_layout.adapt(self)
        if state.initialized and depth == 0 and state.fsdp_cache_flush_warnings:
            cache_flush.watch(self)
    finally:
        _local.depth = depth


def install() -> None:
    """Makes ``FullyShardedDataParallel(...)`` follow the SMP config (idempotent)."""
    _host_meshes.clear()  # meshes of a previous init were destroyed with its groups
    FullyShardedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]


def uninstall() -> None:
    """Restores PyTorch's own ``FullyShardedDataParallel.__init__``."""
    FullyShardedDataParallel.__init__ = _original_init  # type: ignore[method-assign]
