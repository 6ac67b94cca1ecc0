"""Checkpoint save/load in one process: round trips, the commit protocol, errors, retention."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torch_sagemaker.checkpoint import (
    AsyncCallsQueue,
    CheckpointError,
    SMStateDictType,
    async_save,
    init_optim_state,
    is_complete,
    load,
    save,
    sm_state_dict_type,
)
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER
from torch_sagemaker.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(scale: float = 1.0) -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(8, 4) * scale, "b": torch.zeros(4) + scale},
        "step": int(scale * 10),
        "note": "hello",
    }


def _template() -> dict:
    return {"model": {"w": torch.empty(8, 4), "b": torch.empty(4)}, "step": 0, "note": ""}


def test_round_trip_and_marker(tmp_path):
    save(_state(), checkpoint_id=tmp_path / "c")
    assert is_complete(tmp_path / "c") and not (tmp_path / ".c.partial").exists()
    got = _template()
    load(got, checkpoint_id=tmp_path / "c")
    want = _state()
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and got["step"] == 10
    assert got["note"] == "hello"


def test_missing_partial_and_replaced_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"does not exist"):
        load(_template(), checkpoint_id=tmp_path / "nope")
    save(_state(), checkpoint_id=tmp_path / "c")
    os.remove(tmp_path / "c" / COMPLETION_MARKER)
    with pytest.raises(CheckpointError, match=r"incomplete.*completion marker") as e:
        load(_template(), checkpoint_id=tmp_path / "c")
    assert str(tmp_path / "c") in str(e.value)
    # A crash between "move the old one away" and "rename the new one" points at the old one.
    save(_state(), checkpoint_id=tmp_path / "d")
    os.replace(tmp_path / "d", tmp_path / ".d.replaced")
    with pytest.raises(CheckpointError, match=r"\.d\.replaced"):
        load(_template(), checkpoint_id=tmp_path / "d")


def test_truncated_and_garbled_files_are_reported(tmp_path):
    save(_state(), checkpoint_id=tmp_path / "c")
    data = next(f for f in os.listdir(tmp_path / "c") if f.endswith(".distcp"))
    with open(tmp_path / "c" / data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=rf"corrupt: {data} has 10 bytes"):
        load(_template(), checkpoint_id=tmp_path / "c")
    save(_state(), checkpoint_id=tmp_path / "m")
    meta = tmp_path / "m" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)  # same size, garbage content
    with pytest.raises(CheckpointError, match=r"corrupt: \.metadata does not match its crc32"):
        load(_template(), checkpoint_id=tmp_path / "m")
    # A marker from before checksums (format 1): the garbage is found when DCP unpickles it.
    marker = json.loads((tmp_path / "m" / COMPLETION_MARKER).read_text())
    marker.pop("checksums")
    marker["format_version"] = 1
    (tmp_path / "m" / COMPLETION_MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"corrupt: its DCP metadata is unreadable"):
        load(_template(), checkpoint_id=tmp_path / "m")


def test_mismatched_keys_and_shapes_are_listed(tmp_path):
    save(_state(), checkpoint_id=tmp_path / "c")
    wrong = {
        "model": {"w": torch.empty(4, 8), "b": torch.empty(4), "extra": torch.empty(2)},
        "step": 0,
        "note": "",
    }
    with pytest.raises(CheckpointError) as e:
        load(wrong, checkpoint_id=tmp_path / "c")
    msg = str(e.value)
    assert str(tmp_path / "c") in msg
    assert "model.extra" in msg and "missing" in msg
    assert "model.w: checkpoint shape (8, 4), requested (4, 8)" in msg


def test_optimizer_state_missing_for_another_reason_is_refused(tmp_path):
    # Note [Parameters without optimizer state]: only parameters of the saved optimizer may
    # lack state; the other missing keys are still a mismatch.
    from torch_sagemaker.checkpoint import TrainingState

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optim = torch.optim.AdamW(model[0].parameters())  # the second layer is not optimized
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    model.zero_grad(set_to_none=True)
    TrainingState(model, optim, save_rng=False).save(tmp_path / "c")
    over_all = TrainingState(model, torch.optim.AdamW(model.parameters()), save_rng=False)
    with pytest.raises(CheckpointError, match=r"did not hold 2 of its parameters.*'1\.weight'"):
        over_all.load(tmp_path / "c")
    other = TrainingState(
        model, torch.optim.SGD(model[0].parameters(), momentum=0.9), save_rng=False
    )
    with pytest.raises(CheckpointError, match=r"missing.*optimizer\.state\.0\.bias\.momentum"):
        other.load(tmp_path / "c")


@pytest.mark.parametrize("kind", ["sharded", "local"])
def test_a_bigger_model_or_another_optimizer_is_refused_not_half_loaded(
    tmp_path, kind, monkeypatch
):
    """Note [A checkpoint that loads is the checkpoint that was saved]: keys the checkpoint
    holds beyond what the model and optimizer ask for are refused before anything is read;
    ``strict=False`` loads the overlap and names what it left behind."""
    from torch_sagemaker.checkpoint import TrainingState

    big = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    optim = torch.optim.AdamW(big.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)  # adds initial_lr
    big(torch.randn(2, 4)).sum().backward()
    optim.step()
    TrainingState(big, optim, sched, step=5, save_rng=False).save(tmp_path / "c", kind=kind)

    small = nn.Sequential(nn.Linear(4, 4))
    before = small[0].weight.detach().clone()
    with pytest.raises(
        CheckpointError, match=r"holds 4 model keys .*'model\.1\.bias'.*strict=False"
    ):
        TrainingState(small, save_rng=False).load(tmp_path / "c", kind=kind)
    assert torch.equal(small[0].weight, before)  # refused before the read
    warned: list[str] = []
    monkeypatch.setattr(
        "torch_sagemaker.checkpoint.training_state_checks.get_logger",
        lambda: SimpleNamespace(warning=warned.append),
    )
    part = TrainingState(small, save_rng=False)
    part.load(tmp_path / "c", kind=kind, strict=False)
    assert torch.equal(small[0].weight, big[0].weight) and part.step == 5
    assert len(warned) == 1 and "4 model keys of the checkpoint are left behind" in warned[0]

    # The same model with an optimizer over fewer parameters: the others' state (2 layers x
    # 2 tensors x 3 states) is left behind.
    fewer = torch.optim.AdamW(big[0].parameters())
    with pytest.raises(CheckpointError, match=r"holds 12 optimizer-state keys that"):
        TrainingState(big, fewer, save_rng=False).load(tmp_path / "c", kind=kind)
    # Not mismatches: the items not asked for (no scheduler, no optimizer, or
    # load_optimizer=False), and the hyper-parameters the scheduler added.
    TrainingState(big, save_rng=False).load(tmp_path / "c", kind=kind)
    TrainingState(big, fewer, save_rng=False).load(tmp_path / "c", kind=kind, load_optimizer=False)
    # A fresh optimizer over parameters that still hold gradients gets the saved state.
    assert all(p.grad is not None for p in big.parameters())
    fresh = torch.optim.AdamW(big.parameters())
    TrainingState(big, fresh, save_rng=False).load(tmp_path / "c", kind=kind)
    for p in big.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], optim.state[p]["exp_avg"])


def test_loading_without_the_optimizer_leaves_a_fresh_one_fresh(tmp_path):
    """``load(load_optimizer=False)``: the model's weights, and an optimizer with no state, so
    its first step is a first step (no invented step count or moments)."""
    from torch_sagemaker.checkpoint import TrainingState

    model = nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    TrainingState(model, optim, save_rng=False).save(tmp_path / "c")
    for kind in ("sharded", "local"):
        if kind == "local":
            TrainingState(model, optim, save_rng=False).save(tmp_path / "l", kind="local")
        fresh = nn.Linear(4, 4)
        fresh_optim = torch.optim.AdamW(fresh.parameters())
        path = tmp_path / ("c" if kind == "sharded" else "l")
        TrainingState(fresh, fresh_optim, save_rng=False).load(
            path, kind=kind, load_optimizer=False
        )
        assert torch.equal(fresh.weight, model.weight), kind
        assert not fresh_optim.state, (kind, fresh_optim.state)


@pytest.mark.parametrize("when", ["before_any_backward", "mid_accumulation"])
@pytest.mark.parametrize("kind", ["sharded", "local"])
def test_a_save_before_the_first_step_does_not_change_the_run(tmp_path, kind, when):
    """Note [Saving creates no optimizer state]: saved before any step (before the first
    backward, or between two accumulated micro-batches), the run goes on as without the
    save, and a run resumed from it trains the same."""
    from torch_sagemaker.checkpoint import TrainingState

    def trainer():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def steps(model, optim, save_at=None):
        for step in range(3):
            for micro in range(2):
                if step == micro == 0 and save_at is not None and when == "before_any_backward":
                    save_at(model, optim)
                x = torch.full((3, 4), 1.0 + step + micro)
                model(x).square().sum().backward()
                if step == micro == 0 and save_at is not None and when == "mid_accumulation":
                    save_at(model, optim)
            optim.step()
            optim.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    def save(model, optim):
        TrainingState(model, optim, save_rng=False).save(tmp_path / "s", kind=kind)
        assert not optim.state, "the save created optimizer state"

    reference = steps(*trainer())
    assert all(torch.equal(a, b) for a, b in zip(reference, steps(*trainer(), save)))
    model, optim = trainer()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the load must bring the saved values back
    TrainingState(model, optim, save_rng=False).load(tmp_path / "s", kind=kind)
    assert not optim.state  # as when it was saved
    # The resumed run starts again at the first micro-batch (the saved one was not stepped).
    assert all(torch.equal(a, b) for a, b in zip(reference, steps(model, optim)))


def test_another_dtype_is_cast_with_a_warning_naming_the_tensors(tmp_path, monkeypatch):
    """DCP casts on load, as SMP's loads do (a bf16 model for inference from a float32
    checkpoint); the values loaded then differ from those saved, which the log says."""
    saved = {"w": torch.tensor([1.0001, 2.5, -3.7]), "n": torch.tensor([7.9])}
    save(saved, checkpoint_id=tmp_path / "c")
    warned: list[str] = []
    monkeypatch.setattr(
        "torch_sagemaker.checkpoint.state_dict_loader.get_logger",
        lambda: SimpleNamespace(warning=warned.append),
    )
    other = {"w": torch.zeros(3, dtype=torch.bfloat16), "n": torch.zeros(1, dtype=torch.int64)}
    load(other, checkpoint_id=tmp_path / "c")
    assert len(warned) == 1, warned
    assert "n (torch.float32 -> torch.int64)" in warned[0]
    assert "w (torch.float32 -> torch.bfloat16)" in warned[0]
    assert torch.equal(other["w"], saved["w"].to(torch.bfloat16)) and int(other["n"]) == 7
    same = {"w": torch.zeros(3), "n": torch.zeros(1)}
    load(same, checkpoint_id=tmp_path / "c")
    assert len(warned) == 1 and all(torch.equal(same[k], saved[k]) for k in saved)


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter

    class Failing(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError("disk full")

    save(_state(1.0), checkpoint_id=tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"rank 0: OSError: disk full.*unchanged"):
        save(_state(2.0), checkpoint_id=tmp_path / "c", storage_writer=Failing("unused"))
    got = _template()
    load(got, checkpoint_id=tmp_path / "c")
    assert got["step"] == 10
    save(_state(3.0), checkpoint_id=tmp_path / "c")  # overwrite works and cleans up
    got = _template()
    load(got, checkpoint_id=tmp_path / "c")
    assert got["step"] == 30 and not (tmp_path / ".c.partial").exists()


@pytest.mark.parametrize("fails", ["the rename", "the rename and its undoing", "the sync"])
def test_a_commit_failing_after_the_previous_checkpoint_moved_aside(tmp_path, monkeypatch, fails):
    """Note [Checkpoint commit protocol], steps 2-3: the previous checkpoint was renamed to
    ``.c.replaced`` when the rename of the new one fails. Before, it was left there (and
    the error said the previous checkpoint was unchanged); a failed directory sync after
    both renames failed a save that was committed."""
    from torch_sagemaker.checkpoint import atomic_dir

    save(_state(1.0), checkpoint_id=tmp_path / "c")
    real_replace, real_fsync, calls = os.replace, atomic_dir._fsync, []

    def replace(src, dst):
        calls.append(src)
        if fails == "the sync":
            return real_replace(src, dst)
        if len(calls) == 2 or (len(calls) == 3 and fails == "the rename and its undoing"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    def fsync(path):
        if os.path.isdir(path) and fails == "the sync":
            raise OSError(5, "Input/output error")
        return real_fsync(path)

    monkeypatch.setattr(atomic_dir.os, "replace", replace)
    monkeypatch.setattr(atomic_dir, "_fsync", fsync)
    got = _template()
    if fails == "the sync":
        save(_state(2.0), checkpoint_id=tmp_path / "c")  # committed: not an error
        load(got, checkpoint_id=tmp_path / "c")
        assert got["step"] == 20
        assert is_complete(tmp_path / ".c.replaced")  # kept: the rename may not be durable
        monkeypatch.undo()
        save(_state(3.0), checkpoint_id=tmp_path / "c")  # which the next save removes
        assert not (tmp_path / ".c.replaced").exists()
        return
    with pytest.raises(OSError, match="No space left"):
        save(_state(2.0), checkpoint_id=tmp_path / "c")
    monkeypatch.undo()
    if fails == "the rename":
        load(got, checkpoint_id=tmp_path / "c")  # the previous checkpoint, where it was
        assert got["step"] == 10 and not (tmp_path / ".c.replaced").exists()
    else:  # it stays complete aside, and a load says where
        assert is_complete(tmp_path / ".c.replaced")
        with pytest.raises(CheckpointError, match=r"\.c\.replaced"):
            load(got, checkpoint_id=tmp_path / "c")
    save(_state(3.0), checkpoint_id=tmp_path / "c")  # the next save commits as usual
    load(got, checkpoint_id=tmp_path / "c")
    assert got["step"] == 30


def test_a_save_replaces_only_a_checkpoint(tmp_path):
    """Note [Saves replace only checkpoints]: a commit replaces the directory at its path."""
    out = tmp_path / "job"
    (out / "tensorboard").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds config.json, tensorboard.*not a checkpoint"):
        save(_state(1.0), checkpoint_id=out)
    assert sorted(os.listdir(out)) == ["config.json", "tensorboard"]
    assert not (tmp_path / ".job.partial").exists() or not os.listdir(tmp_path / ".job.partial")
    # The directory holding checkpoints, passed instead of one of them.
    save(_state(1.0), checkpoint_id=out / "step1")
    with pytest.raises(CheckpointError, match="step1"):
        save(_state(2.0), checkpoint_id=out)
    assert is_complete(out / "step1")
    # An empty directory, and an earlier checkpoint of the same name, are replaced.
    (tmp_path / "empty").mkdir()
    save(_state(2.0), checkpoint_id=tmp_path / "empty")
    save(_state(3.0), checkpoint_id=out / "step1")
    got = _template()
    load(got, checkpoint_id=out / "step1")
    assert got["step"] == 30
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="a file is there"):
        save(_state(1.0), checkpoint_id=tmp_path / "file")


def test_async_save_snapshots_state_and_reports_errors(tmp_path):
    queue = AsyncCallsQueue()
    state = _state()
    gate = threading.Event()
    from torch.distributed.checkpoint import FileSystemWriter

    class Gated(FileSystemWriter):
        def write_data(self, plan, planner):
            assert gate.wait(30)
            return super().write_data(plan, planner)

    index = async_save(state, checkpoint_id=tmp_path / "a", queue=queue, storage_writer=Gated("x"))
    state["model"]["w"].add_(100.0)  # after the call: must not reach the checkpoint
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert not (tmp_path / "a").exists()
    gate.set()
    assert queue.maybe_finalize_async_calls(blocking=True) == [index]
    got = _template()
    load(got, checkpoint_id=tmp_path / "a")
    assert torch.equal(got["model"]["w"], _state()["model"]["w"])

    class Failing(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError("bucket gone")

    async_save(_state(), checkpoint_id=tmp_path / "b", queue=queue, storage_writer=Failing("x"))
    with pytest.raises(CheckpointError, match="bucket gone"):
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()


def test_sm_local_state_dict_round_trip(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        sd = model.state_dict()
        assert sd.layout["world_size"] == 1
        save({"model": sd}, checkpoint_id=tmp_path / "l")
    other = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    with sm_state_dict_type(other, SMStateDictType.SM_LOCAL_STATE_DICT):
        template = {"model": other.state_dict()}
        load(template, checkpoint_id=tmp_path / "l")
        other.load_state_dict(template["model"])
    assert torch.equal(other[0].weight, model[0].weight)
    assert "state_dict" not in other.__dict__  # the override is gone after the block
    with (
        pytest.raises(ValueError, match="shape mismatches"),
        sm_state_dict_type(other, SMStateDictType.SM_LOCAL_STATE_DICT),
    ):
        other.load_state_dict({**template["model"], "0.weight": torch.zeros(2, 2)})


def test_sm_local_state_dict_from_another_shard_is_refused():
    # Equal shapes, another shard: loading it would be silently wrong.
    model = nn.Sequential(nn.Linear(4, 3))
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        sd = model.state_dict()
        model.load_state_dict(sd)  # its own layout loads
        sd.layout = {**sd.layout, "fsdp_rank": 1, "tensor_parallel_degree": 2}
        with pytest.raises(ValueError, match="tensor_parallel_degree=2/None, fsdp_rank=1/0"):
            model.load_state_dict(sd)
        model.load_state_dict(dict(sd))  # a plain dict has no layout to check


def test_init_optim_state_creates_zero_state_without_moving_params():
    model = nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    init_optim_state(optim)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(optim.state) == 2 and all(p.grad is None for p in model.parameters())
    assert all(float(s["exp_avg"].abs().sum()) == 0.0 for s in optim.state.values())
    assert optim.param_groups[0]["lr"] == 0.1


def test_limit_num_subdirs_keeps_newest_by_number(tmp_path):
    for n in (1, 2, 10, 11, 12):
        (tmp_path / f"llama-{n}steps").mkdir()
    (tmp_path / ".llama-1steps.partial").mkdir()
    (tmp_path / "notes").mkdir()
    # A rank passing log=False (every rank but 0 in SMP's scripts) leaves everything alone.
    assert limit_num_subdirs(tmp_path, 2, regex=r"^.*\d+steps$", log=False) == []
    assert len(os.listdir(tmp_path)) == 7
    deleted = limit_num_subdirs(tmp_path, 2, regex=r"^.*\d+steps$")
    assert sorted(os.path.basename(d) for d in deleted) == [
        "llama-10steps",
        "llama-1steps",
        "llama-2steps",
    ]
    assert sorted(os.listdir(tmp_path)) == ["llama-11steps", "llama-12steps", "notes"]
    assert limit_num_subdirs(tmp_path, None) == []
    with pytest.raises(ValueError, match="num_kept=-1"):
        limit_num_subdirs(tmp_path, -1)


@pytest.mark.parametrize("inside", ["", "tp2-0", "tp0_ep0_fsdp1"])
def test_limit_num_subdirs_as_smp_scripts_call_it(tmp_path, inside):
    """The scripts pass the new checkpoint's folder (or a per-rank subfolder), not the root."""
    root = tmp_path / "ckpts"
    for n in (4, 8, 12):
        (root / f"llama_v2-{n}steps" / "tp2-0").mkdir(parents=True)
    newest = os.path.abspath(os.path.join(root, "llama_v2-12steps", inside))
    sort_fn = SORT_BY_LAST_INT
    limit_num_subdirs(newest, 1, sort_fn=sort_fn, regex=r"^.*\d+steps$", log=False)
    assert len(os.listdir(root)) == 3
    limit_num_subdirs(newest, 1, sort_fn=sort_fn, regex=r"^.*\d+steps$", log=True)
    assert os.listdir(root) == ["llama_v2-12steps"]
    assert os.listdir(root / "llama_v2-12steps") == ["tp2-0"]  # the kept one is untouched


