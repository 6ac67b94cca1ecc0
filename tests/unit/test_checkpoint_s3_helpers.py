"""The S3 and auto-checkpoint names HyperPod's adapter imports, without a server.

URI helpers, where the endpoint and region come from, the bounded jittered retry, the
automatic checkpoint interval and ``AsyncCallsQueue`` ordering. The S3 protocol itself is
tested against moto's server in tests/distributed/test_checkpoint_s3.py.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from torch_sagemaker.checkpoint import s3_filesystem as s3
from torch_sagemaker.checkpoint.state_dict_utils import (
    _Interval,
    compute_auto_checkpoint_interval,
)


def test_format_s3_path_normalizes_uris_and_joins_keys():
    assert s3.format_s3_path("bucket", "/a//b/") == "s3://bucket/a/b"
    assert s3.format_s3_path("s3://bucket//run/step1/") == "s3://bucket/run/step1"
    assert s3.format_s3_path("s3://bucket") == "s3://bucket"
    assert s3.join_s3("s3://bucket/run", "step1", "tp2-0") == "s3://bucket/run/step1/tp2-0"
    bucket, key = s3.parse_s3_uri(s3.format_s3_path("s3://b1/x/"))
    assert (bucket, key) == ("b1", "x")


@pytest.mark.parametrize(
    ("environ", "endpoint", "region"),
    [
        ({}, None, None),
        ({"AWS_ENDPOINT_URL": "http://a:1"}, "http://a:1", None),
        (
            {"AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "http://s3:2"},
            "http://s3:2",
            None,
        ),
        ({"AWS_DEFAULT_REGION": "eu-west-1"}, None, "eu-west-1"),
        ({"AWS_DEFAULT_REGION": "eu-west-1", "AWS_REGION": "us-west-2"}, None, "us-west-2"),
    ],
)
def test_endpoint_and_region_follow_the_aws_variables(environ, endpoint, region):
    env = s3.s3_environment(environ)
    assert (env.endpoint, env.region) == (endpoint, region)


def test_region_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    assert s3.resolve_region("s3://b/k", "ap-south-1") == "ap-south-1"
    assert s3.resolve_region("s3://b/k") == "us-west-2"


def test_client_config_is_path_style_only_for_a_custom_endpoint():
    pytest.importorskip("s3torchconnector", reason="pip install 's3torchconnector[dcp]'")
    assert s3.default_client_config("http://127.0.0.1:9").force_path_style
    assert not s3.default_client_config(None).force_path_style
    assert s3.default_client_config(None).part_size == 64 << 20


def test_retry_with_jitter_retries_transient_errors_within_bounds(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(s3.time, "sleep", waits.append)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise OSError("throttled")
        return "ok"

    assert s3.retry_with_jitter(flaky, max_attempts=4, base_delay=1.0, max_delay=3.0) == "ok"
    # Three waits, each uniform in [0, min(max_delay, base * 2**attempt)].
    assert len(waits) == 3 and all(0 <= w <= b for w, b in zip(waits, [1.0, 2.0, 3.0]))
    calls.clear()
    with pytest.raises(OSError, match="throttled"):
        s3.retry_with_jitter(flaky, max_attempts=2, base_delay=0.0)
    assert len(calls) == 2  # bounded: no third try
    with pytest.raises(KeyError):  # not transient: no retry at all
        s3.retry_with_jitter(lambda: {}["x"], max_attempts=5)
    with pytest.raises(ValueError, match="max_attempts=0"):
        s3.retry_with_jitter(lambda: 1, max_attempts=0)


def test_retry_default_covers_the_connectors_error():
    connector = pytest.importorskip("s3torchconnector")
    assert connector.S3Exception in s3.transient_errors()


def test_file_system_for_s3_paths_is_the_connectors():
    pytest.importorskip("s3torchconnector")
    from s3torchconnector.dcp.s3_file_system import S3FileSystem as Connector

    fs = s3.path_to_file_system("s3://bucket/ckpt", s3_region="us-east-1")
    assert isinstance(fs, Connector) and isinstance(fs, s3.S3FileSystem)
    assert fs.region == "us-east-1"


# ------------------------------------------------------------- auto checkpoint interval
def test_interval_bounds_the_overhead_fraction():
    # Plain step 1 s; a save adds 0.5 s to its step: 5% allows one save per 10 steps.
    got = compute_auto_checkpoint_interval([1.0, 1.0, 1.1], [1.5, 1.5], [0.1], [2.0])
    assert got.interval == 10 and got.checkpoint_overhead == pytest.approx(0.5)
    assert got.checkpoint_overhead / (got.interval * got.step_duration) <= 0.05
    # Allowing 25% saves every 2 steps.
    assert compute_auto_checkpoint_interval([1.0], [1.5], [0.1], [0.5], 0.25).interval == 2


def test_interval_waits_for_the_background_write():
    # Cheap to start, but the write takes 7.5 steps: saves must not queue up.
    got = compute_auto_checkpoint_interval([2.0], [2.0], [0.0], [15.0], 0.5)
    assert got.interval == 8 and got.io_duration == 15.0


def test_interval_uses_medians_and_preprocessing_as_a_floor():
    # One compilation-slow step does not move the median; preprocessing (0.5 s) is the
    # overhead when the step with a save measured no slower.
    got = compute_auto_checkpoint_interval([1.0, 1.0, 30.0], [1.0], [0.5], [0.0], 0.25)
    assert got.step_duration == 1.0 and got.checkpoint_overhead == 0.5 and got.interval == 2


def test_interval_round_trips_like_the_adapter_stores_it():
    got = compute_auto_checkpoint_interval([1.0], [1.2], [0.1], [1.0])
    assert _Interval(**dataclasses.asdict(got)) == got


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([], [1.0], [0.0], [0.0]), "step_durations is empty"),
        (([1.0], [1.0], [-1.0], [0.0]), "ckpt_preprocessing_durations holds"),
        (([0.0], [1.0], [0.0], [0.0]), "must take time"),
        (([1.0], [1.0], [0.0], [float("nan")]), "ckpt_io_durations holds"),
    ],
)
def test_interval_rejects_unusable_measurements(args, match):
    with pytest.raises(ValueError, match=match):
        compute_auto_checkpoint_interval(*args)
    with pytest.raises(ValueError, match="max_overhead_fraction=0"):
        compute_auto_checkpoint_interval([1.0], [1.0], [0.0], [0.0], 0)


# ----------------------------------------------------------------------- AsyncCallsQueue
def test_async_calls_queue_finalizes_in_order_and_keeps_later_calls_after_a_failure():
    from torch_sagemaker.checkpoint import AsyncCallsQueue, CheckpointError

    queue = AsyncCallsQueue()
    release = threading.Event()
    order: list[int] = []

    def first():
        release.wait(60)
        order.append(0)

    def second():
        order.append(1)
        raise OSError("upload failed")

    assert queue.schedule_async_request(first) == 0
    assert queue.schedule_async_request(second) == 1
    assert queue.schedule_async_request(lambda: order.append(2)) == 2
    # Nothing finished yet (the first call holds the single worker): nothing finalized.
    assert queue.maybe_finalize_async_calls(blocking=False, skip_sync=True) == []
    assert queue.get_num_unfinalized_calls() == 3
    release.set()
    with pytest.raises(CheckpointError, match="request 1 failed: upload failed"):
        queue.maybe_finalize_async_calls(blocking=True, skip_sync=True)
    assert queue.maybe_finalize_async_calls(blocking=True, skip_sync=True) == [2]
    assert order == [0, 1, 2]
    queue.close()
