"""Checkpoints straight to ``s3://``, against a real S3-compatible server (moto's, on 127.0.0.1).

- 4 ranks, tp 2 x hybrid_shard_degree 2 (FSDP2 + DTensor TP): train 3 steps, save to S3
  synchronously and asynchronously, train 3 more; fresh models resumed from either S3
  checkpoint give the uninterrupted run's losses (the helpers of test_checkpoint_reshard).
- A corrupted, truncated or missing object, or a missing marker, is refused by name.
- A save killed during its upload (SIGKILL while its objects are being written) leaves the
  previous checkpoint loadable, and the next save removes what it left.
- Retention (``limit_num_subdirs``) keeps the newest checkpoints on S3, as SMP's scripts call it,
  and ``num_kept`` never deletes a Hugging Face export beside them.
- A transient S3 error on the commit is retried; SMP's file-system writer and reader work
  on ``s3://`` paths.

The server comes from the ``s3_server`` fixture (tests/conftest.py); every test uses its
own bucket.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.s3_server import environment

pytestmark = pytest.mark.distributed


def _keys(server, bucket: str) -> list[str]:
    pages = server.boto3().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _save_ids(keys: list[str], name: str) -> set[str]:
    return {m.group(1) for k in keys if (m := re.match(rf"{name}/([0-9a-f]{{32}})/", k))}


@pytest.fixture
def s3(s3_server):
    """``(server, bucket)`` with the library pointed at the server in this process."""
    with environment(s3_server.env):
        yield s3_server, s3_server.new_bucket()


# ------------------------------------------------------- 4 ranks: tp 2 x hsd 2, resume
def _tp_hsd_run(env: dict, root: str) -> dict:
    with environment(env):
        return _tp_hsd_run_in_env(root)


def _tp_hsd_run_in_env(root: str) -> dict:
    from tests.distributed.test_checkpoint_reshard import INIT_SEED, SAVE_AT, STEPS, build, train
    from torch_sagemaker.checkpoint import AsyncCallsQueue, TrainingState

    model, optim, sched = build(hsd=2, tp=2)
    losses = train(model, optim, sched, range(SAVE_AT))
    ts = TrainingState(model, optim, sched, step=SAVE_AT, data_position={"next_step": SAVE_AT})
    ts.save(f"{root}/sync/step{SAVE_AT}")
    queue = AsyncCallsQueue()
    ts.save(f"{root}/async/step{SAVE_AT}", use_async=True, queue=queue)
    losses += train(model, optim, sched, range(SAVE_AT, STEPS))  # the async save may still run
    out: dict = {"losses": losses, "finalized": queue.maybe_finalize_async_calls(blocking=True)}
    queue.close()
    # One fresh model (other init seed) resumes from each checkpoint in turn: a load restores
    # the model, optimizer, scheduler, step and RNG, so what the first resume trained is gone.
    model, optim, sched = build(hsd=2, tp=2, seed=INIT_SEED + 1)
    for kind in ("sync", "async"):
        ts = TrainingState(model, optim, sched)
        ts.load(f"{root}/{kind}/step{SAVE_AT}")
        start = ts.data_position["next_step"]
        out[kind] = (ts.step, train(model, optim, sched, range(start, STEPS)))
    return out


def test_tp_hsd_sharded_and_async_saves_resume_like_the_uninterrupted_run(s3):
    from tests.distributed.test_checkpoint_reshard import SAVE_AT, STEPS

    server, bucket = s3
    root = f"s3://{bucket}/llama"
    results = run_distributed(_tp_hsd_run, server.env, root, world_size=4, timeout=400)
    expected = results[0]["losses"]
    assert len(set(expected)) == STEPS
    for rank, r in enumerate(results):
        assert r["losses"] == expected, f"rank {rank} saw other losses"
        assert r["finalized"] == [0]
        for kind in ("sync", "async"):
            step, losses = r[kind]
            assert step == SAVE_AT, (kind, rank)
            torch.testing.assert_close(losses, expected[SAVE_AT:], rtol=1e-5, atol=1e-5)
    keys = _keys(server, bucket)
    for kind in ("sync", "async"):
        name = f"llama/{kind}/step{SAVE_AT}"
        assert f"{name}/.sm_checkpoint_complete.json" in keys
        assert len(_save_ids(keys, name)) == 1
        assert any(k.endswith(".distcp") and k.startswith(name) for k in keys)


# ------------------------------------------------------------------- single process
def _state(scale: float) -> dict:
    return {"w": torch.arange(4096.0) * scale, "b": torch.ones(7) * scale, "step": int(scale)}


def _loaded(uri: object) -> dict:
    from torch_sagemaker.checkpoint import load

    out = {"w": torch.zeros(4096), "b": torch.zeros(7), "step": 0}
    load(out, checkpoint_id=uri)
    return out


def _assert_state(got: dict, scale: float) -> None:
    want = _state(scale)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["step"] == want["step"]


def test_corrupted_truncated_and_missing_objects_are_refused_by_name(s3):
    from torch_sagemaker.checkpoint import CheckpointError, save

    server, bucket = s3
    client = server.boto3()
    uri = f"s3://{bucket}/run/step1"
    save(_state(1.0), checkpoint_id=uri)
    _assert_state(_loaded(uri), 1.0)
    data = [k for k in _keys(server, bucket) if k.endswith(".distcp")]
    assert data, "no data object written"
    victim = data[0]
    original = client.get_object(Bucket=bucket, Key=victim)["Body"].read()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(flipped))
    name = victim.split("/", 2)[2]  # <save id>/__0_0.distcp
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} does not match its crc32"):
        _loaded(uri)
    client.put_object(Bucket=bucket, Key=victim, Body=original[:-3])
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} has {len(original) - 3} bytes"):
        _loaded(uri)
    client.delete_object(Bucket=bucket, Key=victim)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} is missing"):
        _loaded(uri)
    client.put_object(Bucket=bucket, Key=victim, Body=original)
    _assert_state(_loaded(uri), 1.0)  # the same bytes back: loads again
    metadata = next(k for k in _keys(server, bucket) if k.endswith("/.metadata"))
    client.put_object(
        Bucket=bucket,
        Key=metadata,
        Body=b"x" * len(client.get_object(Bucket=bucket, Key=metadata)["Body"].read()),
    )
    with pytest.raises(CheckpointError, match=r"\.metadata does not match its crc32"):
        _loaded(uri)
    client.delete_object(Bucket=bucket, Key="run/step1/.sm_checkpoint_complete.json")
    with pytest.raises(CheckpointError, match="is incomplete: it has no completion marker"):
        _loaded(uri)
    with pytest.raises(CheckpointError, match="does not exist"):
        _loaded(f"s3://{bucket}/run/step9")


def test_loading_as_another_kind_on_s3_names_the_kind_it_was_saved_as(s3):
    """As on a file system: a checkpoint in per-rank parts or SM-local shards, each with its
    own marker, was reported incomplete ("load an earlier checkpoint"); a whole checkpoint
    loaded as parts was only said not to exist."""
    from torch_sagemaker.checkpoint import CheckpointError, save

    _, bucket = s3
    root = f"s3://{bucket}/run"
    for part in ("tp2-0", "tp2-1"):  # what FSDP1 with tensor parallelism writes
        save(_state(1.0), checkpoint_id=f"{root}/parts/{part}")
    save(_state(1.0), checkpoint_id=f"{root}/local/tp0_ep0_fsdp0")
    save(_state(1.0), checkpoint_id=f"{root}/whole")
    with pytest.raises(CheckpointError, match=r"parts holds the per-rank parts \(tp2-<r>\)"):
        _loaded(f"{root}/parts")
    with pytest.raises(CheckpointError, match=r"local holds an SM-local checkpoint.*kind='local'"):
        _loaded(f"{root}/local")
    with pytest.raises(CheckpointError, match=r"whole is itself a complete checkpoint.*FSDP2"):
        _loaded(f"{root}/whole/tp2-0")


def test_checksums_are_an_option_of_the_s3_location(s3):
    from torch_sagemaker.checkpoint import CheckpointError, checkpoint_location, save

    server, bucket = s3
    client = server.boto3()

    def flip_a_byte(name: str) -> None:
        key = next(k for k in _keys(server, bucket) if k.startswith(name) and k.endswith("distcp"))
        raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[len(raw) // 2] ^= 0x10
        client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))

    def marker(name: str) -> dict:
        key = f"{name}/.sm_checkpoint_complete.json"
        return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    # Off: sizes only in the marker, and nothing checksummed on the way back either.
    off = checkpoint_location(f"s3://{bucket}/off", checksums=False)
    save(_state(1.0), checkpoint_id=off)
    assert marker("off")["format_version"] == 1 and "checksums" not in marker("off")
    flip_a_byte("off/")
    assert _loaded(off)["step"] == 1
    # On: refused by name, unless the loading location turns checksums off.
    save(_state(2.0), checkpoint_id=f"s3://{bucket}/on")
    assert set(marker("on")["checksums"]) == set(marker("on")["files"])
    flip_a_byte("on/")
    with pytest.raises(CheckpointError, match="does not match its crc32 checksum"):
        _loaded(f"s3://{bucket}/on")
    unchecked = _loaded(checkpoint_location(f"s3://{bucket}/on", checksums=False))
    assert unchecked["step"] == 2 and not torch.equal(unchecked["w"], _state(2.0)["w"])


def _save_then_die_during_upload(env: dict, uri: str, second: str, conn) -> None:
    """Child: a complete save of ``uri``, then a save of ``second`` that stops mid-upload."""
    from torch_sagemaker.checkpoint import save
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemWriter

    with environment(env):
        save(_state(1.0), checkpoint_id=uri)

        def uploaded(writer) -> None:
            # This rank's data objects are in S3; .metadata and the marker are not. Tell the
            # test, then wait to be killed.
            conn.send(str(writer.path))
            conn.recv()  # never answered: the parent kills this process

        writer = DistributedFileSystemWriter(second, post_write_hooks=[uploaded])
        save(_state(2.0), checkpoint_id=second, storage_writer=writer)


@pytest.mark.parametrize("second", ["step1", "step2"], ids=["same_name", "next_name"])
def test_a_save_killed_during_upload_leaves_the_previous_checkpoint(s3, second):
    from torch_sagemaker.checkpoint import CheckpointError, is_complete, save

    server, bucket = s3
    uri, second_uri = f"s3://{bucket}/run/step1", f"s3://{bucket}/run/{second}"
    parent, child_end = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(
        target=_save_then_die_during_upload, args=(server.env, uri, second_uri, child_end)
    )
    child.start()
    try:
        assert parent.poll(120), "the child never reached the upload"
        writing_to = parent.recv()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    keys = _keys(server, bucket)
    killed_id = writing_to.rsplit("/", 1)[1]
    assert any(k.startswith(f"run/{second}/{killed_id}/") for k in keys), "nothing was uploaded"
    _assert_state(_loaded(uri), 1.0)  # the previous checkpoint, untouched
    assert is_complete(uri)
    if second != "step1":
        assert not is_complete(second_uri)
        with pytest.raises(CheckpointError, match="incomplete"):
            _loaded(second_uri)
    # The next save of that name commits and removes what the killed one left.
    save(_state(3.0), checkpoint_id=second_uri)
    _assert_state(_loaded(second_uri), 3.0)
    assert len(_save_ids(_keys(server, bucket), f"run/{second}")) == 1


def test_retention_keeps_the_newest_checkpoints_on_s3(s3):
    from torch_sagemaker.checkpoint import save
    from torch_sagemaker.checkpoint.utils import limit_num_subdirs

    server, bucket = s3
    root = f"s3://{bucket}/job"
    regex = r"^.*\d+steps$"
    save(_state(0.0), checkpoint_id=f"{root}/notes")  # not a checkpoint name: never deleted
    for step in (100, 200, 300, 400):
        uri = f"{root}/llama-{step}steps"
        # SMP's sharded type: retention right after the save, called with the new folder.
        save(
            _state(step),
            checkpoint_id=uri,
            on_commit=lambda uri=uri: limit_num_subdirs(uri, 2, regex=regex),
        )
    prefixes = {k.split("/")[1] for k in _keys(server, bucket)}
    assert prefixes == {"notes", "llama-300steps", "llama-400steps"}
    # A save that died during its upload left objects but no marker: it neither counts nor
    # passes for the newest checkpoint (before, it was kept in place of llama-400steps).
    server.boto3().put_object(Bucket=bucket, Key="job/llama-450steps/0/x.distcp", Body=b"x")
    # The async types call it before writing: the upcoming one counts, the newest stays.
    deleted = limit_num_subdirs(f"{root}/llama-500steps", 2, regex=regex)
    assert deleted == [f"{root}/llama-300steps"]
    assert {k.split("/")[1] for k in _keys(server, bucket)} == {
        "notes",
        "llama-400steps",
        "llama-450steps",
    }
    _assert_state(_loaded(f"{root}/llama-400steps"), 400)
    # A whole bucket may be the root: its only prefix, job/, is no checkpoint, so nothing goes.
    assert limit_num_subdirs(f"s3://{bucket}", 1) == []


def test_retention_on_s3_never_deletes_a_hugging_face_export(s3):
    """Note [Retention deletes only training checkpoints]: an export synced to S3 with its
    directory (SageMaker uploads the checkpoint directory) keeps its completion marker."""
    from torch_sagemaker.checkpoint import TrainingState
    from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER

    server, bucket = s3
    marker = {"kind": "hugging_face", "files": {"model.safetensors": 1}}
    server.boto3().put_object(Bucket=bucket, Key="job/hf_export/model.safetensors", Body=b"w")
    server.boto3().put_object(
        Bucket=bucket, Key=f"job/hf_export/{COMPLETION_MARKER}", Body=json.dumps(marker)
    )
    state = TrainingState(torch.nn.Linear(2, 2), save_rng=False)
    for step in (1, 2):
        state.step = step
        state.save(f"s3://{bucket}/job/llama-{step}steps", num_kept=1)
    assert {k.split("/")[1] for k in _keys(server, bucket)} == {"hf_export", "llama-2steps"}


def test_a_transient_error_on_the_commit_is_retried(s3, monkeypatch):
    from s3torchconnector import S3Exception

    from torch_sagemaker.checkpoint import s3_checkpoint, s3_filesystem, save

    server, bucket = s3
    failures: list[str] = []

    class Flaky:
        """The real client, whose marker PUT fails twice (as a throttled request would)."""

        def __init__(self, inner):
            self._inner = inner

        def put_object(self, bucket, key, *args):
            if key.endswith(".sm_checkpoint_complete.json") and len(failures) < 2:
                failures.append(key)
                raise S3Exception("SlowDown: please reduce your request rate")
            return self._inner.put_object(bucket, key, *args)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    real = s3_checkpoint.S3Checkpoint.client
    monkeypatch.setattr(
        s3_checkpoint.S3Checkpoint, "client", property(lambda self: Flaky(real.fget(self)))
    )
    waits: list[float] = []
    monkeypatch.setattr(s3_filesystem.time, "sleep", waits.append)
    uri = f"s3://{bucket}/run/step1"
    save(_state(5.0), checkpoint_id=uri)
    assert len(failures) == 2 and len(waits) == 2
    _assert_state(_loaded(uri), 5.0)


def test_smp_file_system_reader_reads_the_committed_save(s3):
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint import load, save
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    _, bucket = s3
    uri = f"s3://{bucket}/run/step1"
    save(_state(1.0), checkpoint_id=uri)
    save(_state(2.0), checkpoint_id=uri)  # replaces it: the reader must see the second
    reader = DistributedFileSystemReader(uri)
    out = {"w": torch.zeros(4096), "b": torch.zeros(7), "step": 0}
    dcp.load(out, storage_reader=reader, no_dist=True)  # DCP alone, as SMP's scripts use it
    _assert_state(out, 2.0)
    out = {"w": torch.zeros(4096), "b": torch.zeros(7), "step": 0}
    load(out, storage_reader=DistributedFileSystemReader(uri))  # no checkpoint_id
    _assert_state(out, 2.0)


def test_dcp_load_through_the_smp_reader_refuses_a_changed_object(s3):
    """DCP's load with SMP's reader checks the objects it reads against the marker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from torch_sagemaker.checkpoint import save
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    server, bucket = s3
    client = server.boto3()
    uri = f"s3://{bucket}/run/step1"
    save(_state(1.0), checkpoint_id=uri)
    out = {"w": torch.zeros(4096), "b": torch.zeros(7), "step": 0}
    # Given the checkpoint's URI as its checkpoint_id too, DCP still reads the committed save
    # (before, DCP's reset pointed the reader at the checkpoint's prefix: no .metadata there).
    dcp.load(out, checkpoint_id=uri, storage_reader=DistributedFileSystemReader(uri), no_dist=True)
    _assert_state(out, 1.0)
    (victim,) = [k for k in _keys(server, bucket) if k.endswith(".distcp")]
    flipped = bytearray(client.get_object(Bucket=bucket, Key=victim)["Body"].read())
    flipped[len(flipped) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(flipped))
    name = victim.split("/", 2)[2]  # <save id>/__0_0.distcp
    out = {"w": torch.zeros(4096), "b": torch.zeros(7), "step": 0}
    with pytest.raises(CheckpointException, match=rf"{re.escape(name)} does not match its crc32"):
        dcp.load(out, storage_reader=DistributedFileSystemReader(uri), no_dist=True)
    assert float(out["w"].abs().sum()) == 0.0
