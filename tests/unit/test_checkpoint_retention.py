"""What retention never deletes (Note [What retention keeps] in ``retention``).

Checkpoints here are directories with or without a completion marker that names only the
kind the saver writes (``is_complete`` looks at nothing but the marker's existence,
retention at its kind too: Note [Retention deletes only training checkpoints]); per-rank
parts (``tp{d}-{r}``) are what ``TrainingState`` writes for FSDP1 with tensor parallelism,
and ``tp{r}_ep{r}_fsdp{r}`` what SM-local saves write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torch_sagemaker.checkpoint import checkpoint_location, is_complete
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER
from torch_sagemaker.checkpoint.retention import prune_beside
from torch_sagemaker.checkpoint.utils import limit_num_subdirs

STEPS = r"^.*\d+steps$"


def _mark(path: Path, kind: str) -> None:
    (path / COMPLETION_MARKER).write_text(json.dumps({"kind": kind, "files": {}}))


def _checkpoint(
    root: Path,
    name: str,
    parts: tuple[str, ...] = (),
    complete: bool = True,
    kind: str = "sharded",
) -> Path:
    """A checkpoint directory; with ``parts``, one committed directory per part instead."""
    path = root / name
    path.mkdir(parents=True)
    for part in parts:
        (path / part).mkdir()
        _mark(path / part, "sm_local" if "_fsdp" in part else "sharded")
    if complete and not parts:
        _mark(path, kind)
    return path


def test_an_unfinished_checkpoint_of_a_later_step_does_not_cost_the_one_just_saved(tmp_path):
    """A crashed run left step 300 unfinished; the resumed run saves 200, then 250."""
    _checkpoint(tmp_path, "llama-300steps", complete=False)
    _checkpoint(tmp_path, "llama-200steps")
    new = _checkpoint(tmp_path, "llama-250steps")
    deleted = prune_beside(checkpoint_location(new), 1, regex=STEPS)
    assert deleted == [str(tmp_path / "llama-200steps")]
    assert sorted(os.listdir(tmp_path)) == ["llama-250steps", "llama-300steps"]
    # SMP's scripts' own call (the new checkpoint's folder, regex) keeps it too.
    _checkpoint(tmp_path, "llama-260steps")
    limit_num_subdirs(tmp_path / "llama-260steps", 1, regex=STEPS)
    assert sorted(os.listdir(tmp_path)) == ["llama-260steps", "llama-300steps"]


def test_a_run_rolled_back_keeps_its_new_checkpoint_and_the_newest_complete_one(tmp_path):
    _checkpoint(tmp_path, "llama-400steps")
    _checkpoint(tmp_path, "llama-200steps")
    new = _checkpoint(tmp_path, "llama-250steps")
    prune_beside(checkpoint_location(new), 1, regex=STEPS)
    assert sorted(os.listdir(tmp_path)) == ["llama-250steps", "llama-400steps"]


def test_per_rank_parts_not_all_committed_keep_the_previous_checkpoint(tmp_path):
    """FSDP1 + TP: each TP rank's group commits its own part; the group that prunes may
    finish first, or another part's save may fail."""
    _checkpoint(tmp_path, "llama-200steps", parts=("tp2-0", "tp2-1"))
    new = _checkpoint(tmp_path, "llama-300steps", parts=("tp2-0",))
    assert not is_complete(new) and is_complete(tmp_path / "llama-200steps")
    assert prune_beside(checkpoint_location(new), 1, regex=STEPS) == []
    (new / "tp2-1").mkdir()
    assert not is_complete(new)  # the part's directory exists, its commit has not happened
    _mark(new / "tp2-1", "sharded")
    assert is_complete(new)
    assert prune_beside(checkpoint_location(new), 1, regex=STEPS) == [
        str(tmp_path / "llama-200steps")
    ]


def test_parts_of_two_degrees_are_not_one_checkpoint(tmp_path):
    path = _checkpoint(tmp_path, "llama-100steps", parts=("tp2-0", "tp2-1", "tp4-0"))
    assert not is_complete(path)


def test_an_sm_local_checkpoint_counts_when_its_shards_are_committed(tmp_path):
    """Before an async SM-local save (num_kept=1) the newest complete one stays."""
    _checkpoint(tmp_path, "llama-2steps", parts=("tp0_ep0_fsdp0", "tp0_ep0_fsdp1"))
    _checkpoint(tmp_path, "llama-4steps", parts=("tp0_ep0_fsdp0", "tp0_ep0_fsdp1"))
    assert is_complete(tmp_path / "llama-4steps")
    limit_num_subdirs(tmp_path / "llama-6steps" / "tp0_ep0_fsdp1", 1, regex=STEPS)
    assert os.listdir(tmp_path) == ["llama-4steps"]


