"""SMP's S3 helpers (``torch.sagemaker.distributed.checkpoint.s3_filesystem``).

SMP 2.5+ saves checkpoints straight to ``s3://`` URIs through ``s3torchconnector``. These
machines reach no network and this library writes checkpoints to local or shared file
systems only (``checkpoint_id="s3://..."`` raises ``ValueError`` in ``save``/``load``). The URI
helpers below are plain string functions and work; the file system itself, and looking up a
bucket's region, raise ``NotImplementedError`` saying what to do instead.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

_PREFIX = "s3://"
_NO_S3 = (
    "S3 checkpoints are not supported by torch_sagemaker: save to a local or shared file "
    "system path and upload the directory afterwards (e.g. `aws s3 sync`)."
)
T = TypeVar("T")


def is_s3_uri(path: Any) -> bool:
    """Whether ``path`` is an ``s3://`` URI."""
    return isinstance(path, str) and path.startswith(_PREFIX)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key``.

    Raises:
        ValueError: If ``uri`` is not an ``s3://`` URI or names no bucket.
    """
    if not is_s3_uri(uri):
        raise ValueError(f"{uri!r} is not an S3 URI; expected s3://<bucket>/<key>.")
    bucket, _, key = uri[len(_PREFIX) :].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket; expected s3://<bucket>/<key>.")
    return bucket, key


def format_s3_path(bucket: str, key: str = "") -> str:
    """``s3://bucket/key`` (leading slashes of ``key`` dropped)."""
    key = key.lstrip("/")
    return f"{_PREFIX}{bucket}/{key}" if key else f"{_PREFIX}{bucket}"


def get_s3_region_from_uri(uri: str) -> str:
    """Not implemented: it asks AWS where the bucket lives.

    Raises:
        NotImplementedError: Always.
    """
    raise NotImplementedError(f"get_s3_region_from_uri({uri!r}): {_NO_S3}")


def retry_with_jitter(
    fn: Callable[[], T],
    max_attempts: int = 3,
    base_delay: float = 0.5,
    max_delay: float = 8.0,
    retry_on: tuple[type[BaseException], ...] = (OSError,),
) -> T:
    """Calls ``fn`` until it succeeds, sleeping a random ("full jitter") backoff between tries.

    Args:
        fn: The call to make.
        max_attempts: Calls in all (at least 1).
        base_delay: Backoff of the first retry, doubled each time, in seconds.
        max_delay: Largest backoff.
        retry_on: Exceptions that cause a retry; others propagate at once.

    Returns:
        ``fn()``'s result.

    Raises:
        ValueError: If ``max_attempts < 1``.
        The last exception, when every attempt failed.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts} must be >= 1.")
    for attempt in range(max_attempts):
        try:
            return fn()
        except retry_on:
            if attempt == max_attempts - 1:
                raise
            time.sleep(random.uniform(0.0, min(max_delay, base_delay * 2**attempt)))
    raise AssertionError("unreachable")


class S3FileSystem:
    """Not implemented: SMP's ``s3torchconnector``-based checkpoint storage.

    Raises:
        NotImplementedError: On construction.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"S3FileSystem: {_NO_S3}")


__all__ = [
    "S3FileSystem",
    "format_s3_path",
    "get_s3_region_from_uri",
    "is_s3_uri",
    "parse_s3_uri",
    "retry_with_jitter",
]