@pytest.mark.parametrize("inside", ["", "tp2-1", "tp1_ep0_fsdp0"])
def test_limit_num_subdirs_before_an_async_save_counts_the_new_checkpoint(tmp_path, inside):
    """The async types call it before writing: the new folder does not exist yet, and after
    the save ``num_kept`` checkpoints remain (the new one and the newest ``num_kept - 1``)."""
    root = tmp_path / "ckpts"
    for n in (2, 4):
        (root / f"llama_v2-{n}steps" / "tp2-1").mkdir(parents=True)
    upcoming = os.path.join(root, "llama_v2-6steps", inside)
    deleted = limit_num_subdirs(upcoming, 2, regex=r"^.*\d+steps$", log=True)
    assert deleted == [str(root / "llama_v2-2steps")]
    assert sorted(os.listdir(root)) == ["llama_v2-4steps"]
    os.makedirs(upcoming)  # the save
    assert sorted(os.listdir(root)) == ["llama_v2-4steps", "llama_v2-6steps"]


def test_limit_num_subdirs_before_an_async_save_keeps_the_newest_complete_one(tmp_path):
    """num_kept=1 before the new checkpoint exists: deleting the only complete one would leave
    nothing to resume from if the save failed, so it goes at the next call instead."""
    root = tmp_path / "ckpts"
    for n in (2, 4):
        (root / f"llama_v2-{n}steps").mkdir(parents=True)
        (root / f"llama_v2-{n}steps" / COMPLETION_MARKER).touch()
    assert limit_num_subdirs(root / "llama_v2-6steps", 1, regex=r"^.*\d+steps$") == [
        str(root / "llama_v2-2steps")
    ]
    assert os.listdir(root) == ["llama_v2-4steps"]
    (root / "llama_v2-6steps").mkdir()
    (root / "llama_v2-6steps" / COMPLETION_MARKER).touch()
    assert limit_num_subdirs(root / "llama_v2-8steps", 1, regex=r"^.*\d+steps$") == [
        str(root / "llama_v2-4steps")
    ]
    assert os.listdir(root) == ["llama_v2-6steps"]


