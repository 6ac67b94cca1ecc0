"""SMP's module path: re-exports ``torch_sagemaker.checkpoint.state_dict_saver``.

SMP's scripts import ``torch.sagemaker.distributed.checkpoint.state_dict_saver``. The code
lives in the home module; nothing is defined here (tests/unit/test_smp_api_surface.py checks
that each name is the home module's own object).
"""

from torch_sagemaker.checkpoint.state_dict_saver import (
    PyTorchDistSaveShardedStrategy,
    async_save,
    maybe_finalize_async_calls,
    save,
)

__all__ = ["PyTorchDistSaveShardedStrategy", "async_save", "maybe_finalize_async_calls", "save"]
