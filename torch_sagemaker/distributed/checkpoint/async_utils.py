"""SMP's module path: re-exports ``torch_sagemaker.checkpoint.async_utils``.

SMP's scripts import ``torch.sagemaker.distributed.checkpoint.async_utils``. The code lives
in the home module; nothing is defined here (tests/unit/test_smp_api_surface.py checks that
each name is the home module's own object).
"""

from torch_sagemaker.checkpoint.async_utils import (
    DEFAULT_ASYNC_REQUEST_QUEUE,
    AsyncCallsQueue,
    maybe_finalize_async_calls,
)

__all__ = ["DEFAULT_ASYNC_REQUEST_QUEUE", "AsyncCallsQueue", "maybe_finalize_async_calls"]
