"""A second save of the same checkpoint while one runs: the commit certifies only its own files.

Every save of ``<name>`` stages in ``.<name>.partial``. A second job (or a save begun before
the last one finished) that starts there meanwhile removes and rewrites that directory. Each
case below plays the second save's part at a chosen moment of the first one's, in one
process: a save that lost or changed files refuses to commit (Note [Commit what was
written] in ``integrity``) and the previous checkpoint is still what loads; a file it did
not write is committed with a warning.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from torch_sagemaker.checkpoint import CheckpointError, integrity, load, save
from torch_sagemaker.checkpoint.atomic_dir import prepare_staging, staging_path

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _other_saves_shards(tmp_path: Path) -> Path:
    """Shard files of another save of the checkpoint: other values, another size."""
    out = tmp_path / "other"
    dcp.save(
        {"w": torch.full((1000,), 2.0), "extra": torch.ones(500)},
        storage_writer=FileSystemWriter(out),
        no_dist=True,
    )
    return out


def _run_during_finish(monkeypatch, checkpoint: Path, before, after=None) -> None:
    """Runs ``before``/``after`` around DCP's ``.metadata`` write of saves into ``checkpoint``."""
    finish = FileSystemWriter.finish

    def finish_with_another_save(self, metadata, results):
        mine = Path(self.path) == staging_path(checkpoint)
        if mine and before is not None:
            before()
        out = finish(self, metadata, results)
        if mine and after is not None:
            after()
        return out

    monkeypatch.setattr(FileSystemWriter, "finish", finish_with_another_save)


def _previous_checkpoint(checkpoint: Path) -> None:
    save({"w": torch.full((1000,), 1.0)}, checkpoint_id=checkpoint)


def _loads_previous(checkpoint: Path) -> None:
    got = {"w": torch.zeros(1000)}
    load(got, checkpoint_id=checkpoint)
    assert torch.equal(got["w"], torch.full((1000,), 1.0))


@pytest.mark.parametrize("checksums", [True, False])
def test_shards_replaced_by_another_save_are_not_committed(tmp_path, monkeypatch, checksums):
    """The other save restarts the staging directory after this one's ranks wrote their shards
    and writes its own shard of another size before this save's ``.metadata`` is written."""
    checkpoint = tmp_path / "step300"
    _previous_checkpoint(checkpoint)
    other = _other_saves_shards(tmp_path)

    def other_save_starts():
        prepare_staging(checkpoint)
        for name in os.listdir(other):
            if name.endswith(".distcp"):
                shutil.copy(other / name, staging_path(checkpoint) / name)

    _run_during_finish(monkeypatch, checkpoint, before=other_save_starts)
    from torch_sagemaker.checkpoint import checkpoint_location

    location = checkpoint_location(checkpoint, checksums=checksums)
    with pytest.raises(
        CheckpointError,
        match=r"was not committed: .* no longer holds what this "
        r"save wrote \(__0_0\.distcp: \d+ bytes where this save wrote \d+\)",
    ):
        save({"w": torch.full((1000,), 3.0)}, checkpoint_id=location)
    monkeypatch.undo()
    _loads_previous(checkpoint)


def test_metadata_removed_by_another_save_is_not_committed(tmp_path, monkeypatch):
    """The other save restarts the staging directory after this save's ``.metadata``."""
    checkpoint = tmp_path / "step300"
    _previous_checkpoint(checkpoint)
    _run_during_finish(
        monkeypatch, checkpoint, before=None, after=lambda: prepare_staging(checkpoint)
    )
    with pytest.raises(CheckpointError, match=r"\.metadata: written by this save, now missing"):
        save({"w": torch.full((1000,), 3.0)}, checkpoint_id=checkpoint)
    monkeypatch.undo()
    _loads_previous(checkpoint)


