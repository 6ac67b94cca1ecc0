"""SMP's module path: re-exports ``torch_sagemaker.checkpoint.s3_filesystem``.

SMP's scripts import ``torch.sagemaker.distributed.checkpoint.s3_filesystem``. The code
lives in the home module; nothing is defined here (tests/unit/test_smp_api_surface.py checks
that each name is the home module's own object).

``S3FileSystem`` is made on first use by the home module's ``__getattr__`` (it subclasses
``s3torchconnector``'s class, which takes a second to import); re-exporting that function
keeps the name lazy here too.
"""

from torch_sagemaker.checkpoint.s3_filesystem import (
    DEFAULT_PART_SIZE,
    S3Environment,
    __getattr__,  # noqa: F401 - the home module's hook that makes S3FileSystem
    default_client_config,
    format_s3_path,
    get_s3_region_from_uri,
    is_s3_uri,
    join_s3,
    make_s3_client,
    parse_s3_uri,
    path_to_file_system,
    resolve_region,
    retry_with_jitter,
    s3_environment,
    s3_file_system_class,
    transient_errors,
)

__all__ = [
    "DEFAULT_PART_SIZE",
    "S3Environment",
    "S3FileSystem",  # noqa: F822 - made by the home module's __getattr__
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
