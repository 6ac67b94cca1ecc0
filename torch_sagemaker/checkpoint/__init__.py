"""Distributed checkpoints, built on PyTorch DCP: the library's one checkpoint package.

Users reach it through SMP's paths, ``torch.sagemaker.distributed.checkpoint`` (this
package's names) and its modules ``state_dict_saver``, ``state_dict_loader``,
``state_dict_utils``, ``async_utils``, ``filesystem`` and ``s3_filesystem``: thin
re-exports in ``torch_sagemaker/distributed/checkpoint/``. SMP's
``torch.sagemaker.checkpoint.constants`` and ``.utils`` are modules of this package
(``utils`` re-exports ``retention``), and the deprecated
``torch.sagemaker.distributed.fsdp.checkpoint`` re-exports ``fsdp1_checkpoint``.

- ``save`` / ``async_save`` / ``load``: sharded, reshardable checkpoints that become visible
  only when complete (``state_dict_saver``, ``state_dict_loader``), at a location
  (``checkpoint_location``, ``CheckpointLocation``): a directory of a file system
  (``atomic_dir``) or an ``s3://`` prefix (``s3_checkpoint``, ``s3_filesystem``), with
  checksums unless the location turns them off (``integrity``).
- ``maybe_finalize_async_calls`` / ``AsyncCallsQueue``: background saves (``async_utils``).
- ``sm_state_dict_type`` / ``SMStateDictType``: the SM-local kind (``state_dict_utils``).
- ``TrainingState``: model, optimizer, LR scheduler, step, data position and RNG in one
  checkpoint (``training_state``).
- ``save_hf_checkpoint``: a gathered Hugging Face directory (``hf_export``).
- ``dcp_patches``: what SMP's PyTorch build adds to DCP (installed when ``torch_sagemaker``
  is imported).

See docs/checkpoint.md for the layouts that reshard and the limits.
"""

from torch_sagemaker.checkpoint.async_utils import (
    DEFAULT_ASYNC_REQUEST_QUEUE,
    AsyncCallsQueue,
    maybe_finalize_async_calls,
)
from torch_sagemaker.checkpoint.hf_export import save_hf_checkpoint
from torch_sagemaker.checkpoint.location import (
    CheckpointLocation,
    checkpoint_location,
    is_complete,
)
from torch_sagemaker.checkpoint.marker import CheckpointError
from torch_sagemaker.checkpoint.state_dict_loader import load, read_metadata
from torch_sagemaker.checkpoint.state_dict_saver import async_save, save
from torch_sagemaker.checkpoint.state_dict_utils import (
    SMStateDictType,
    init_optim_state,
    sm_state_dict_type,
)
from torch_sagemaker.checkpoint.training_state import TrainingState

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