def test_a_file_the_save_did_not_write_is_committed_with_a_warning(tmp_path, monkeypatch):
    """A post-write hook's side file, or another save's extra shard: DCP's metadata does not
    read it, so the checkpoint is still the one this save wrote."""
    checkpoint = tmp_path / "step300"
    _previous_checkpoint(checkpoint)

    def add_file():
        (staging_path(checkpoint) / "user_content.json").write_text("{}")

    _run_during_finish(monkeypatch, checkpoint, before=add_file)
    warned = []
    monkeypatch.setattr(
        "torch_sagemaker.checkpoint.atomic_dir.get_logger",
        lambda: SimpleNamespace(warning=warned.append),
    )
    save({"w": torch.full((1000,), 3.0)}, checkpoint_id=checkpoint)
    monkeypatch.undo()
    assert len(warned) == 1 and "['user_content.json']" in warned[0]
    got = {"w": torch.zeros(1000)}
    load(got, checkpoint_id=checkpoint)
    assert torch.equal(got["w"], torch.full((1000,), 3.0))


def test_not_as_written_lists_every_difference():
    written = {"a": (3, "x"), "b": (5, None), "c": (-1, None), "gone": (1, None)}
    found = {"a": 3, "b": 6, "c": 9, "new": 2}
    assert integrity.not_as_written(found, written) == (
        [
            "gone: written by this save, now missing",
            "b: 6 bytes where this save wrote 5",  # "c": its size was not followed
        ],
        ["new"],
    )
    assert integrity.not_as_written({"a": 3}, {"a": (3, "x")}) == ([], [])
    assert integrity.merge([{"a": (3, "x")}, None]) is None  # a rank's files not followed


def test_a_save_committed_during_a_load_fails_the_load(monkeypatch, tmp_path):
    # Note [A save that replaces a checkpoint being loaded]: the second save commits after
    # the load checked the first one's files and before it read them. Its values (3.0) have
    # the first's sizes, so without the check the load returns them with no error.
    checkpoint = tmp_path / "ckpt"
    _previous_checkpoint(checkpoint)
    from torch_sagemaker.checkpoint import state_dict_loader

    real_load = state_dict_loader.dcp.load

    def load_after_another_save(*args, **kwargs):
        save({"w": torch.full((1000,), 3.0)}, checkpoint_id=checkpoint)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(state_dict_loader.dcp, "load", load_after_another_save)
    state = {"w": torch.zeros(1000)}
    with pytest.raises(CheckpointError, match="another save committed over this checkpoint"):
        load(state, checkpoint_id=checkpoint)
    monkeypatch.setattr(state_dict_loader.dcp, "load", real_load)
    load(state, checkpoint_id=checkpoint)  # loading again reads the new save whole
    assert torch.equal(state["w"], torch.full((1000,), 3.0))


def _save_step(checkpoint: Path, value: float) -> None:
    """A checkpoint of a model weight and its optimizer state, all ``value``."""
    save(
        {
            "model": {"w": torch.full((1000,), value)},
            "optimizer": {"m": torch.full((1000,), value)},
        },
        checkpoint_id=checkpoint,
    )


def test_a_save_committed_while_the_reader_reads_fails_the_read(monkeypatch, tmp_path):
    # SMP's scripts hand DistributedFileSystemReader to DCP directly. The second save commits
    # after the reader checked the first one's files and before DCP opens them by name: the
    # values read are then the second save's (same sizes), and before, nothing noticed.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    checkpoint = tmp_path / "ckpt"
    _save_step(checkpoint, 1.0)
    real_read = FileSystemReader.read_data

    def read_after_another_save(self, plan, planner):
        monkeypatch.setattr(FileSystemReader, "read_data", real_read)  # once
        _save_step(checkpoint, 3.0)
        return real_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", read_after_another_save)
    state = {"optimizer": {"m": torch.zeros(1000)}}
    with pytest.raises(CheckpointException, match="another save committed over this checkpoint"):
        dcp.load(state, storage_reader=DistributedFileSystemReader(checkpoint), no_dist=True)
    # Made before the save, checked after it: the id it began with is gone.
    reader = DistributedFileSystemReader(checkpoint)
    _save_step(checkpoint, 4.0)
    with pytest.raises(CheckpointException, match=r"another save committed.*save id \w+ before"):
        dcp.load(state, storage_reader=reader, no_dist=True)
    reader = DistributedFileSystemReader(checkpoint)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["optimizer"]["m"], torch.full((1000,), 4.0))
    # One reader may serve the model's load and then the optimizer's: a save committed in
    # between (even this job's own) is refused, with the fix, rather than mixed in.
    _save_step(checkpoint, 5.0)
    with pytest.raises(CheckpointException, match="Load it again with a new DistributedFile"):
        dcp.load(state, storage_reader=reader, no_dist=True)
    dcp.load(state, storage_reader=DistributedFileSystemReader(checkpoint), no_dist=True)
    assert torch.equal(state["optimizer"]["m"], torch.full((1000,), 5.0))