def test_limit_num_subdirs_without_regex_counts_every_subdir_of_path(tmp_path):
    for name in ("a1", "b2", "c3"):
        (tmp_path / name).mkdir()
    limit_num_subdirs(tmp_path, 1)
    assert os.listdir(tmp_path) == ["c3"]


def test_bucket_only_s3_and_missing_ids_are_rejected(tmp_path):
    # S3 checkpoints work (tests/distributed/test_checkpoint_s3.py); a bare bucket has no
    # prefix to put a checkpoint under.
    with pytest.raises(ValueError, match="is a bucket; a checkpoint needs a key prefix"):
        save(_state(), checkpoint_id="s3://bucket", s3_region="us-east-1")
    with pytest.raises(ValueError, match="checkpoint_id is required"):
        save(_state())


def test_the_hf_export_names_the_model_class_under_wrappers():
    """config.json's ``architectures`` is the Hugging Face class, not a wrapper passing
    ``config`` through (activation checkpointing, torch.compile; FSDP1 the same way)."""
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from torch_sagemaker.checkpoint.hf_export import _model_class_name

    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2,
        )
    )  # fmt: skip
    wrapped = checkpoint_wrapper(model)
    assert wrapped.config is model.config  # the attribute passes through the wrapper
    for m in (model, wrapped, torch.compile(model), torch.compile(wrapped)):
        assert _model_class_name(m) == "LlamaForCausalLM", type(m)


