"""The parts of one checkpoint come from one save (Note [The parts of one checkpoint come
from one save] in ``completeness``): per-TP/EP-rank parts and SM-local shard directories,
each committed by its own group, carry the whole save's id and part count in their markers.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torch_sagemaker.checkpoint import CheckpointError, TrainingState, is_complete, save
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER


def _part(path, value: float, whole_id: str | None, num_parts: int | None = 2) -> None:
    """One part as a group of ``TrainingState.save`` commits it (``None``: an older marker)."""
    info = None if whole_id is None else {"whole_save_id": whole_id, "num_parts": num_parts}
    save({"w": torch.full((4,), value), "step": 1}, checkpoint_id=path, marker_info=info)


def test_parts_of_one_save_are_complete_and_of_two_saves_are_not(tmp_path):
    """Before, a step whose tp2-1 still held an older save's part was complete ("latest")."""
    _part(tmp_path / "one" / "tp2-0", 1.0, "a" * 32)
    _part(tmp_path / "one" / "tp2-1", 1.0, "a" * 32)
    assert is_complete(tmp_path / "one")

    _part(tmp_path / "two" / "tp2-0", 2.0, "b" * 32)  # the new save's part
    _part(tmp_path / "two" / "tp2-1", 1.0, "a" * 32)  # the old save's: its group died
    assert not is_complete(tmp_path / "two")

    _part(tmp_path / "old" / "tp2-0", 1.0, None)  # written before whole-save ids: as before
    _part(tmp_path / "old" / "tp2-1", 1.0, None)
    assert is_complete(tmp_path / "old")
    _part(tmp_path / "mixed" / "tp2-0", 2.0, "b" * 32)  # an old part beside a new one
    _part(tmp_path / "mixed" / "tp2-1", 1.0, None)
    assert not is_complete(tmp_path / "mixed")


def test_sm_local_shards_are_counted_against_their_save(tmp_path):
    """Before, an SM-local step counted as complete with any number of its shards."""
    _part(tmp_path / "s" / "tp0_ep0_fsdp0", 1.0, "c" * 32, num_parts=2)
    assert not is_complete(tmp_path / "s")
    _part(tmp_path / "s" / "tp0_ep0_fsdp1", 1.0, "c" * 32, num_parts=2)
    assert is_complete(tmp_path / "s")


def test_parts_beside_a_whole_checkpoint_are_refused(tmp_path):
    """Parts saved into a committed whole checkpoint's directory left both, and either
    kind of load could read the stale one."""
    state = TrainingState(nn.Linear(2, 2), save_rng=False)
    state.save(tmp_path / "c")
    assert is_complete(tmp_path / "c")
    _part(tmp_path / "c" / "tp2-0", 1.0, "d" * 32)
    _part(tmp_path / "c" / "tp2-1", 1.0, "d" * 32)
    assert not is_complete(tmp_path / "c")
    with pytest.raises(CheckpointError) as e:
        state.load(tmp_path / "c")
    message = str(e.value)
    assert "holds both a complete checkpoint of the whole model and per-rank parts" in message
    assert "['tp2-0', 'tp2-1']" in message and "save it again" in message


def test_training_state_records_one_id_and_refuses_shards_of_two_saves(tmp_path):
    state = TrainingState(nn.Linear(2, 2), save_rng=False)
    state.save(tmp_path / "s", kind="local")
    marker = json.loads((tmp_path / "s" / "tp0_ep0_fsdp0" / COMPLETION_MARKER).read_text())
    assert len(marker["whole_save_id"]) == 32 and marker["num_parts"] == 1
    state.load(tmp_path / "s", kind="local")
    # Another shard directory, of another save, beside it: the step is not one checkpoint.
    _part(tmp_path / "s" / "tp0_ep0_fsdp1", 1.0, "e" * 32, num_parts=2)
    assert not is_complete(tmp_path / "s")
    with pytest.raises(CheckpointError, match=r"holds parts written by different saves .*"):
        state.load(tmp_path / "s", kind="local")
