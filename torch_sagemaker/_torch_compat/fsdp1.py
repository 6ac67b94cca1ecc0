"""Private names of FSDP1 (``FullyShardedDataParallel``): its per-unit state and flat parameters.

What the package reads or replaces on a unit (``_handle``, ``_fsdp_extension``, the state dict
type and config), on its ``FlatParamHandle`` (``_use_unsharded_views`` and
``_use_unsharded_grad_views``, which the package wraps per handle, ``_get_unflat_views``,
``_setattr_param``, ``_use_orig_params``) and on the handle's ``FlatParameter``
(the per-parameter records ``_params``, ``_param_infos``, ``_shard_param_infos``,
``_param_extensions``, ``_fqns``, and the shared-parameter records ``_shared_param_infos``,
``_shared_params``, ``_modules``), the handle method that builds the flat parameter
(``_init_flat_param_and_metadata``, which the package wraps), plus the auto-wrap policy base
class, the private sharding strategy ``_HYBRID_SHARD_ZERO2``, ``MixedPrecision``'s
``_module_classes_to_ignore`` and the mark FSDP1 sets on the parameters it flattened
(``_is_fsdp_flattened``).

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp._common_utils import (
    FSDP_PREFIX,
    _is_fsdp_flattened,
    clean_tensor_name,
)
from torch.distributed.fsdp._flat_param import (
    FlatParameter,
    FlatParamHandle,
    ParamInfo,
    SharedParamInfo,
    _ShardParamInfo,
)
from torch.distributed.fsdp.wrap import _or_policy, _Policy

#: ``HYBRID_SHARD`` with ``SHARD_GRAD_OP`` inside each shard group (FSDP1's private member).
HYBRID_SHARD_ZERO2: ShardingStrategy = ShardingStrategy._HYBRID_SHARD_ZERO2

#: FSDP1's auto-wrap policy base class (``ModuleWrapPolicy`` and friends derive from it).
Policy = _Policy

#: What a unit's state-dict hooks put before its module's keys while they run (the name of the
#: wrapped module, ``_fsdp_wrapped_module.``); its load pre-hook leaves the keys that way.
WRAPPED_MODULE_PREFIX: str = FSDP_PREFIX

#: The auto-wrap callable that wraps a module when any of ``policies`` would.
or_policy = _or_policy

#: The ``FlatParamHandle`` method that registers the unsharded parameters' views on their
#: modules; the package wraps it on single handles, so it is named here for ``getattr`` and
#: ``setattr`` on a handle.
USE_UNSHARDED_VIEWS = "_use_unsharded_views"

#: The ``FlatParamHandle`` method that points the original parameters' ``.grad`` at views of
#: the unsharded flat gradient (``summon_full_params(with_grads=True)``); wrapped like
#: ``USE_UNSHARDED_VIEWS``.
USE_UNSHARDED_GRAD_VIEWS = "_use_unsharded_grad_views"


def unflat_views(flat_handle: FlatParamHandle, tensor: Any) -> list[Any]:
    """Views of an unsharded flat ``tensor``, one per original parameter, as the handle makes them.

    Tensor-parallel parameters' views are DTensors.
    """
    return list(flat_handle._get_unflat_views(tensor))


#: The ``FlatParamHandle`` method that walks a unit's modules and builds its flat parameter
#: and the per-parameter records, shared parameters included (called once, from the
#: handle's constructor); the package wraps it on the class (``sharding/fsdp1_tied.py``).
INIT_FLAT_PARAM_AND_METADATA = "_init_flat_param_and_metadata"


class WrapPolicy(_Policy):
    """An auto-wrap policy written by the package: implement ``run_policy``.

    FSDP1 calls the private ``_run_policy`` of its policy objects; here it calls
    ``run_policy`` with the same arguments.
    """

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        return self.run_policy(root_module, ignored_modules, root_kwargs)

    @abstractmethod
    def run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        """The modules to wrap under ``root_module``, each with its FSDP keyword arguments.

        Args:
            root_module: The module the root FSDP call wraps.
            ignored_modules: Modules FSDP leaves alone.
            root_kwargs: The root call's keyword arguments.

        Returns:
            ``{module: its kwargs}`` for every module to wrap.
        """


def run_policy(
    policy: _Policy,
    root_module: nn.Module,
    ignored_modules: set[nn.Module],
    root_kwargs: dict[str, Any],
) -> dict[nn.Module, dict[str, Any]]:
    """What FSDP1 would wrap under ``root_module`` with ``policy`` (``_Policy._run_policy``).

    Args:
        policy: An auto-wrap policy object.
        root_module: The module the root FSDP call wraps.
        ignored_modules: Modules FSDP leaves alone.
        root_kwargs: The root call's keyword arguments.

    Returns:
        ``{module: its kwargs}`` for every module to wrap.
    """
    return policy._run_policy(root_module, ignored_modules, root_kwargs)


def module_classes_to_ignore(mp: MixedPrecision) -> Sequence[type[nn.Module]]:
    """The module classes ``mp`` keeps in full precision (as their own FSDP units)."""
    return mp._module_classes_to_ignore


def with_module_classes_to_ignore(
    mp: MixedPrecision, classes: tuple[type[nn.Module], ...]
) -> MixedPrecision:
    """A copy of ``mp`` that keeps ``classes`` in full precision (and nothing else)."""
    return dataclasses.replace(mp, _module_classes_to_ignore=classes)


# --- one FSDP unit ---------------------------------------------------------------------------


def handle(unit: FullyShardedDataParallel) -> FlatParamHandle | None:
    """The unit's ``FlatParamHandle``; ``None`` when the unit manages no parameters."""
    return unit._handle


