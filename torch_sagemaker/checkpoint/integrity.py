"""Checksums of checkpoint files: computed while DCP writes them, verified before a load.

Note [Checkpoint checksums]
    The completion marker records, next to each file's size, the CRC-32 of its bytes under
    the file's name (``"checksums": {"__0_0.distcp": "1c291ca3", ...}``). Flipped bytes inside
    a shard, and two shard files swapped or renamed, then fail the load with a
    ``CheckpointError`` naming the file, instead of loading wrong values.

    *Computed while writing.* PyTorch DCP's file-system writers write every file through
    ``writer.fs.create_stream``; for the duration of a save ``recording`` puts a thin
    ``_RecordingFileSystem`` in front of that ``fs`` whose streams update a running CRC on
    each ``write`` (DCP's writer threads each own a file; zlib releases the GIL on large
    buffers, so the threads checksum in parallel). No second read pass on the writing
    side. Files it could not follow (a custom ``StorageWriter`` without ``fs``, a stream
    that seeked back, a size that differs from the bytes seen) are read once by the
    coordinator before the commit instead (``atomic_dir.commit``), so every marker holds a
    checksum for every file.

    *Why CRC-32 (zlib.crc32).* The threat is accidental corruption (bit rot, a torn copy,
    a misplaced file), not an adversary: whoever can rewrite a shard can rewrite the marker.
    CRC-32 detects every error burst up to 32 bits and, for random damage, all but 1 in
    2**32; it is in the standard library (zlib 1.2.13's braided CRC runs at about
    1.4 GiB/s per core here, blake2b at 0.3, sha256 at 0.5), so it adds no dependency.
    CRC-32C (``google-crc32c``, hardware accelerated) would be faster still but is one
    more compiled dependency for a cost that measures small next to serializing and
    writing the same bytes (docs/checkpoint.md, Safety).

    *Verified on load.* ``load`` splits the files among the ranks that load the same
    directory (each file is read once in all, and the page cache then serves DCP's own
    read on a local disk), then one small all-gather gives every rank every problem, so
    all ranks raise the same error. A marker written before checksums existed (format 1)
    is checked by size only.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ALGORITHM = "crc32"
_CHUNK = 8 << 20  # read size when a file has to be checksummed from disk


def format_checksum(crc: int) -> str:
    """The marker's spelling of a CRC-32: eight lowercase hex digits."""
    return f"{crc & 0xFFFFFFFF:08x}"