def test_a_data_position_that_would_not_load_back_equal_is_refused(tmp_path):
    from torch_sagemaker.checkpoint import TrainingState

    model = nn.Linear(2, 2)
    for bad in ({1: 5}, {"order": (1, 2)}, {"seen": {3}}):
        with pytest.raises(ValueError, match="data_position="):
            TrainingState(model, data_position=bad, save_rng=False).save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    good = {"samples": 5, "order": [1, 2], "by_rank": {"0": 3}}
    TrainingState(model, data_position=good, save_rng=False).save(tmp_path / "c")
    loaded = TrainingState(model, save_rng=False)
    loaded.load(tmp_path / "c")
    assert loaded.data_position == good


def test_loading_as_another_kind_names_the_kind_it_was_saved_as(tmp_path):
    """A complete checkpoint of one kind, loaded as another, is not called incomplete."""
    from torch_sagemaker.checkpoint import TrainingState
    from torch_sagemaker.checkpoint.atomic_dir import read_marker

    model = nn.Linear(2, 2)
    TrainingState(model, save_rng=False).save(tmp_path / "local", kind="local")
    TrainingState(model, save_rng=False).save(tmp_path / "sharded")
    with pytest.raises(CheckpointError, match="holds an SM-local checkpoint.*kind='local'"):
        TrainingState(model, save_rng=False).load(tmp_path / "local")
    with pytest.raises(CheckpointError, match=r"is itself a complete checkpoint.*kind='sharded'"):
        TrainingState(model, save_rng=False).load(tmp_path / "sharded", kind="local")
    for r in range(2):  # what FSDP1 with tensor parallelism writes
        (tmp_path / "parts" / f"tp2-{r}").mkdir(parents=True)
        (tmp_path / "parts" / f"tp2-{r}" / COMPLETION_MARKER).touch()
    with pytest.raises(CheckpointError, match=r"per-rank parts \(tp2-<r>\).*under FSDP1"):
        read_marker(tmp_path / "parts")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").touch()
    with pytest.raises(CheckpointError, match="is incomplete"):
        read_marker(tmp_path / "half")