def fsdp_extension(unit: FullyShardedDataParallel) -> Any:
    """The ``FSDPExtensions`` the unit uses (``DTensorExtensions`` under TP), or ``None``."""
    return unit._fsdp_extension


def set_fsdp_extension(owner: FullyShardedDataParallel | FlatParamHandle, extension: Any) -> None:
    """Replaces the ``FSDPExtensions`` of a unit or of its handle (each keeps its own)."""
    owner._fsdp_extension = extension


def state_dict_type(unit: FullyShardedDataParallel) -> StateDictType:
    """The state dict type the unit's ``state_dict()`` produces now."""
    return unit._state_dict_type


def state_dict_config(unit: FullyShardedDataParallel) -> StateDictConfig:
    """The state dict config the unit's ``state_dict()`` follows now."""
    return unit._state_dict_config


def set_state_dict_config(unit: FullyShardedDataParallel, config: StateDictConfig) -> None:
    """Makes the unit's ``state_dict()`` follow ``config`` from now on."""
    unit._state_dict_config = config


# --- its handle ------------------------------------------------------------------------------


def uses_orig_params(flat_handle: FlatParamHandle) -> bool:
    """Whether the handle exposes the original parameters (``use_orig_params=True``)."""
    return flat_handle._use_orig_params


def setattr_param(
    flat_handle: FlatParamHandle, module: nn.Module, name: str, param: nn.Parameter
) -> None:
    """Registers ``param`` as ``module.<name>`` the way the handle registers its own views."""
    flat_handle._setattr_param(module, name, param)


# --- its flat parameter ----------------------------------------------------------------------


def original_params(flat_param: FlatParameter) -> list[nn.Parameter] | None:
    """The original parameter objects (``use_orig_params=True``), else ``None``."""
    return flat_param._params


def param_infos(flat_param: FlatParameter) -> tuple[ParamInfo, ...]:
    """``(name, module, module name)`` of each original parameter, in flattening order."""
    return flat_param._param_infos


