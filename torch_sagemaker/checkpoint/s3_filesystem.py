"""SMP's S3 helpers (``torch.sagemaker.distributed.checkpoint.s3_filesystem``).

SMP 2.5+ saves checkpoints straight to ``s3://`` URIs through the ``s3torchconnector``
package's DCP storage (its ``S3FileSystem`` under DCP's file-system writer and reader). So
does this library: ``save``/``async_save``/``load`` accept ``checkpoint_id="s3://..."``
(the protocol on S3 is ``s3_checkpoint``; Note [S3 checkpoint layout] there). This module
holds the pieces that talk to S3 at all:

- URI helpers (``is_s3_uri``, ``parse_s3_uri``, ``format_s3_path``);
- where S3 is (Note [S3 endpoint and credentials]): ``s3_environment`` reads the standard
  AWS variables, ``resolve_region`` and ``get_s3_region_from_uri`` pick the region;
- ``make_s3_client``, the ``s3torchconnector`` client pointed at that endpoint, and
  ``S3FileSystem``, DCP's file system over it (SMP's name);
- ``retry_with_jitter``, bounded retries with full-jitter backoff.

``s3torchconnector`` (``pip install "s3torchconnector[dcp]"``) is imported only when a
client is made, so file-system checkpoints never need it.

Note [S3 endpoint and credentials]
    The endpoint comes from ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (what boto3 and
    the AWS CLI read), else AWS's own; the region from the ``s3_region`` argument, else
    ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else the bucket's location
    (``get_s3_region_from_uri``). ``s3torchconnector`` 1.5.0's client reads only
    ``AWS_ENDPOINT_URL`` itself, so an endpoint set in ``AWS_ENDPOINT_URL_S3`` alone would be
    missed (a DNS error for ``<bucket>.s3.<region>.amazonaws.com``); ``make_s3_client``
    therefore passes the endpoint explicitly. With a custom endpoint and no
    ``s3client_config``, requests are path-style (``http://host:port/bucket/key``), which
    every S3-compatible server accepts and which needs no DNS name per bucket. Credentials are
    left to the client's own chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
    ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, the instance role), as with boto3.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.filesystem import FileSystem

_PREFIX = "s3://"
#: SMP's default multipart part size for checkpoints (s3torchconnector's own is 8 MiB).
DEFAULT_PART_SIZE = 64 << 20
_INSTALL = 'S3 checkpoints need s3torchconnector: pip install "s3torchconnector[dcp]".'
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
    """``s3://bucket/key``, normalized: no repeated or trailing slashes in the key.

    Also takes a whole URI as its only argument (as HyperPod's adapter calls it) and returns
    it normalized: ``format_s3_path("s3://b//ckpt/")`` is ``"s3://b/ckpt"``.
    """
    if is_s3_uri(bucket):
        bucket, rest = parse_s3_uri(bucket)
        key = f"{rest}/{key}" if key else rest
    key = "/".join(part for part in key.split("/") if part)
    return f"{_PREFIX}{bucket}/{key}" if key else f"{_PREFIX}{bucket}"


def join_s3(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended as key components."""
    return format_s3_path(uri, "/".join(parts))


@dataclass(frozen=True)
class S3Environment:
    """Where S3 is, as the standard AWS variables say (Note [S3 endpoint and credentials]).

    Attributes:
        endpoint: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else ``None`` (AWS).
        region: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else ``None``.
    """

    endpoint: str | None
    region: str | None


def s3_environment(environ: Mapping[str, str] | None = None) -> S3Environment:
    """Reads the endpoint and region variables (the one place this package reads them).

    Args:
        environ: The environment to read (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or None
    return S3Environment(endpoint=endpoint, region=region)


def _boto3_client(region: str | None) -> Any:
    try:
        import boto3
    except ImportError as e:
        raise ImportError(
            f"get_s3_region_from_uri needs boto3 (pip install boto3). {_INSTALL}"
        ) from e
    return boto3.client("s3", endpoint_url=s3_environment().endpoint, region_name=region)


def get_s3_region_from_uri(uri: str) -> str:
    """The region of the bucket of ``uri``, asked of S3 (``GetBucketLocation``, via boto3).

    Raises:
        ValueError: If ``uri`` is not an S3 URI.
        RuntimeError: If S3 cannot be asked (no credentials, no such bucket, no network),
            naming the bucket; pass ``s3_region`` or set ``AWS_REGION`` instead.
    """
    bucket, _ = parse_s3_uri(uri)
    try:
        answer = retry_with_jitter(
            lambda: _boto3_client(s3_environment().region).get_bucket_location(Bucket=bucket)
        )
    except ImportError:
        raise
    except Exception as e:
        raise RuntimeError(
            f"get_s3_region_from_uri({uri!r}): asking S3 where bucket {bucket!r} lives failed "
            f"({type(e).__name__}: {e}); pass s3_region= or set AWS_REGION."
        ) from e
    # S3 answers None (older APIs: "") for us-east-1, and "EU" for the oldest eu-west-1 buckets.
    location = answer.get("LocationConstraint") or "us-east-1"
    return "eu-west-1" if location == "EU" else location


def resolve_region(uri: str, s3_region: str | None = None) -> str:
    """The region to use for ``uri``: ``s3_region``, else the environment, else the bucket's."""
    return s3_region or s3_environment().region or get_s3_region_from_uri(uri)


def default_client_config(endpoint: str | None) -> Any:
    """SMP's default ``S3ClientConfig``: 64 MiB parts; path-style for a custom endpoint."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(part_size=DEFAULT_PART_SIZE, force_path_style=endpoint is not None)


def make_s3_client(region: str, s3client_config: Any = None) -> Any:
    """An ``s3torchconnector`` ``S3Client`` for ``region`` at the environment's endpoint.

    Args:
        region: The bucket's region.
        s3client_config: An ``s3torchconnector.S3ClientConfig``; default
            ``default_client_config``.

    Raises:
        ImportError: If ``s3torchconnector`` is not installed (the message says how).
    """
    try:
        # The client class lives in s3torchconnector's _s3client module; its DCP writer and
        # reader build theirs the same way but take no endpoint (Note [S3 endpoint and
        # credentials]), so the client is made here and handed to their S3FileSystem.
        from s3torchconnector._s3client import S3Client
    except ImportError as e:
        raise ImportError(_INSTALL) from e
    endpoint = s3_environment().endpoint
    config = s3client_config if s3client_config is not None else default_client_config(endpoint)
    return S3Client(region, endpoint=endpoint, s3client_config=config)


def retry_with_jitter(
    fn: Callable[[], T],
    max_attempts: int = 5,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
    retry_on: tuple[type[BaseException], ...] | None = None,
) -> T:
    """Calls ``fn`` until it succeeds, sleeping a random ("full jitter") backoff between tries.

    Full jitter (a uniform wait in ``[0, min(max_delay, base_delay * 2**attempt)]``) keeps the
    ranks of a job, which fail together when S3 throttles them, from retrying in lockstep.

    Args:
        fn: The call to make.
        max_attempts: Calls in all (at least 1); the worst case waits less than
            ``max_attempts * max_delay`` seconds in all.
        base_delay: Backoff bound of the first retry, doubled each time, in seconds.
        max_delay: Largest backoff bound.
        retry_on: Exceptions that cause a retry; others propagate at once. Default:
            ``OSError`` and ``s3torchconnector``'s ``S3Exception`` (when installed).

    Returns:
        ``fn()``'s result.

    Raises:
        ValueError: If ``max_attempts < 1``.
        The last exception, when every attempt failed.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts} must be >= 1.")
    retry_on = retry_on if retry_on is not None else transient_errors()
    for attempt in range(max_attempts):
        try:
            return fn()
        except retry_on:
            if attempt == max_attempts - 1:
                raise
            time.sleep(random.uniform(0.0, min(max_delay, base_delay * 2**attempt)))
    raise AssertionError("unreachable")


