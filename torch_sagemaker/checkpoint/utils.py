"""SMP's path ``torch.sagemaker.checkpoint.utils``: re-exports checkpoint retention.

The definitions are in ``torch_sagemaker.checkpoint.retention``; nothing in the library
imports this module.
"""

from torch_sagemaker.checkpoint.retention import (
    SORT_BY_LAST_INT,
    limit_num_subdirs,
    sort_by_last_int,
)

__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs", "sort_by_last_int"]
