"""FSDP1's ``LOCAL_STATE_DICT`` for units on SMP's meshes.

``install()`` (called by ``tsm.init``) makes PyTorch accept ``StateDictType.LOCAL_STATE_DICT``
on the FSDP1 units that ``sharding/fsdp1.py`` built on a mesh of ``tsm.state``
(``allow(unit)``), and makes FSDP1's local state dicts work on shard groups that are not the
whole world (every unit). ``uninstall()`` restores PyTorch's functions.

Note [LOCAL_STATE_DICT on SMP's meshes]
---------------------------------------
SMP's example scripts offer ``--checkpoint_type local``: under
``FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)`` every rank ``torch.save``s
``model.state_dict()`` and ``optimizer.state_dict()`` to ``{rank}.pt``, and loads its own file
back under ``load_with_process_group(model.process_group)``. FSDP1 answers that with each
unit's flat-parameter shard wrapped in a ``ShardedTensor`` over the unit's shard group
(``fsdp_state.process_group``): nothing is gathered or resharded, so it only loads into the
same layout.

Our FSDP1 units get a ``device_mesh`` (``sharding/fsdp1.py``: sharded state dicts are
DTensors on it, Note [FSDP1 sharded state dict layout]), and PyTorch refuses
``LOCAL_STATE_DICT`` on any unit built with a mesh ("DeviceMesh is not compatible with
LOCAL_STATE_DICT"), so the scripts' ``local`` checkpoints failed at the first save. SMP
builds its units from process groups and has no such refusal.

The refusal is a policy, not a limit: the local state dict never reads the mesh. A unit built
from a mesh has the same ``process_group`` (the mesh's shard dimension), ``rank`` and flat
parameter as one built from the equivalent ``(shard, replicate)`` group pair, which PyTorch
accepts. So for the units we built, and only under ``LOCAL_STATE_DICT``, the check that turns
the mesh into DTensor state dicts is skipped, and PyTorch's own local hooks run unchanged. The
sharded and full state dicts still go through it (DTensors on the mesh).

Two more gaps are PyTorch's own. First, with any shard group that is not the whole world
(``hybrid_shard_degree`` below the data-parallel size, or tensor parallelism), FSDP1 places
each rank's shard on its *group* rank, while ``ShardedTensor`` reads placements as global
ranks: every rank whose two ranks differ failed the save ("Global rank 0 does not exist in
input process group: [1, 3]"). A rank's local shards are its own, so while our module is
installed FSDP1's state-dict code gets ``init_from_local_shards`` with such placements moved
to the global rank (a placement already global, as a fixed PyTorch would give, is kept).
Loading is unaffected: ``ShardedTensor`` checks the group and global ranks at load, not the
placements.

Second, with or without a mesh: with ``use_orig_params=True`` (which
SMP's scripts force with ``--use_smp_implementation 1``) FSDP1's local state dict holds the
original parameters' local views *and* ``_flat_param``, but only the views are parameters of
the module, so ``load_state_dict`` rejected its own output ("Unexpected key(s) ...
_flat_param"). The two hold the same values (the views are slices of the flat shard), so for
our units the load drops ``_flat_param`` after checking that its size is this rank's shard,
and the views load as usual.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
from torch.distributed.fsdp.fully_sharded_data_parallel import FLAT_PARAM

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat

_allowed: weakref.WeakSet[FullyShardedDataParallel] = weakref.WeakSet()
_originals: dict[str, Any] = {}


def allow(unit: FullyShardedDataParallel) -> None:
    """Lets ``unit``, built on a mesh of ``tsm.state``, give and take local state dicts."""
    _allowed.add(unit)
    # Runs after FSDP's own load pre-hook, registered when the unit was built.
    unit.register_load_state_dict_pre_hook(_drop_duplicate_flat_param)


def _drop_duplicate_flat_param(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Drops ``_flat_param`` from a local state dict whose original parameters load it."""
    unit = cast(FullyShardedDataParallel, module)
    handle = fsdp1_compat.handle(unit)
    if (
        fsdp1_compat.state_dict_type(unit) is not StateDictType.LOCAL_STATE_DICT
        or handle is None
        or not fsdp1_compat.uses_orig_params(handle)
    ):
        return
    # FSDP's pre-hook put its wrapped-module prefix before every key and turned the
    # ShardedTensor into this rank's (padded) shard.
    loaded = state_dict.pop(f"{prefix}{fsdp1_compat.WRAPPED_MODULE_PREFIX}{FLAT_PARAM}", None)
    if isinstance(loaded, torch.Tensor) and loaded.numel() != handle.flat_param.numel():
        raise ValueError(
            f"load_state_dict (LOCAL_STATE_DICT) of FSDP unit '{prefix or 'root'}': the saved "
            f"flat parameter shard has {loaded.numel()} elements, this rank's has "
            f"{handle.flat_param.numel()}. A local state dict only loads into the layout it "
            "was saved from (same model, world size, hybrid_shard_degree and tensor parallel "
            "degree); save a sharded checkpoint to change the layout."
        )


def _set_use_dtensor(fsdp_state: Any) -> None:
    if (
        fsdp_state in _allowed
        and fsdp1_compat.state_dict_type(fsdp_state) is StateDictType.LOCAL_STATE_DICT
    ):
        return  # Note [LOCAL_STATE_DICT on SMP's meshes]
    _originals[fsdp1_compat.SET_USE_DTENSOR](fsdp_state)


def _init_from_own_shards(local_shards: list[Any], *global_size: Any, **kwargs: Any) -> Any:
    """PyTorch's ``init_from_local_shards``, with this rank's shards placed on its global rank."""
    group = kwargs.get("process_group")
    rank = dist.get_rank()
    group_rank = rank if group is None else dist.get_rank(group)
    if group_rank != rank:  # Note [LOCAL_STATE_DICT on SMP's meshes]
        local_shards = [
            fsdp1_compat.shard_placed_on(shard, rank)
            if fsdp1_compat.shard_placement_rank(shard) == group_rank
            else shard
            for shard in local_shards
        ]
    return _originals[fsdp1_compat.INIT_FROM_LOCAL_SHARDS](local_shards, *global_size, **kwargs)


_REPLACEMENTS = {
    fsdp1_compat.SET_USE_DTENSOR: _set_use_dtensor,
    fsdp1_compat.INIT_FROM_LOCAL_SHARDS: _init_from_own_shards,
}


def install() -> None:
    """Makes FSDP1's local state dicts work on ``allow``-ed units and sub-groups (idempotent)."""
    if _originals:
        return
    for name, replacement in _REPLACEMENTS.items():
        _originals[name] = fsdp1_compat.state_dict_function(name)
        fsdp1_compat.set_state_dict_function(name, replacement)


def uninstall() -> None:
    """Restores PyTorch's two functions (and its refusal of local state dicts with a mesh)."""
    for name, original in _originals.items():
        fsdp1_compat.set_state_dict_function(name, original)
    _originals.clear()


__all__ = ["allow", "install", "uninstall"]
