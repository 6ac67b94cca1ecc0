"""Checkpoint checksums in one process: bytes changed or files swapped after a save are refused.

Each case changes a saved checkpoint the way disks and copies do (a flipped byte inside a
tensor, two equal-sized shard files swapped) and checks that loading names the file instead
of returning wrong values; plus where the checksums come from (recorded while writing, read
back only for writers that cannot be followed).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from torch_sagemaker.checkpoint import (
    AsyncCallsQueue,
    CheckpointError,
    SMStateDictType,
    async_save,
    integrity,
    load,
    save,
    sm_state_dict_type,
)
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER
from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _two_tensors() -> dict:
    torch.manual_seed(0)
    return {"a": torch.randn(64, 16), "b": torch.randn(64, 16)}


def _flip_byte_inside(directory, tensor: torch.Tensor):
    """Flips one bit in the middle of ``tensor``'s bytes in the shard file holding them."""
    for path in _data_files(directory):
        data = bytearray(path.read_bytes())
        at = data.find(tensor.numpy().tobytes())
        if at >= 0:
            data[at + tensor.numel() * tensor.element_size() // 2] ^= 0x10
            path.write_bytes(bytes(data))
            return path
    raise AssertionError("the tensor's bytes should be stored verbatim in a shard")


def _data_files(directory) -> list:
    return sorted(p for p in directory.iterdir() if p.suffix == ".distcp")


def test_flipped_byte_inside_a_shard_is_refused_naming_the_file(tmp_path):
    want = _two_tensors()
    save(want, checkpoint_id=tmp_path / "c")
    shard = _flip_byte_inside(tmp_path / "c", want["a"])
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    with pytest.raises(
        CheckpointError,
        match=rf"corrupt: {shard.name} does not match its crc32 "
        r"checksum .* changed after the save",
    ):
        load(got, checkpoint_id=tmp_path / "c")
    assert float(got["a"].abs().sum()) == 0.0, "nothing may be loaded from a corrupt checkpoint"


def test_swapped_shard_files_are_refused(tmp_path):
    want = _two_tensors()
    # Two writer threads: one file per tensor, of the same size.
    save(
        want,
        checkpoint_id=tmp_path / "c",
        storage_writer=DistributedFileSystemWriter("unused", thread_count=2),
    )
    first, second = _data_files(tmp_path / "c")
    assert first.stat().st_size == second.stat().st_size
    tmp = first.with_suffix(".tmp")
    os.replace(first, tmp)
    os.replace(second, first)
    os.replace(tmp, second)
    with pytest.raises(
        CheckpointError,
        match=rf"{first.name} holds the bytes written as "
        rf"{second.name} \(files swapped or renamed\)",
    ):
        load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, checkpoint_id=tmp_path / "c")


def test_garbled_metadata_is_refused(tmp_path):
    save(_two_tensors(), checkpoint_id=tmp_path / "m")
    meta = tmp_path / "m" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    with pytest.raises(CheckpointError, match=r"corrupt: \.metadata does not match"):
        load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, checkpoint_id=tmp_path / "m")


def test_checksums_are_recorded_while_writing(tmp_path, monkeypatch):
    """DCP's writers are followed: the commit reads nothing back, yet every file has its CRC."""
    reads = []
    real = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda p: reads.append(p) or real(p))
    save(
        _two_tensors(),
        checkpoint_id=tmp_path / "c",
        storage_writer=DistributedFileSystemWriter("unused", thread_count=2),
    )
    assert reads == []
    marker = json.loads((tmp_path / "c" / COMPLETION_MARKER).read_text())
    assert marker["format_version"] == 2 and marker["checksum_algorithm"] == "crc32"
    assert (
        set(marker["checksums"])
        == set(marker["files"])
        == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    )
    for name, crc in marker["checksums"].items():
        assert real(tmp_path / "c" / name) == crc, name


