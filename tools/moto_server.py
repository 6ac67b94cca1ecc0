"""A local S3-compatible server for the tests and ``bench checkpoint --s3``: ``moto``'s.

``moto_s3()`` starts ``python -m moto.server`` on a free loopback port in a child process,
waits until it answers, and yields an ``S3Server`` with the environment that points the
library (and boto3) at it: ``AWS_ENDPOINT_URL_S3``, the region and dummy credentials. The
server is stopped when the context exits. Nothing leaves the machine: the endpoint is
127.0.0.1 and moto keeps every object in the child's memory.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from tools.ranks import free_port

REGION = "us-east-1"


@dataclass
class S3Server:
    """A running server: its endpoint, and the environment that selects it."""

    endpoint: str
    env: dict[str, str] = field(default_factory=dict)

    def boto3(self) -> Any:
        """A boto3 S3 client of the server (for setting up and inspecting buckets)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def new_bucket(self) -> str:
        """A fresh, empty bucket (one per test keeps tests independent)."""
        name = f"tsm-{uuid.uuid4().hex[:12]}"
        self.boto3().create_bucket(Bucket=name)
        return name


@contextlib.contextmanager
def moto_s3(start_timeout_s: float = 60.0) -> Iterator[S3Server]:
    """Runs moto's S3 server on 127.0.0.1 for the duration of the block.

    Args:
        start_timeout_s: How long to wait for it to answer.

    Raises:
        RuntimeError: If it exits or does not answer in time.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto's server exited with code {proc.returncode}")
            try:
                # moto's own health endpoint; a refused connection means it is not up yet.
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not answer on {endpoint}") from None
                time.sleep(0.1)  # polling for readiness, not ordering: the loop checks the state
        env = {
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_REGION": REGION,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            # No credential lookups beyond the variables (no instance metadata service).
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        yield S3Server(endpoint=endpoint, env=env)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` for the block (restored after).

    Args:
        env: The variables to set.
    """
    with mock.patch.dict(os.environ, env):
        yield