def test_a_per_rank_part_looked_for_inside_a_whole_checkpoint_is_explained(tmp_path):
    """FSDP1 with tensor parallelism loads ``<checkpoint>/tp2-<r>``; inside an FSDP2 (whole
    model) checkpoint it was told that tp2-0 is an SM-local directory and to use
    kind='sharded', the kind it had used."""
    save(_state(), checkpoint_id=tmp_path / "c")
    with pytest.raises(CheckpointError) as e:
        load(_template(), checkpoint_id=tmp_path / "c" / "tp2-0")
    message = str(e.value)
    assert "of the whole model, not one saved in per-rank parts" in message, message
    assert "tp2-0 is the part an FSDP1 model with tensor or expert parallelism reads" in message
    assert "FSDP2 (torch_sagemaker.sharding.shard_model)" in message
    assert "SM-local" not in message and "kind='sharded'" not in message
    with pytest.raises(CheckpointError, match=r"shard directory an SM-local load.*'sharded'"):
        load(_template(), checkpoint_id=tmp_path / "c" / "tp0_ep0_fsdp0")


@pytest.fixture
def hf_export(tmp_path):
    """A Hugging Face export of a tiny model (its marker's kind: ``hugging_face``)."""
    import transformers

    from torch_sagemaker.checkpoint import save_hf_checkpoint

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    save_hf_checkpoint(transformers.GPT2LMHeadModel(config), tmp_path / "hf")
    return tmp_path / "hf"