def file_checksum(path: Path) -> str:
    """Reads ``path`` once and returns its checksum (``format_checksum``)."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return format_checksum(crc)


class _CrcStream:
    """A write stream that keeps the CRC of every byte written through it, in order.

    Anything that writes out of order (a seek away from the end) marks the CRC and the size
    unusable; the file is then checksummed from disk instead.
    """

    def __init__(self, raw: Any, checksum: bool = True) -> None:
        self._raw = raw
        self.crc = 0
        self.size = 0
        self.valid = checksum  # False: no CRC (not asked for, or not followed)
        self.in_order = True  # False: ``size`` is not the file's size

    def write(self, data: Any) -> int:
        view = memoryview(data)
        try:
            view = view.cast("B")
        except TypeError:  # not contiguous: the bytes cannot be followed
            self.valid = False
        n = self._raw.write(data)
        written = view.nbytes if n is None else n
        if self.valid:
            self.crc = zlib.crc32(view[:written], self.crc)
        self.size += written
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = self._raw.seek(offset, whence)
        if position != self.size:
            self.valid = self.in_order = False
        return position

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, ...
        return getattr(self._raw, name)


#: What one rank wrote in one save: file name -> (size, checksum); a size of -1 and a
#: checksum of ``None`` where they could not be followed.
Written = dict[str, tuple[int, str | None]]


class Recorder:
    """What one rank wrote during one save: file name (relative to ``root``) -> size, CRC.

    Args:
        root: The directory the save writes (the staging directory).
        checksums: Also compute each file's checksum (else sizes only).

    Attributes:
        following: Whether the writer's files pass through this recorder (set by
            ``recording``); a writer without a ``FileSystem`` cannot be followed.
    """

    def __init__(self, root: Path, checksums: bool = True) -> None:
        self.root = Path(root)
        self.checksums = checksums
        self.following = False
        self._lock = threading.Lock()  # DCP's writer threads finish files concurrently
        self._files: Written = {}

    def _name(self, path: Any) -> str | None:
        rel = os.path.relpath(os.fspath(path), self.root)
        return None if rel.startswith("..") else rel

    def finished(self, path: Any, stream: _CrcStream | None) -> None:
        """Records a file whose stream was closed (``None``: its content is unknown)."""
        name = self._name(path)
        if name is not None:
            size = stream.size if stream is not None and stream.in_order else -1
            crc = format_checksum(stream.crc) if stream is not None and stream.valid else None
            with self._lock:
                self._files[name] = (size, crc)

    def renamed(self, old: Any, new: Any) -> None:
        """Follows a rename (DCP writes ``.metadata.tmp`` and renames it)."""
        old_name, new_name = self._name(old), self._name(new)
        with self._lock:
            record = self._files.pop(old_name, None) if old_name is not None else None
            if new_name is not None:
                self._files[new_name] = record if record is not None else (-1, None)

    def records(self) -> Written:
        """``{name: (size, checksum)}`` of every file written (``Written``)."""
        with self._lock:
            return dict(self._files)


class _RecordingFileSystem:
    """DCP ``FileSystem`` front whose write streams feed a ``Recorder`` (all else delegated)."""

    def __init__(self, inner: Any, recorder: Recorder) -> None:
        self._inner = inner
        self._recorder = recorder

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:  # reads pass through; appends cannot be followed
                yield raw
                if "a" in mode or "+" in mode:
                    self._recorder.finished(path, None)
                return
            if "b" not in mode:  # text: the characters written are not its bytes
                yield raw
                self._recorder.finished(path, None)
                return
            stream = _CrcStream(raw, self._recorder.checksums)
            yield stream
        self._recorder.finished(path, stream)

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)
        self._recorder.renamed(path, new_path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def recording(
    storage_writer: Any, root: Path, checksums: bool = True
) -> Iterator[tuple[Any, Recorder]]:
    """Yields ``(writer, recorder)``: the writer to pass to DCP, recording its files meanwhile.

    Args:
        storage_writer: The caller's DCP ``StorageWriter``, or ``None`` for DCP's
            ``FileSystemWriter`` (what ``dcp.save`` would pick for a local path).
        root: The directory the save writes.
        checksums: Record each file's checksum as well as its size.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    writer = storage_writer if storage_writer is not None else FileSystemWriter(root)
    recorder = Recorder(root, checksums)
    fs = getattr(writer, "fs", None)
    if fs is None or not callable(getattr(fs, "create_stream", None)):
        yield writer, recorder  # nothing to follow: the coordinator reads the files instead
        return
    recorder.following = True
    writer.fs = _RecordingFileSystem(fs, recorder)
    try:
        yield writer, recorder
    finally:
        writer.fs = fs  # the caller's writer is left as it was given


def merge(records: Iterable[Written | None]) -> Written | None:
    """One table from every rank's ``Recorder.records`` (ranks write disjoint files).

    ``None`` where a rank's part is ``None``: its writer could not be followed, so which
    files the save wrote is not known.
    """
    merged: Written = {}
    for part in records:
        if part is None:
            return None
        merged.update(part)
    return merged


def recorded_checksum(record: tuple[int, str | None] | None, size: int) -> str | None:
    """The checksum of ``record`` if it covered all ``size`` bytes of the file, else ``None``."""
    if record is None or record[0] != size:
        return None
    return record[1]


