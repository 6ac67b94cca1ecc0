"""SMP's deprecated path ``torch.sagemaker.distributed.fsdp.checkpoint``: a re-export.

SMP 2.5.0's example scripts import this module for their ``use_pg_with_util`` checkpoint
type; SMP deprecated it in 2.6.1 and removed it in 2.7.0, so importing it warns
(``FutureWarning``). The code is ``torch_sagemaker.checkpoint.fsdp1_checkpoint``; nothing is
defined here.
"""

import warnings

from torch_sagemaker.checkpoint.fsdp1_checkpoint import (
    EXPORT_KEY_IDENTITY,
    EXPORT_KEY_MODEL,
    EXPORT_KEY_OPTIMIZER,
    EXPORT_KEY_SCHEDULER,
    load_model_checkpoint,
    save_model_checkpoint,
)

warnings.warn(
    "torch.sagemaker.distributed.fsdp.checkpoint is deprecated (SMP 2.6.1) and was removed "
    "in SMP 2.7.0; use torch.sagemaker.distributed.checkpoint (state_dict_saver.save / "
    "async_save, state_dict_loader.load) instead.",
    FutureWarning,
    stacklevel=2,
)

__all__ = [
    "EXPORT_KEY_IDENTITY",
    "EXPORT_KEY_MODEL",
    "EXPORT_KEY_OPTIMIZER",
    "EXPORT_KEY_SCHEDULER",
    "load_model_checkpoint",
    "save_model_checkpoint",
]
