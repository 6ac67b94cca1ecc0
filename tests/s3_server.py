"""The moto S3 server the S3 tests run against (``tools.moto_server``)."""

from tools.moto_server import REGION, S3Server, environment, moto_s3

__all__ = ["REGION", "S3Server", "environment", "moto_s3"]
