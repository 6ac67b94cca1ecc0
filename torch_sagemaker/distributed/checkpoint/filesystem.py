"""SMP's module path: re-exports ``torch_sagemaker.checkpoint.filesystem``.

SMP's scripts import ``torch.sagemaker.distributed.checkpoint.filesystem``. The code lives
in the home module; nothing is defined here (tests/unit/test_smp_api_surface.py checks that
each name is the home module's own object).
"""

from torch_sagemaker.checkpoint.filesystem import (
    DistributedFileSystemReader,
    DistributedFileSystemWriter,
    path_to_file_system,
)

__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter", "path_to_file_system"]
