"""SMP's path ``torch.sagemaker.checkpoint.constants``: re-exports the checkpoint format names.

The definitions are in ``torch_sagemaker.distributed.checkpoint.constants``.
"""

from torch_sagemaker.distributed.checkpoint.constants import (
    COMPLETION_MARKER,
    FORMAT_VERSION,
    REPLACED_SUFFIX,
    SMP_IS_LOAD_INFO_KEY,
    SMP_IS_PARTIAL_KEY,
    STAGING_SUFFIX,
)

__all__ = [
    "COMPLETION_MARKER",
    "FORMAT_VERSION",
    "REPLACED_SUFFIX",
    "SMP_IS_LOAD_INFO_KEY",
    "SMP_IS_PARTIAL_KEY",
    "STAGING_SUFFIX",
]
