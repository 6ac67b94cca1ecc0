"""SMP's package path ``torch.sagemaker.distributed.checkpoint``: a re-export.

The library's checkpoint code is one package, ``torch_sagemaker.checkpoint``. SMP's scripts
import this path and its modules ``state_dict_saver``, ``state_dict_loader``,
``state_dict_utils``, ``async_utils``, ``filesystem`` and ``s3_filesystem``; each is a
re-export of the module of the same name there, and nothing is defined here.
"""

from torch_sagemaker.checkpoint import (
    DEFAULT_ASYNC_REQUEST_QUEUE,
    AsyncCallsQueue,
    CheckpointError,
    CheckpointLocation,
    SMStateDictType,
    TrainingState,
    async_save,
    checkpoint_location,
    init_optim_state,
    is_complete,
    load,
    maybe_finalize_async_calls,
    read_metadata,
    save,
    save_hf_checkpoint,
    sm_state_dict_type,
)

__all__ = [
    "DEFAULT_ASYNC_REQUEST_QUEUE",
    "AsyncCallsQueue",
    "CheckpointError",
    "CheckpointLocation",
    "SMStateDictType",
    "TrainingState",
    "async_save",
    "checkpoint_location",
    "init_optim_state",
    "is_complete",
    "load",
    "maybe_finalize_async_calls",
    "read_metadata",
    "save",
    "save_hf_checkpoint",
    "sm_state_dict_type",
]
