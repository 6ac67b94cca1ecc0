"""General helpers with SMP's module path (``torch.sagemaker.utils.utils``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from torch_sagemaker.logger import get_logger


@contextlib.contextmanager
def timeit(enabled: bool = True, name: str = "", rank: int = 0) -> Iterator[None]:
    """Logs how long the ``with`` block took, as SMP's example scripts use it.

    Args:
        enabled: Measure and log; ``False`` makes the block run untimed.
        name: What the block does, for the message (``"Model creation"``).
        rank: The caller's global rank; only rank 0 logs, so a job prints one line.

    Example:
        >>> with timeit(True, "FSDP constructor", dist.get_rank()):
        ...     model = FSDP(model, ...)
    """
    if not enabled:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        if rank == 0:
            get_logger().info(f"{name} took {time.perf_counter() - start:.3f} s")


__all__ = ["timeit"]