def test_loading_a_hugging_face_export_names_its_kind_not_corruption(hf_export):
    from torch_sagemaker.checkpoint import TrainingState, read_metadata

    expected = r"is a Hugging Face export .*kind is 'hugging_face'.*from_pretrained"
    with pytest.raises(CheckpointError, match=expected) as e:
        load(_template(), checkpoint_id=hf_export)
    assert "corrupt" not in str(e.value)
    with pytest.raises(CheckpointError, match=expected):
        read_metadata(hf_export)
    with pytest.raises(CheckpointError, match=expected):
        TrainingState(nn.Linear(2, 2), save_rng=False).load(hf_export)
    # Inside it, as FSDP1 with TP or an SM-local load look: the export is named too.
    with pytest.raises(CheckpointError, match=r"hf is a Hugging Face export"):
        TrainingState(nn.Linear(2, 2), save_rng=False).load(hf_export, kind="local")


@pytest.mark.parametrize(
    ("kind", "hint"),
    [("full", "save_hf_checkpoint"), ("sm_local", "pass kind='local'"), ("SHARDED", "")],
)
def test_an_unknown_training_state_kind_is_refused_first_by_name(tmp_path, kind, hint):
    """Every method checks the kind before anything depends on it (a multi-rank job without
    tsm.init was told that kind='local' needs it: tests/distributed)."""
    from torch_sagemaker.checkpoint import TrainingState

    state = TrainingState(nn.Linear(2, 2), save_rng=False)
    for call in (
        lambda: state.save(tmp_path / "s", kind=kind, num_kept=2),
        lambda: state.load(tmp_path / "s", kind=kind),
        lambda: state.state_dict(kind),
        lambda: state.load_state_dict({}, kind),
    ):
        with pytest.raises(ValueError, match=rf"kind={kind!r}\): kind must be one of") as e:
            call()
        assert "'sharded' (the default" in str(e.value) and hint in str(e.value)
    assert not (tmp_path / "s").exists()


def test_num_kept_with_the_local_kind_is_refused_not_ignored(tmp_path):
    from torch_sagemaker.checkpoint import TrainingState

    with pytest.raises(ValueError, match=r"kind='local', num_kept=2.*limit_num_subdirs"):
        TrainingState(nn.Linear(2, 2), save_rng=False).save(
            tmp_path / "s", kind="local", num_kept=2
        )
    assert not (tmp_path / "s").exists()
