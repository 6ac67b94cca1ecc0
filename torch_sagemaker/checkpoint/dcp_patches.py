"""What SMP's PyTorch build adds to ``torch.distributed.checkpoint`` (DCP), for SMP's scripts.

SMP ships a patched PyTorch, and its example scripts rely on two of the patches:

1. ``load_sharded_optimizer_state_dict(model_state_dict, optimizer_key, storage_reader,
   planner=None, process_group=None)``: the ``process_group`` keyword. With it, the optimizer
   state is loaded in the layout of ``model_state_dict`` (the FSDP1 ``SHARDED_STATE_DICT``
   the script just loaded) through a DCP load over ``process_group`` (the FSDP shard group)
   instead of the whole world (Note [Sharded optimizer state in the model's layout]).
   Without the keyword, PyTorch's function runs unchanged.
2. ``coordinator_rank`` as a *global* rank. The scripts pass ``min(global ranks of the
   group)``; PyTorch 2.13 reads it as a rank inside ``process_group``. A value that is not a
   rank of the group but is the global rank of a member is translated; every other value
   keeps PyTorch's meaning.

``install()`` also installs ``strided_shards``' checkpoint hooks of DTensors split block by
block (Note [Packed shards in checkpoints]), which PyTorch's DCP cannot save.

``install()`` runs when ``torch_sagemaker`` is imported, because the scripts bind
``load_sharded_optimizer_state_dict`` at import time, before ``tsm.init``. Both patches only
widen what PyTorch accepts; ``uninstall()`` restores PyTorch's objects.

Note [Sharded optimizer state in the model's layout]
----------------------------------------------------
PyTorch's function expects the FSDP1 model state dict to hold ``ShardedTensor``s; from FSDP1
with a device mesh it holds DTensors (``sharding/fsdp1_layout.py``), so PyTorch falls back to
chunking every optimizer tensor over the *world*, while ``FSDP.optim_state_dict_to_load``
gathers it over FSDP's own group: the two disagree whenever they differ. Here each tensor
``<optimizer_key>.state.<fqn>.<name>`` is allocated like ``model_state_dict[fqn]`` when the
shapes match (a DTensor with the same mesh and placements, or a plain tensor), scalars and
other shapes as plain tensors, and DCP fills them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import optimizer as _dcp_optimizer
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import dcp as dcp_compat
from torch_sagemaker.checkpoint import strided_shards
from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.marker import CheckpointError

_native_load_sharded = getattr(
    _dcp_optimizer.load_sharded_optimizer_state_dict,
    "__tsm_native__",
    _dcp_optimizer.load_sharded_optimizer_state_dict,
)
# A reload of this module finds its own patches installed: keep the functions they replaced.
_native_wrapper_init = getattr(
    dcp_compat.DistWrapper.__init__, "__tsm_native__", dcp_compat.DistWrapper.__init__
)


def _allocate_like(template: Any, meta: TensorStorageMetadata) -> torch.Tensor:
    """An empty tensor for ``meta``, laid out like ``template`` when the shapes agree."""
    props = meta.properties
    if isinstance(template, DTensor) and tuple(template.shape) == tuple(meta.size):
        local = torch.empty(
            template.to_local().shape, dtype=props.dtype, device=template.to_local().device
        )
        return DTensor.from_local(
            local,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    device = template.device if isinstance(template, torch.Tensor) else torch.device("cpu")
    if isinstance(template, DTensor):
        device = template.to_local().device
    return torch.empty(tuple(meta.size), dtype=props.dtype, device=device)


def load_sharded_optimizer_state_dict(
    model_state_dict: dict[str, Any],
    optimizer_key: str,
    storage_reader: StorageReader,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """PyTorch's ``load_sharded_optimizer_state_dict`` plus SMP's ``process_group`` keyword.

    Args:
        model_state_dict: The model's FSDP1 ``SHARDED_STATE_DICT`` (as loaded by the caller).
        optimizer_key: The top-level key the optimizer state was saved under.
        storage_reader: Reader of the checkpoint.
        planner: Load planner (PyTorch's default when ``None``).
        process_group: The group that saved the checkpoint (SMP's scripts pass
            ``model.process_group``). ``None`` runs PyTorch's function unchanged.

    Returns:
        ``{optimizer_key: optimizer_state_dict}`` ready for ``FSDP.optim_state_dict_to_load``.
    """
    if process_group is None:
        return _native_load_sharded(model_state_dict, optimizer_key, storage_reader, planner)
    metadata = read_metadata_on_every_rank(storage_reader, process_group)
    flat: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] != optimizer_key:
            continue
        if isinstance(meta, BytesStorageMetadata):
            flat[key] = "<bytes>"  # DCP replaces it with the loaded object
            continue
        fqn = path[2] if len(path) > 3 and path[1] == "state" else None
        like = model_state_dict.get(fqn) if fqn is not None else None
        flat[key] = _allocate_like(like, meta)
    dcp_load(flat, storage_reader=storage_reader, planner=planner, process_group=process_group)
    return dcp_compat.unflatten_state_dict(
        flat, {k: v for k, v in metadata.planner_data.items() if k in flat}
    )


def read_metadata_on_every_rank(reader: StorageReader, group: dist.ProcessGroup | None) -> Any:
    """``reader.read_metadata()``, or its error on every rank of ``group`` if it fails on one.

    Read outside DCP's collectives, a check of ``DistributedFileSystemReader`` that fails on
    one rank (a changed file, a save committed since its reader was made) would otherwise
    leave the others in the load's first collective until the group's timeout.
    """
    failure: Exception | None = None
    metadata = None
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - every rank learns of it first (below)
        failure = e
    participants = Participants(group)
    failures = participants.all_gather(None if failure is None else repr(failure))
    if failure is not None:
        raise failure
    failed = [(r, f) for r, f in zip(participants.ranks, failures) if f is not None]
    if failed:
        rank, error = failed[0]
        raise CheckpointError(f"reading the optimizer's checkpoint failed on rank {rank}: {error}")
    return metadata


load_sharded_optimizer_state_dict.__tsm_native__ = _native_load_sharded  # type: ignore[attr-defined]


def _dist_wrapper_init(
    self: Any, group: dist.ProcessGroup | None, use_dist: bool, coordinator_rank: int
) -> None:
    if use_dist and group is not None and not 0 <= coordinator_rank < dist.get_world_size(group):
        members = dist.get_process_group_ranks(group)
        if coordinator_rank in members:
            coordinator_rank = members.index(coordinator_rank)
    _native_wrapper_init(self, group, use_dist, coordinator_rank)


_dist_wrapper_init.__tsm_native__ = _native_wrapper_init  # type: ignore[attr-defined]


def install() -> None:
    """Installs both patches and the block-by-block DTensor hooks (idempotent)."""
    _dcp_optimizer.load_sharded_optimizer_state_dict = load_sharded_optimizer_state_dict
    _dcp.load_sharded_optimizer_state_dict = load_sharded_optimizer_state_dict
    dcp_compat.DistWrapper.__init__ = _dist_wrapper_init  # type: ignore[method-assign]
    strided_shards.install()


def uninstall() -> None:
    """Restores PyTorch's optimizer loading, coordinator handling and DTensor hooks."""
    _dcp_optimizer.load_sharded_optimizer_state_dict = _native_load_sharded
    _dcp.load_sharded_optimizer_state_dict = _native_load_sharded
    dcp_compat.DistWrapper.__init__ = _native_wrapper_init  # type: ignore[method-assign]
    strided_shards.uninstall()


__all__ = ["install", "load_sharded_optimizer_state_dict", "uninstall"]