def transient_errors() -> tuple[type[BaseException], ...]:
    """The exceptions ``retry_with_jitter`` retries by default."""
    errors: tuple[type[BaseException], ...] = (OSError,)
    try:
        from s3torchconnector import S3Exception

        errors += (S3Exception,)
    except ImportError:
        pass
    try:
        from botocore.exceptions import BotoCoreError

        errors += (BotoCoreError,)
    except ImportError:
        pass
    return errors


def s3_file_system_class() -> type:
    """The ``S3FileSystem`` class, defined on first use (importing ``s3torchconnector`` takes ~1 s).

    Raises:
        ImportError: Without ``s3torchconnector``.
    """
    cached = globals().get("S3FileSystem")
    if cached is not None:
        return cached
    try:
        from s3torchconnector.dcp.s3_file_system import S3FileSystem as ConnectorFileSystem
    except ImportError as e:
        raise ImportError(_INSTALL) from e

    class S3FileSystem(ConnectorFileSystem):
        """DCP's ``FileSystem`` on S3: ``s3torchconnector``'s, at the environment's endpoint.

        ``s3torchconnector.dcp``'s own ``S3FileSystem`` (what its DCP writer and reader use),
        with a client that reaches the endpoint of Note [S3 endpoint and credentials]. DCP's
        ``FileSystemWriter``/``FileSystemReader`` with this as ``fs`` write and read S3.

        Args:
            region: The bucket's region; default the environment's, else ``uri``'s bucket's.
            s3client_config: An ``s3torchconnector.S3ClientConfig`` (default
                ``default_client_config``).
            uri: A URI in the bucket, to look the region up when none is given.
            s3_client: A ready client (``make_s3_client``) instead of a new one.
            reader_constructor: ``s3torchconnector``'s reader constructor (reads only).

        Raises:
            ValueError: With no region anywhere and no ``uri`` to ask.
        """

        def __init__(
            self,
            region: str | None = None,
            s3client_config: Any = None,
            *,
            uri: str | None = None,
            s3_client: Any = None,
            reader_constructor: Any = None,
        ) -> None:
            if region is None and uri is None and s3_environment().region is None:
                raise ValueError(
                    "S3FileSystem(region=None): no region given and none in AWS_REGION or "
                    "AWS_DEFAULT_REGION; pass region= or uri= (its bucket's region is asked)."
                )
            region = region or resolve_region(uri or "")
            client = s3_client or make_s3_client(region, s3client_config)
            super().__init__(region, s3_client=client, reader_constructor=reader_constructor)
            self.region = region

    globals()["S3FileSystem"] = S3FileSystem  # one class, whoever asks first
    return S3FileSystem


def __getattr__(name: str) -> Any:
    # PEP 562: ``S3FileSystem`` subclasses s3torchconnector's class, which is imported only
    # when the name is first used, so that file-system checkpoints never pay for it.
    if name == "S3FileSystem":
        return s3_file_system_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def path_to_file_system(path: str | os.PathLike[str], s3_region: str | None = None) -> Any:
    """The DCP file system that stores ``path``: ``S3FileSystem`` for ``s3://``, else local."""
    text = os.fspath(path)
    if is_s3_uri(text):
        return s3_file_system_class()(resolve_region(text, s3_region))
    return FileSystem()


__all__ = [
    "DEFAULT_PART_SIZE",
    "S3Environment",
    "S3FileSystem",  # noqa: F822 - made on first use by the module's __getattr__
    "default_client_config",
    "format_s3_path",
    "get_s3_region_from_uri",
    "is_s3_uri",
    "join_s3",
    "make_s3_client",
    "parse_s3_uri",
    "path_to_file_system",
    "resolve_region",
    "retry_with_jitter",
    "s3_environment",
    "s3_file_system_class",
    "transient_errors",
]
