"""SMP's deprecated FSDP1 checkpoint helpers (``save_model_checkpoint``, ``load_model_checkpoint``).

SMP 2.5.0's example scripts import them from ``torch.sagemaker.distributed.fsdp.checkpoint``
for their ``use_pg_with_util`` checkpoint type; SMP deprecated that path in 2.6.1 and removed
it in 2.7.0. The path re-exports this module and warns once when imported
(``FutureWarning``); the library imports neither. The two functions are a thin layer over
``save`` and ``load``: an FSDP1 ``SHARDED_STATE_DICT`` saved by the replica-0 ranks over the
FSDP shard group, atomically, and loaded back by every rank. New code should use
``TrainingState`` or ``state_dict_saver`` / ``state_dict_loader``.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.dcp_patches import (
    load_sharded_optimizer_state_dict,
    read_metadata_on_every_rank,
)
from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader
from torch_sagemaker.checkpoint.location import checkpoint_location
from torch_sagemaker.checkpoint.state_dict_loader import load, raise_if_replaced
from torch_sagemaker.checkpoint.state_dict_saver import save
from torch_sagemaker.logger import get_logger
from torch_sagemaker.state import state

#: Keys of the dict ``load_model_checkpoint`` returns.
EXPORT_KEY_MODEL = "model"
EXPORT_KEY_OPTIMIZER = "optimizer"
EXPORT_KEY_SCHEDULER = "scheduler"
EXPORT_KEY_IDENTITY = "identity"


def _model_parallel_dir(path: str | os.PathLike[str]) -> str:
    """The directory of this rank's TP/EP shard of the model under the checkpoint ``path``.

    The ranks of one FSDP shard group hold one TP rank's (and one EP rank's) slices, and
    every TP/EP rank has its own shard group saving with its own coordinator, so each writes
    its own ``tp{degree}-{rank}`` / ``ep{degree}-{rank}`` subdirectory: the names SMP's scripts
    use for their ``sharded`` type. Without TP and EP the checkpoint is ``path`` itself.
    """
    path = os.fspath(path)
    if state.tp_size > 1:
        path = os.path.join(path, f"tp{state.tp_size}-{state.tp_rank}")
    if state.ep_size > 1:
        path = os.path.join(path, f"ep{state.ep_size}-{state.ep_rank}")
    return path


def _check_type(state_dict_type: StateDictType) -> None:
    if state_dict_type is not StateDictType.SHARDED_STATE_DICT:
        raise ValueError(
            f"state_dict_type={state_dict_type}: the deprecated fsdp.checkpoint helpers "
            "support only StateDictType.SHARDED_STATE_DICT; use "
            "torch.sagemaker.distributed.checkpoint for other kinds."
        )


def save_model_checkpoint(
    model: FSDP,
    state_dict_type: StateDictType,
    save_dir: str | os.PathLike[str],
    sharding_strategy: Any,
    checkpointing_pg_metadata: tuple[Any, int, bool],
    log: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    extra_exports: dict[str, Any] | None = None,
) -> None:
    """Saves model, optimizer, scheduler and ``extra_exports`` as a sharded checkpoint.

    Args:
        model: The FSDP1 model.
        state_dict_type: ``StateDictType.SHARDED_STATE_DICT``.
        save_dir: The checkpoint directory.
        sharding_strategy: Unused (FSDP knows its strategy); kept for SMP's signature.
        checkpointing_pg_metadata: ``(process_group, coordinator_rank, is_action_rank)`` as
            SMP's scripts build it: the FSDP shard group, its smallest global rank, and
            whether this rank is in replica 0 (only those write).
        log: Log when done (on the coordinator).
        optimizer: Saved with ``FSDP.optim_state_dict`` when given.
        scheduler: Saved with ``state_dict()`` when given.
        extra_exports: Extra picklable values (the scripts' data position).
    """
    del sharding_strategy
    _check_type(state_dict_type)
    process_group, coordinator_rank, action_rank = checkpointing_pg_metadata
    with FSDP.state_dict_type(model, state_dict_type):
        state_dict: dict[str, Any] = {EXPORT_KEY_MODEL: model.state_dict()}
        if optimizer is not None:
            state_dict[EXPORT_KEY_OPTIMIZER] = FSDP.optim_state_dict(model, optimizer)
    if scheduler is not None:
        state_dict[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
    state_dict.update(extra_exports or {})
    if action_rank:
        save(
            state_dict,
            checkpoint_id=_model_parallel_dir(save_dir),
            process_group=process_group,
            coordinator_rank=coordinator_rank,
        )
    if log and dist.get_rank() == coordinator_rank:
        get_logger().info(f"saved sharded checkpoint {save_dir}")


def load_model_checkpoint(
    model: FSDP,
    state_dict_type: StateDictType,
    checkpoint_dir: str | os.PathLike[str],
    sharding_strategy: Any,
    checkpointing_pg_metadata: tuple[Any, int, bool],
    log: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    extra_imports: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Loads a checkpoint of ``save_model_checkpoint`` into the objects given (every rank calls it).

    Args:
        model: The FSDP1 model (loaded in place).
        state_dict_type: ``StateDictType.SHARDED_STATE_DICT``.
        checkpoint_dir: The checkpoint directory.
        sharding_strategy: Unused; kept for SMP's signature.
        checkpointing_pg_metadata: As for ``save_model_checkpoint``; every rank loads.
        log: Log when done.
        optimizer: Loaded in place when given.
        scheduler: Loaded in place when given.
        extra_imports: Names of the extra values to read, with defaults (their types).

    Returns:
        ``{EXPORT_KEY_MODEL: model, EXPORT_KEY_OPTIMIZER: optimizer, EXPORT_KEY_SCHEDULER:
        scheduler, EXPORT_KEY_IDENTITY: {name: value, ...}}``; the identity holds the
        ``extra_imports`` read back, and ``epoch`` (0 when it was not saved, which SMP 2.5.0's
        script reads but does not save).

    Raises:
        CheckpointError: As ``load``; also when another save committed over the checkpoint
            between the model's read and the optimizer's (the objects given then hold values
            of either save: load again).
    """
    del sharding_strategy
    _check_type(state_dict_type)
    process_group, _, _ = checkpointing_pg_metadata
    checkpoint_dir = _model_parallel_dir(checkpoint_dir)
    extra = dict(extra_imports or {})
    # Two reads, the model's and the optimizer's: both must be of the save the first one
    # began with (Note [A save that replaces a checkpoint being loaded]).
    location = checkpoint_location(checkpoint_dir)
    participants = Participants(process_group)
    save_id = location.marker_save_id()
    with FSDP.state_dict_type(model, state_dict_type):
        model_state = model.state_dict()
        template: dict[str, Any] = {EXPORT_KEY_MODEL: model_state, **extra}
        if scheduler is not None:
            template[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
        load(template, checkpoint_id=checkpoint_dir, process_group=process_group)
        model.load_state_dict(template[EXPORT_KEY_MODEL])
        if optimizer is not None:
            # The model's read was of that save on every rank. The readers made now check
            # theirs against the save they find, on every rank together (PyTorch's own
            # function, taken without a process group, reads the metadata alone), and the
            # last check below covers both reads.
            raise_if_replaced(location, save_id, participants)
            reader = DistributedFileSystemReader(checkpoint_dir)
            if process_group is None and dist.is_initialized():
                read_metadata_on_every_rank(reader, None)  # every rank
            loaded = load_sharded_optimizer_state_dict(
                model_state, EXPORT_KEY_OPTIMIZER, reader, process_group=process_group
            )
            optimizer.load_state_dict(
                FSDP.optim_state_dict_to_load(model, optimizer, loaded[EXPORT_KEY_OPTIMIZER])
            )
    raise_if_replaced(location, save_id, participants)
    if scheduler is not None:
        scheduler.load_state_dict(template[EXPORT_KEY_SCHEDULER])
    identity = {"epoch": 0, **{key: template[key] for key in extra}}
    if log and dist.get_rank() == 0:
        get_logger().info(f"loaded sharded checkpoint {checkpoint_dir}")
    return {
        EXPORT_KEY_MODEL: model,
        EXPORT_KEY_OPTIMIZER: optimizer,
        EXPORT_KEY_SCHEDULER: scheduler,
        EXPORT_KEY_IDENTITY: identity,
    }


__all__ = [
    "EXPORT_KEY_IDENTITY",
    "EXPORT_KEY_MODEL",
    "EXPORT_KEY_OPTIMIZER",
    "EXPORT_KEY_SCHEDULER",
    "load_model_checkpoint",
    "save_model_checkpoint",
]