def checksums_for(directory: Path, sizes: dict[str, int], recorded: Written) -> dict[str, str]:
    """The checksum of every file in ``sizes``: recorded ones, else read from ``directory``.

    A recorded checksum is used only if the bytes it covered are the file's whole size.
    """
    out: dict[str, str] = {}
    for name, size in sizes.items():
        crc = recorded_checksum(recorded.get(name), size)
        out[name] = crc if crc is not None else file_checksum(directory / name)
    return out


def not_as_written(found: dict[str, int], written: Written) -> tuple[list[str], list[str]]:
    """How the files a save's storage holds (``found``: name -> size) differ from ``written``.

    Note [Commit what was written]: a commit certifies the files the save's ranks wrote.
    Another save writing the same staging area at the same time (a second job, or a save
    started before the last one finished) can delete or replace them between the writes
    and the commit; so can anything else. The commit then refuses, instead of writing a
    marker over bytes this save never wrote. Files the ranks did not write through DCP's
    file system (a post-write hook's side file, another save's extra shard) cannot change
    what DCP's metadata reads: they are reported, and committed with the rest.

    Returns:
        ``(problems, extras)``: one line per file that is missing or has another size than
        written, and the names of files this save did not write.
    """
    extras = sorted(found.keys() - written.keys())
    problems = [
        f"{n}: written by this save, now missing" for n in sorted(written.keys() - found.keys())
    ]
    for name in sorted(found.keys() & written.keys()):
        size = written[name][0]
        if size >= 0 and size != found[name]:
            problems.append(f"{name}: {found[name]} bytes where this save wrote {size}")
    return problems, extras


def verify(directory: Path, names: Iterable[str], checksums: dict[str, str]) -> list[str]:
    """Problems found by re-checksumming ``names`` in ``directory`` (empty when all match).

    Each problem names the file; a file holding the bytes recorded for another name is
    reported as swapped or renamed.
    """
    return verify_with(lambda name: file_checksum(directory / name), names, checksums)


def verify_with(
    checksum_of: Callable[[str], str], names: Iterable[str], checksums: dict[str, str]
) -> list[str]:
    """``verify`` with the checksums read by ``checksum_of(name)`` (a file, an S3 object).

    ``checksum_of`` raising ``OSError`` (or anything else) reports the file unreadable.
    """
    by_checksum: dict[str, list[str]] = {}
    for name, crc in checksums.items():
        by_checksum.setdefault(crc, []).append(name)
    problems = []
    for name in names:
        expected = checksums.get(name)
        if expected is None:
            continue
        try:
            actual = checksum_of(name)
        except OSError as e:
            problems.append(f"{name} cannot be read ({e.strerror})")
            continue
        except Exception as e:  # noqa: BLE001 - an object store's error: name the object
            problems.append(f"{name} cannot be read ({type(e).__name__}: {e})")
            continue
        if actual == expected:
            continue
        others = [n for n in by_checksum.get(actual, []) if n != name]
        if others:
            problems.append(
                f"{name} holds the bytes written as {others[0]} (files swapped or renamed)"
            )
        else:
            problems.append(
                f"{name} does not match its {ALGORITHM} checksum ({actual} now, "
                f"{expected} when written): its bytes changed after the save"
            )
    return problems


def assign(sizes: dict[str, int], count: int, index: int) -> list[str]:
    """The files ``index`` of ``count`` readers checks: largest first, to the least loaded.

    Every reader computes the same split from the same marker.
    """
    loads = [0] * count
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        reader = min(range(count), key=lambda r: (loads[r], r))
        loads[reader] += sizes[name]
        if reader == index:
            mine.append(name)
    return mine


__all__ = [
    "ALGORITHM",
    "Recorder",
    "assign",
    "Written",
    "checksums_for",
    "file_checksum",
    "format_checksum",
    "merge",
    "not_as_written",
    "recorded_checksum",
    "recording",
    "verify",
    "verify_with",
]
