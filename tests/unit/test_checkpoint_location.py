"""The checkpoint location: one chooser, the options a location carries, checksums as an option.

S3 locations are exercised against a real server in tests/distributed/test_checkpoint_s3.py;
here only their naming, which needs no server (the region is given, so nothing is asked).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from torch_sagemaker.checkpoint import (
    CheckpointError,
    CheckpointLocation,
    TrainingState,
    checkpoint_location,
    load,
    save,
)
from torch_sagemaker.checkpoint.atomic_dir import LocalDirectory
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER
from torch_sagemaker.checkpoint.s3_checkpoint import S3Checkpoint


def _state(scale: float) -> dict:
    return {"w": torch.arange(1024.0) * scale, "step": int(scale)}


def _load(where) -> dict:
    out = {"w": torch.zeros(1024), "step": 0}
    load(out, checkpoint_id=where)
    return out


def _marker(path: Path) -> dict:
    return json.loads((path / COMPLETION_MARKER).read_text())


def _flip_a_byte(path: Path) -> None:
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the tensor bytes: same size, another value
    data.write_bytes(bytes(raw))


def test_one_function_chooses_the_location_and_its_options_travel(tmp_path):
    local = checkpoint_location(tmp_path / "run" / "step1", checksums=False)
    assert isinstance(local, LocalDirectory) and isinstance(local, CheckpointLocation)
    assert checkpoint_location(local) is local  # a location passes through
    assert local.name == "step1" and str(local.parent()) == str(tmp_path / "run")
    child = local.child("tp2-0")
    assert str(child) == str(tmp_path / "run" / "step1" / "tp2-0") and not child.checksums

    remote = checkpoint_location("s3://bucket//run/step1/", s3_region="eu-west-1")
    assert isinstance(remote, S3Checkpoint) and isinstance(remote, CheckpointLocation)
    assert str(remote) == "s3://bucket/run/step1" and remote.checksums
    child = remote.child("tp2-0")
    assert str(child) == "s3://bucket/run/step1/tp2-0" and child.region == "eu-west-1"
    top = remote.parent().parent()  # the bucket: it may hold checkpoints, not be one
    assert str(top) == "s3://bucket" and top.parent() is None

    with pytest.raises(ValueError, match="checkpoint_id is required"):
        checkpoint_location(None)
    with pytest.raises(ValueError, match="is a bucket; a checkpoint needs a key prefix"):
        checkpoint_location("s3://bucket", s3_region="eu-west-1")
    with pytest.raises(ValueError, match="already a location.*checkpoint_location"):
        checkpoint_location(local, s3_region="eu-west-1")


def test_checksums_are_an_option_of_the_location(tmp_path):
    # Off: the marker holds sizes only (format 1), and a changed byte is not looked for.
    off = checkpoint_location(tmp_path / "off", checksums=False)
    save(_state(1.0), checkpoint_id=off)
    marker = _marker(tmp_path / "off")
    assert marker["format_version"] == 1 and "checksums" not in marker
    _flip_a_byte(tmp_path / "off")
    assert not torch.equal(_load(off)["w"], _state(1.0)["w"])

    # On (the default): the same change is refused by name, unless the load turns it off.
    save(_state(2.0), checkpoint_id=tmp_path / "on")
    assert set(_marker(tmp_path / "on")["checksums"]) == set(_marker(tmp_path / "on")["files"])
    _flip_a_byte(tmp_path / "on")
    with pytest.raises(CheckpointError, match=r"\.distcp does not match its crc32 checksum"):
        _load(tmp_path / "on")
    unchecked = _load(checkpoint_location(tmp_path / "on", checksums=False))
    assert unchecked["step"] == 2 and not torch.equal(unchecked["w"], _state(2.0)["w"])


def test_training_state_and_retention_take_a_location(tmp_path):
    model = torch.nn.Linear(4, 3)
    for step in (1, 2):
        where = checkpoint_location(tmp_path / f"model-{step}steps", checksums=False)
        TrainingState(model, step=step, save_rng=False).save(where, num_kept=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-2steps"]
    assert "checksums" not in _marker(tmp_path / "model-2steps")  # the option reached save
    restored = TrainingState(torch.nn.Linear(4, 3), save_rng=False)
    restored.load(checkpoint_location(tmp_path / "model-2steps"))
    assert restored.step == 2
    assert torch.equal(restored.model.weight, model.weight)


def test_bench_checkpoint_baseline_is_the_checksums_off_location(tmp_path):
    from benchmarks import checkpoint as bench

    args = argparse.Namespace(mb=4, repeats=1, threads=[1], dir=str(tmp_path), s3=None)
    rows = bench.run(args)  # raises if a marker does not match its configuration
    configs = {(r["op"], r["config"]) for r in rows if r["target"] == "disk"}
    assert configs == {
        (op, c) for op in ("save", "load") for c in ("DCP alone", "tsm, no checksums", "tsm, crc32")
    }


@pytest.mark.parametrize("given", [Path("s3://bucket/run/step1"), "S3://bucket/run/step1"])
def test_text_that_only_looks_like_an_s3_uri_is_refused(tmp_path, monkeypatch, given):
    """A pathlib.Path of an URI keeps one slash; written locally it would land in ./s3:."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="looks like an S3 URI but is not one"):
        checkpoint_location(given)
    with pytest.raises(ValueError, match="looks like an S3 URI"):
        save({"w": torch.ones(2)}, checkpoint_id=given)
    assert list(tmp_path.iterdir()) == []