def test_writer_without_a_file_system_is_checksummed_by_reading(tmp_path, monkeypatch):
    """A custom StorageWriter DCP cannot be followed into still gets a checksum for every file."""
    reads = []
    real = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda p: reads.append(p.name) or real(p))

    class Delegating(StorageWriter):
        """Writes through an inner writer it does not expose (as a writer to other storage)."""

        def __init__(self) -> None:
            self._inner = FileSystemWriter("unused")

        def reset(self, checkpoint_id=None):
            self._inner.reset(checkpoint_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return True

        def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
            self._inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

        def prepare_local_plan(self, plan):
            return self._inner.prepare_local_plan(plan)

        def prepare_global_plan(self, plans):
            return self._inner.prepare_global_plan(plans)

        def write_data(self, plan, planner):
            return self._inner.write_data(plan, planner)

        def finish(self, metadata, results):
            self._inner.finish(metadata, results)

    writer = Delegating()
    save(_two_tensors(), checkpoint_id=tmp_path / "c", storage_writer=writer)
    assert sorted(reads) == [".metadata", "__0_0.distcp"]
    marker = json.loads((tmp_path / "c" / COMPLETION_MARKER).read_text())
    assert marker["checksums"]["__0_0.distcp"] == real(tmp_path / "c" / "__0_0.distcp")


def test_async_and_sm_local_saves_are_checksummed(tmp_path):
    queue = AsyncCallsQueue()
    want = _two_tensors()
    async_save(dict(want), checkpoint_id=tmp_path / "a", queue=queue)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    shard = _flip_byte_inside(tmp_path / "a", want["b"])
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match"):
        load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, checkpoint_id=tmp_path / "a")

    model = torch.nn.Linear(64, 16)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        save({"model": model.state_dict()}, checkpoint_id=tmp_path / "l")
        shard = _flip_byte_inside(tmp_path / "l", model.weight.detach())
        with pytest.raises(CheckpointError, match=rf"{shard.name} does not match"):
            load({"model": model.state_dict()}, checkpoint_id=tmp_path / "l")


def test_marker_without_checksums_of_format_1_still_loads(tmp_path):
    """Checkpoints written before checksums existed are checked by size, as they were."""
    want = _two_tensors()
    save(want, checkpoint_id=tmp_path / "c")
    marker_file = tmp_path / "c" / COMPLETION_MARKER
    marker = json.loads(marker_file.read_text())
    for key in ("checksums", "checksum_algorithm", "save_id"):
        marker.pop(key)
    marker["format_version"] = 1
    marker_file.write_text(json.dumps(marker))
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    load(got, checkpoint_id=tmp_path / "c")
    assert torch.equal(got["a"], want["a"])
    marker["format_version"] = 2  # a format-2 marker must list a checksum for every file
    marker_file.write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="marker .* is unreadable .*malformed"):
        load(got, checkpoint_id=tmp_path / "c")


def test_crc_stream_gives_up_on_out_of_order_writes(tmp_path):
    """A stream that seeks back is not trusted; the file is then read at commit."""
    recorder = integrity.Recorder(tmp_path)
    fs = integrity._RecordingFileSystem(FileSystem(), recorder)
    with fs.create_stream(tmp_path / "x", "wb") as s:
        s.write(b"hello world")
    with fs.create_stream(tmp_path / "y", "wb") as s:
        s.write(b"hello world")
        s.seek(0)
        s.write(b"j")
    assert recorder.records() == {
        "x": (11, integrity.file_checksum(tmp_path / "x")),
        "y": (-1, None),  # written, but neither its size nor its checksum is known
    }


# DCP's own load through SMP's reader (SMP's scripts load optimizer states so): Note [What DCP
# reads through DistributedFileSystemReader].


def _dcp_load_through_smp_reader(state: dict, directory) -> None:
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    dcp.load(state, storage_reader=DistributedFileSystemReader(directory), no_dist=True)


def test_dcp_load_through_the_smp_reader_refuses_a_changed_shard(tmp_path):
    want = _two_tensors()
    save(want, checkpoint_id=tmp_path / "c")
    intact = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    _dcp_load_through_smp_reader(intact, tmp_path / "c")
    assert all(torch.equal(intact[k], want[k]) for k in want)
    shard = _flip_byte_inside(tmp_path / "c", want["a"])
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    # DCP's load raises its own CheckpointException, quoting each rank's error.
    with pytest.raises(CheckpointException, match=rf"{shard.name} does not match its crc32"):
        _dcp_load_through_smp_reader(got, tmp_path / "c")
    assert float(got["a"].abs().sum()) == 0.0, "nothing may be read from a changed file"


def test_dcp_load_through_the_smp_reader_refuses_a_truncated_shard_or_garbled_metadata(tmp_path):
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    save(_two_tensors(), checkpoint_id=tmp_path / "t")
    (shard,) = _data_files(tmp_path / "t")
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=rf"{shard.name}"):
        DistributedFileSystemReader(tmp_path / "t")
    save(_two_tensors(), checkpoint_id=tmp_path / "m")
    meta = tmp_path / "m" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    with pytest.raises(CheckpointException, match=r"\.metadata does not match its crc32"):
        _dcp_load_through_smp_reader({"a": torch.zeros(64, 16)}, tmp_path / "m")