def test_the_examples_latest_finds_a_checkpoint_in_per_rank_parts(tmp_path, monkeypatch):
    """``--resume_from_checkpoint latest`` with FSDP1 + TP: the step directory has no marker
    of its own, only its parts do."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from train_lib.checkpoints import step_dirs

    _checkpoint(tmp_path, "llama-5steps", parts=("tp2-0", "tp2-1"))
    _checkpoint(tmp_path, "llama-7steps", parts=("tp2-0",))  # a part's save failed
    assert step_dirs(str(tmp_path)) == [(5, str(tmp_path / "llama-5steps"))]


def test_folders_that_are_not_checkpoints_are_neither_deleted_nor_counted(tmp_path):
    """No regex: a run's other output beside its checkpoints stays, and costs no place."""
    for other in ("tensorboard", "hf_export"):
        (tmp_path / other).mkdir()
        (tmp_path / other / "events.log").write_text("kept")
    _checkpoint(tmp_path, "step1")
    _checkpoint(tmp_path, "step2")
    new = _checkpoint(tmp_path, "step3")
    assert prune_beside(checkpoint_location(new), 2) == [str(tmp_path / "step1")]
    assert sorted(os.listdir(tmp_path)) == ["hf_export", "step2", "step3", "tensorboard"]
    assert (tmp_path / "tensorboard" / "events.log").read_text() == "kept"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_hugging_face_export_beside_the_checkpoints_is_never_deleted(tmp_path):
    """Note [Retention deletes only training checkpoints]: ``save_hf_checkpoint`` commits its
    export with a completion marker too, and ``hf_export`` (no number) would sort oldest."""
    import transformers

    from torch_sagemaker.checkpoint import TrainingState, save_hf_checkpoint

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    save_hf_checkpoint(model, tmp_path / "hf_export")
    state = TrainingState(model, save_rng=False)
    for step in (100, 200, 300):
        state.step = step
        state.save(tmp_path / f"llama-{step}steps", num_kept=2)  # no regex: every sibling
    assert sorted(os.listdir(tmp_path)) == ["hf_export", "llama-200steps", "llama-300steps"]
    # SMP's function too, even where its regex matches the export's name; a checkpoint
    # whose marker names no kind is not deleted by TrainingState.save (when unsure, keep).
    _checkpoint(tmp_path, "hf-400steps", kind="hugging_face")
    (tmp_path / "llama-50steps").mkdir()
    (tmp_path / "llama-50steps" / COMPLETION_MARKER).touch()
    assert limit_num_subdirs(tmp_path / "llama-500steps", 1, regex=STEPS) == [
        str(tmp_path / "llama-50steps"),
        str(tmp_path / "llama-200steps"),
    ]
    assert sorted(os.listdir(tmp_path)) == ["hf-400steps", "hf_export", "llama-300steps"]
    (tmp_path / "llama-50steps").mkdir()
    (tmp_path / "llama-50steps" / COMPLETION_MARKER).touch()
    state.step = 600
    state.save(tmp_path / "llama-600steps", num_kept=1)
    assert sorted(os.listdir(tmp_path)) == [
        "hf-400steps",
        "hf_export",
        "llama-50steps",
        "llama-600steps",
    ]
    assert (tmp_path / "hf_export" / "model.safetensors").is_file()


def test_an_unfinished_later_step_takes_none_of_the_places_kept(tmp_path):
    """num_kept=2 leaves two complete checkpoints to resume from, whatever a crash left."""
    _checkpoint(tmp_path, "llama-300steps", complete=False)
    _checkpoint(tmp_path, "llama-200steps")
    _checkpoint(tmp_path, "llama-210steps")
    new = _checkpoint(tmp_path, "llama-220steps")
    assert prune_beside(checkpoint_location(new), 2, regex=STEPS) == [
        str(tmp_path / "llama-200steps")
    ]
    assert sorted(os.listdir(tmp_path)) == ["llama-210steps", "llama-220steps", "llama-300steps"]


def test_a_deletion_cut_short_leaves_no_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    import shutil

    from torch_sagemaker.checkpoint.completeness import is_complete_checkpoint

    whole = _checkpoint(tmp_path, "llama-100steps")
    parts = _checkpoint(tmp_path, "llama-200steps", parts=("tp2-0", "tp2-1"))
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # the deletion stops here
    for path in (whole, parts):
        location = checkpoint_location(path)
        assert is_complete_checkpoint(location)
        location.remove()
        assert path.is_dir() and not is_complete_checkpoint(location)
