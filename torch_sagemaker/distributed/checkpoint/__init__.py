"""Distributed checkpoints (``torch.sagemaker.distributed.checkpoint``), built on PyTorch DCP.

- ``save`` / ``async_save`` / ``load``: sharded, reshardable checkpoints that become visible
  only when complete (``state_dict_saver``, ``state_dict_loader``, ``atomic_dir``), on a file
  system or straight to ``s3://`` (``s3_checkpoint``, ``s3_filesystem``).
- ``maybe_finalize_async_calls`` / ``AsyncCallsQueue``: background saves (``async_utils``).
- ``sm_state_dict_type`` / ``SMStateDictType``: the SM-local kind (``state_dict_utils``).
- ``TrainingState``: model, optimizer, LR scheduler, step, data position and RNG in one
  checkpoint (``training_state``).
- ``save_hf_checkpoint``: a gathered Hugging Face directory (``hf_export``).

See docs/checkpoint.md for the layouts that reshard and the limits.
"""

from torch_sagemaker.distributed.checkpoint.async_utils import (
    DEFAULT_ASYNC_REQUEST_QUEUE,
    AsyncCallsQueue,
    maybe_finalize_async_calls,
)
from torch_sagemaker.distributed.checkpoint.atomic_dir import CheckpointError, is_complete
from torch_sagemaker.distributed.checkpoint.hf_export import save_hf_checkpoint
from torch_sagemaker.distributed.checkpoint.state_dict_loader import load, read_metadata
from torch_sagemaker.distributed.checkpoint.state_dict_saver import async_save, save
from torch_sagemaker.distributed.checkpoint.state_dict_utils import (
    SMStateDictType,
    init_optim_state,
    sm_state_dict_type,
)
from torch_sagemaker.distributed.checkpoint.training_state import TrainingState

__all__ = [
    "DEFAULT_ASYNC_REQUEST_QUEUE",
    "AsyncCallsQueue",
    "CheckpointError",
    "SMStateDictType",
    "TrainingState",
    "async_save",
    "init_optim_state",
    "is_complete",
    "load",
    "maybe_finalize_async_calls",
    "read_metadata",
    "save",
    "save_hf_checkpoint",
    "sm_state_dict_type",
]