def shard_param_infos(flat_param: FlatParameter) -> tuple[_ShardParamInfo, ...]:
    """Where each original parameter lies in this rank's shard (``in_shard``, offsets)."""
    return flat_param._shard_param_infos


def param_extensions(flat_param: FlatParameter) -> tuple[Any, ...]:
    """Each original parameter's extension record (its DTensor spec under TP), else ``None``."""
    return flat_param._param_extensions


def fqns(flat_param: FlatParameter) -> tuple[str, ...]:
    """Each original parameter's name relative to the unit's module, in flattening order."""
    return flat_param._fqns


def shared_param_infos(flat_param: FlatParameter) -> tuple[SharedParamInfo, ...]:
    """The later names of parameters the unit holds under several names, with their primary."""
    return tuple(flat_param._shared_param_infos)


def set_shared_param_infos(flat_param: FlatParameter, infos: tuple[SharedParamInfo, ...]) -> None:
    """Replaces the shared-parameter records that the handle's view methods walk."""
    flat_param._shared_param_infos = infos


def add_shared_param(
    flat_param: FlatParameter, info: SharedParamInfo, param: nn.Parameter | None
) -> None:
    """Records one more name of a flattened parameter, as FSDP1's flattening records one.

    Args:
        flat_param: The handle's flat parameter, just built.
        info: The later name and its primary (the name that was flattened).
        param: The object the later name is registered as between steps: the primary's
            original-parameter object with ``use_orig_params=True``, else ``None``.
    """
    flat_param._shared_param_infos = (*flat_param._shared_param_infos, info)
    flat_param._modules.add(info.module)
    if flat_param._shared_params is not None:
        assert param is not None  # the caller passes the primary's original parameter
        flat_param._shared_params.append(param)


def is_flattened(tensor: Any) -> bool:
    """Whether FSDP1 flattened ``tensor`` into a ``FlatParameter`` (an original parameter).

    Outside the forward of its unit, such a parameter with ``use_orig_params=True`` and a
    sharded strategy holds a 1-D slice of this rank's shard (empty where the shard has none
    of it).
    """
    return _is_fsdp_flattened(tensor)


__all__ = [
    "HYBRID_SHARD_ZERO2",
    "INIT_FLAT_PARAM_AND_METADATA",
    "USE_UNSHARDED_VIEWS",
    "WRAPPED_MODULE_PREFIX",
    "FlatParamHandle",
    "FlatParameter",
    "Policy",
    "SharedParamInfo",
    "WrapPolicy",
    "add_shared_param",
    "clean_tensor_name",
    "fqns",
    "fsdp_extension",
    "handle",
    "is_flattened",
    "module_classes_to_ignore",
    "or_policy",
    "original_params",
    "param_extensions",
    "param_infos",
    "run_policy",
    "set_fsdp_extension",
    "set_shared_param_infos",
    "set_state_dict_config",
    "setattr_param",
    "shard_param_infos",
    "shared_param_infos",
    "state_dict_config",
    "state_dict_type",
    "uses_orig_params",
    "with_module_classes_to_ignore",
]


# --- its gradient reduction ------------------------------------------------------------------

#: FSDP1's post-backward hook calls these two module functions of ``_runtime_utils`` by their
#: global names, ``(state, handle)`` each: the sharded strategies' reduction (reduce-scatter,
#: the replicas' all-reduce for hybrid strategies, the cast to the parameter dtype and the
#: accumulation into ``_saved_grad_shard``) and NO_SHARD's (all-reduce in place, then the
#: cast). Replacing them there replaces them for every unit (``sharding/fsdp1_replicas.py``).
REDUCE_SHARDED = "_reduce_grad"
REDUCE_NO_SHARD = "_reduce_grad_no_shard"


def reduction_function(name: str) -> Any:
    """The function FSDP1's post-backward hook calls as ``name`` now."""
    from torch.distributed.fsdp import _runtime_utils

    return getattr(_runtime_utils, name)