def test_training_state_reads_metadata_and_data_of_one_save(monkeypatch, tmp_path):
    # TrainingState.load decides from the metadata which keys to read (state never saved,
    # RNG states, FP8 sizes), then reads them; a save committed in between would have those
    # decisions of one save applied to the other's data.
    from torch import nn

    from torch_sagemaker.checkpoint import TrainingState, training_state

    checkpoint = tmp_path / "ckpt"
    model = nn.Linear(4, 4)
    TrainingState(model, step=1, save_rng=False).save(checkpoint)
    real_read_metadata = training_state.read_metadata

    def read_metadata_then_another_save(path):
        out = real_read_metadata(path)
        TrainingState(model, step=2, save_rng=False).save(checkpoint)
        return out

    monkeypatch.setattr(training_state, "read_metadata", read_metadata_then_another_save)
    loader = TrainingState(nn.Linear(4, 4), save_rng=False)
    with pytest.raises(CheckpointError, match="another save committed over this checkpoint"):
        loader.load(checkpoint)
    monkeypatch.setattr(training_state, "read_metadata", real_read_metadata)
    loader.load(checkpoint)
    assert loader.step == 2


def test_a_failed_load_leaves_a_fresh_optimizer_without_state(tmp_path):
    # The optimizer's template is built before the checks (it may take collectives); a
    # fresh optimizer must not keep the zero-step state it created when the load fails.
    from torch import nn

    from torch_sagemaker.checkpoint import TrainingState

    model = nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="does not exist|missing|no completion marker"):
        TrainingState(model, optimizer, save_rng=False).load(tmp_path / "nothing-here")
    assert not optimizer.state


def test_fsdp1_model_and_optimizer_are_read_from_one_save(monkeypatch, tmp_path):
    # SMP's deprecated load_model_checkpoint reads the model, then the optimizer through a
    # second reader: a save committed in between gave a model of one save and an optimizer
    # of the other, silently.
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from torch_sagemaker.checkpoint import fsdp1_checkpoint as util

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = FSDP(nn.Linear(8, 8), device_id=torch.device("cpu"), use_orig_params=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        meta = (None, 0, True)

        def step_and_save(path):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            util.save_model_checkpoint(
                model, StateDictType.SHARDED_STATE_DICT, path, None, meta, optimizer=optimizer
            )

        checkpoint = tmp_path / "ckpt"
        step_and_save(checkpoint)
        real_reader = util.DistributedFileSystemReader

        def reader_after_another_save(path):
            monkeypatch.setattr(util, "DistributedFileSystemReader", real_reader)  # once
            step_and_save(checkpoint)
            return real_reader(path)

        monkeypatch.setattr(util, "DistributedFileSystemReader", reader_after_another_save)
        with pytest.raises(CheckpointError, match="another save committed over this checkpoint"):
            util.load_model_checkpoint(
                model, StateDictType.SHARDED_STATE_DICT, checkpoint, None, meta, optimizer=optimizer
            )
        util.load_model_checkpoint(
            model, StateDictType.SHARDED_STATE_DICT, checkpoint, None, meta, optimizer=optimizer
        )
    finally:
        if owned:
            dist.destroy_process_group()
