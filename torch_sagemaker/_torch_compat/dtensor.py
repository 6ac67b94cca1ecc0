"""Private DTensor names: ``_StridedShard``, shard offsets, caches, implicit replication.

A DTensor's ``_local_tensor`` is read through ``tensor.py``, which does not import
``torch.distributed.tensor`` (a heavy import the offload hooks put off).

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

#: The placement FSDP2 gives a dimension that is already sharded (TP or EP ``Shard(0)``);
#: not a ``Shard``, and its ``is_shard()`` is false. Also the TP placement of a packed
#: projection split block by block (``tensor_parallel/projection_styles.py``).
StridedShard = _StridedShard

#: ``(local shape, global offset)`` of this rank's shard of a DTensor of a given shape,
#: mesh and placements (what DCP records for a DTensor).
local_shape_and_offset = compute_local_shape_and_global_offset


def clear_caches() -> None:
    """Empties DTensor's caches that hold device meshes (and through them process groups).

    The sharding propagator's caches (C++ and Python), the redistribute planners, and the
    transform and mesh-topology ``lru_cache``s. The last two are looked up by name so that a
    torch without them still works.
    """
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    for cached in (
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    ):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()


def implicit_replication_allowed() -> bool:
    """Whether DTensor now treats plain tensors as replicated (this thread's setting)."""
    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def allow_implicit_replication(value: bool) -> None:
    """Sets what ``torch.distributed.tensor.experimental.implicit_replication`` sets.

    Unlike that context manager, which always leaves it off, a caller can put back what was.
    """
    DTensor._op_dispatcher._allow_implicit_replication = value


__all__ = [
    "StridedShard",
    "allow_implicit_replication",
    "clear_caches",
    "implicit_replication_allowed",
    "local_shape_and_offset",
]