def set_reduction_function(name: str, fn: Any) -> None:
    """Makes FSDP1's post-backward hook call ``fn`` as ``name``."""
    from torch.distributed.fsdp import _runtime_utils

    setattr(_runtime_utils, name, fn)


# --- its state dicts ---------------------------------------------------------------------------

#: FSDP1's state-dict and load-state-dict pre-hooks call this module function of
#: ``_state_dict_utils`` by its global name, ``(state)``: it turns on DTensor state dicts for a
#: unit built with a ``device_mesh``, and refuses ``LOCAL_STATE_DICT`` for such a unit.
#: Replacing it there replaces it for every unit (``sharding/fsdp1_local_state_dict.py``).
SET_USE_DTENSOR = "_set_use_dtensor"

#: FSDP1's local state-dict post-hook builds each unit's ``ShardedTensor`` by calling this
#: (public) function under its name in ``_state_dict_utils``.
INIT_FROM_LOCAL_SHARDS = "init_from_local_shards"


def shard_placed_on(shard: Any, rank: int) -> Any:
    """A copy of a ``ShardedTensor`` local ``Shard`` placed on global ``rank``, same data."""
    from torch.distributed._shard.sharded_tensor import Shard

    offsets = list(shard.metadata.shard_offsets)
    return Shard.from_tensor_and_offsets(shard.tensor, offsets, rank)


def shard_placement_rank(shard: Any) -> int | None:
    """The rank a ``ShardedTensor`` local ``Shard``'s metadata places it on."""
    placement = shard.metadata.placement
    return None if placement is None else placement.rank()


def state_dict_function(name: str) -> Any:
    """The function of FSDP1's ``_state_dict_utils`` its state-dict hooks call as ``name`` now."""
    from torch.distributed.fsdp import _state_dict_utils

    return getattr(_state_dict_utils, name)


def set_state_dict_function(name: str, fn: Any) -> None:
    """Makes FSDP1's state-dict hooks call ``fn`` as ``name``."""
    from torch.distributed.fsdp import _state_dict_utils

    setattr(_state_dict_utils, name, fn)


def inter_node_group_attr() -> str:
    """The unit attribute holding a hybrid strategy's replica group (``_inter_node_pg``)."""
    return "_inter_node_pg"


def unit_sharding(unit: FullyShardedDataParallel) -> ShardingStrategy:
    """The unit's sharding strategy (hybrid ones included)."""
    return unit.sharding_strategy


def has_comm_hook(unit: FullyShardedDataParallel) -> bool:
    """Whether ``register_comm_hook`` gave the unit a communication hook."""
    return unit._comm_hook is not None


def saved_grad_shard(flat_param: FlatParameter) -> Any:
    """The sharded gradient accumulated since the last optimizer step, or ``None``."""
    return getattr(flat_param, "_saved_grad_shard", None)


def reduce_dtype(flat_handle: FlatParamHandle) -> Any:
    """The dtype the handle reduces gradients in (``None``: the gradient's own)."""
    return flat_handle._reduce_dtype


def reads_grad_at_reduction(flat_handle: FlatParamHandle) -> bool:
    """Whether something reads the handle's gradient right after its reduction.

    CPU offload copies it to the CPU, kept low-precision gradients are cast again, and an
    optimizer in backward steps with it, all inside the reduction function.
    """
    return bool(
        flat_handle._offload_params
        or flat_handle._keep_low_precision_grads
        or getattr(flat_handle, "_has_optim_in_backward", False)
    )


def wait_for_all_reduce_stream(unit: FullyShardedDataParallel) -> None:
    """Makes the current stream wait for the unit's all-reduce stream (no-op on CPU).

    A hybrid unit's reduction divides and casts the gradient on that stream, then returns to
    the post-backward stream.
    """
    stream = getattr(unit, "_all_reduce_stream", None)
    if stream is not None:
        unit._device_handle.current_stream().wait_stream(stream)