def test_dcp_load_through_the_smp_reader_reads_a_plain_dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    want = _two_tensors()
    dcp.save(want, storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    _dcp_load_through_smp_reader(got, tmp_path / "plain")  # no marker: read as DCP reads it
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_load_with_the_smp_reader_checks_each_file_once(tmp_path, monkeypatch):
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    save(_two_tensors(), checkpoint_id=tmp_path / "c")
    checked: list[str] = []
    real = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda p: checked.append(p.name) or real(p))
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    load(got, storage_reader=DistributedFileSystemReader(tmp_path / "c"))
    assert sorted(checked) == sorted([".metadata", *(p.name for p in _data_files(tmp_path / "c"))])


def test_the_smp_reader_raises_checkpoint_error_itself_for_metadata_or_kind(tmp_path):
    """As load_sharded_optimizer_state_dict calls it, before DCP's load wraps anything."""
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    save(_two_tensors(), checkpoint_id=tmp_path / "m")
    meta = tmp_path / "m" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt: \.metadata does not match its crc32"):
        DistributedFileSystemReader(tmp_path / "m").read_metadata()
    save(_two_tensors(), checkpoint_id=tmp_path / "hf")
    marker_file = tmp_path / "hf" / COMPLETION_MARKER
    marker = json.loads(marker_file.read_text())
    marker_file.write_text(json.dumps({**marker, "kind": "hugging_face"}))
    with pytest.raises(CheckpointError, match="is a Hugging Face export"):
        DistributedFileSystemReader(tmp_path / "hf").read_metadata()
    with pytest.raises(CheckpointException, match="is a Hugging Face export"):
        _dcp_load_through_smp_reader({"a": torch.zeros(64, 16)}, tmp_path / "hf")


def test_dcp_load_through_the_smp_reader_checks_sizes_only_without_checksums(tmp_path):
    """A format-1 marker is checked by size, as load checks it."""
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    want = _two_tensors()
    save(want, checkpoint_id=tmp_path / "c")
    marker_file = tmp_path / "c" / COMPLETION_MARKER
    marker = json.loads(marker_file.read_text())
    for key in ("checksums", "checksum_algorithm"):
        marker.pop(key)
    marker_file.write_text(json.dumps({**marker, "format_version": 1}))
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    _dcp_load_through_smp_reader(got, tmp_path / "c")
    assert all(torch.equal(got[k], want[k]) for k in want)
    (shard,) = _data_files(tmp_path / "c")
    shard.write_bytes(shard.read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match=rf"{shard.name} has"):
        DistributedFileSystemReader(tmp_path / "c")


def test_the_smp_reader_checks_each_file_once_and_again_after_load(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    want = _two_tensors()
    save(want, checkpoint_id=tmp_path / "c")
    files = sorted([".metadata", *(p.name for p in _data_files(tmp_path / "c"))])
    checked: list[str] = []
    real = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda p: checked.append(p.name) or real(p))
    reader = DistributedFileSystemReader(tmp_path / "c")
    reader.read_metadata()  # as load_sharded_optimizer_state_dict does before DCP's load
    dcp.load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, storage_reader=reader)
    assert sorted(checked) == files
    # A reader given to load(), then to DCP's load (the model, then the optimizer state):
    # load() checks without it, and it checks what DCP reads through it afterwards.
    reader = DistributedFileSystemReader(tmp_path / "c")
    load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, storage_reader=reader)
    shard = _flip_byte_inside(tmp_path / "c", want["b"])
    with pytest.raises(CheckpointException, match=rf"{shard.name} does not match its crc32"):
        dcp.load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, storage_reader=reader)


def test_dcp_load_with_another_checkpoint_id_checks_that_checkpoint(tmp_path):
    """DCP's load given a checkpoint_id resets the reader to it: that checkpoint is checked,
    against its own marker. Before, the reader's own directory was checked instead."""
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader

    save(_two_tensors(), checkpoint_id=tmp_path / "a")
    want = {k: v + 1 for k, v in _two_tensors().items()}
    save(want, checkpoint_id=tmp_path / "b")
    got = {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}
    reader = DistributedFileSystemReader(tmp_path / "a")
    dcp.load(got, checkpoint_id=tmp_path / "b", storage_reader=reader, no_dist=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    shard = _flip_byte_inside(tmp_path / "b", want["b"])
    reader = DistributedFileSystemReader(tmp_path / "a")
    with pytest.raises(CheckpointException, match=rf"{tmp_path / 'b'} is corrupt: {shard.name}"):
        dcp.load(
            {"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)},
            checkpoint_id=tmp_path / "b",
            storage_reader=reader,
            no_dist=True,
        )
