"""Makes a checkpoint directory visible only once it is complete.

Note [Checkpoint commit protocol]
    A save of ``<parent>/<name>`` writes into the sibling ``<parent>/.<name>.partial``. When
    every rank has written its files (PyTorch DCP's coordinator writes ``.metadata`` only
    after collecting every rank's write results), the coordinator
      1. writes the completion marker (format, layout, the size and checksum of every file,
         Note [Checkpoint checksums] in ``integrity``, and the save's id) and fsyncs it,
      2. renames an existing ``<name>`` out of the way to ``.<name>.replaced``,
      3. renames the staging directory to ``<name>`` (atomic on POSIX file systems),
      4. deletes the replaced directory.
    A crash before step 3 leaves the previous ``<name>`` untouched; the next save removes the
    stale staging directory. A crash between steps 2 and 3 leaves the previous checkpoint
    complete under ``.<name>.replaced``, and loading ``<name>`` says so. Loading requires the
    marker and checks the recorded file sizes and checksums, so a partial, truncated or
    garbled checkpoint is reported instead of read. All ranks must see one shared file
    system (as DCP requires). What each rank reports when a peer fails around step 3 is
    Note [Commit outcome] in ``_commit``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from torch_sagemaker.distributed.checkpoint import integrity
from torch_sagemaker.distributed.checkpoint.constants import (
    COMPLETION_MARKER,
    FORMAT_VERSION,
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match what is loaded into it.

    Attributes:
        committed: ``True`` when a save raised although its checkpoint was committed (it is
            complete and loadable; a rank failed after the commit, Note [Commit outcome]).
    """

    def __init__(self, message: str, *, committed: bool = False) -> None:
        super().__init__(message)
        self.committed = committed


def checkpoint_path(checkpoint_id: str | os.PathLike[str] | None) -> Path:
    """Validates ``checkpoint_id`` and returns it as an absolute local path.

    Raises:
        ValueError: If it is ``None`` or an S3 URI (not supported here).
    """
    if checkpoint_id is None:
        raise ValueError("checkpoint_id is required: pass the checkpoint directory.")
    text = os.fspath(checkpoint_id)
    if text.startswith("s3://"):
        raise ValueError(
            f"checkpoint_id={text!r}: S3 paths are not supported; save to a local or shared "
            "file system path and upload the directory afterwards."
        )
    return Path(text).absolute()


def staging_path(path: Path) -> Path:
    """The temporary sibling directory a save of ``path`` writes into."""
    return path.parent / f".{path.name}{STAGING_SUFFIX}"


def replaced_path(path: Path) -> Path:
    """Where a previous checkpoint at ``path`` waits while it is being replaced."""
    return path.parent / f".{path.name}{REPLACED_SUFFIX}"


def prepare_staging(path: Path) -> Path:
    """Removes a stale staging directory of ``path`` and creates an empty one (coordinator only)."""
    staging = staging_path(path)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != COMPLETION_MARKER
    }


def commit(
    staging: Path,
    path: Path,
    info: dict[str, Any],
    recorded: dict[str, tuple[int, str]] | None = None,
    *,
    cleanup: bool = True,
) -> None:
    """Marks ``staging`` complete and renames it to ``path`` (Note [Checkpoint commit protocol]).

    Args:
        staging: The fully written staging directory.
        path: The final checkpoint directory.
        info: JSON-serializable facts stored in the marker (kind, layout, ...).
        recorded: Checksums computed while writing (``integrity.Recorder``); files missing
            from it are read once here.
        cleanup: Delete the replaced previous checkpoint now (else call ``remove_replaced``).
    """
    for f in staging.rglob("*"):
        if f.is_file():
            _fsync(f)
    sizes = _file_sizes(staging)
    marker = {
        "format_version": FORMAT_VERSION,
        "time": time.time(),
        "files": sizes,
        "checksum_algorithm": integrity.ALGORITHM,
        "checksums": integrity.checksums_for(staging, sizes, recorded or {}),
        **info,
    }
    marker_file = staging / COMPLETION_MARKER
    marker_file.write_text(json.dumps(marker, indent=1, sort_keys=True))
    _fsync(marker_file)
    old = replaced_path(path)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(staging, path)
    _fsync(path.parent)
    if cleanup:
        remove_replaced(path)


def remove_replaced(path: Path) -> None:
    """Deletes the previous checkpoint a commit of ``path`` moved aside (step 4)."""
    shutil.rmtree(replaced_path(path), ignore_errors=True)


def read_marker(path: Path) -> dict[str, Any]:
    """Returns the completion marker of ``path`` after checking the directory is whole.

    Raises:
        CheckpointError: If the directory is missing, has no marker (the save did not
            finish), has an unreadable marker, or a file is missing or has another size than
            when it was written.
    """
    if not path.is_dir():
        hint = ""
        if replaced_path(path).is_dir():
            hint = (
                f" A previous complete checkpoint is at {replaced_path(path)} (a save was "
                "interrupted while replacing it); rename it back to use it."
            )
        elif staging_path(path).is_dir():
            hint = f" Only an unfinished save exists ({staging_path(path)})."
        raise CheckpointError(f"checkpoint {path} does not exist.{hint}")
    marker_file = path / COMPLETION_MARKER
    if not marker_file.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no completion marker {COMPLETION_MARKER} "
            "(its save did not finish, or it was not written by torch.sagemaker). Load an "
            "earlier checkpoint."
        )
    try:
        marker = json.loads(marker_file.read_text())
        files = marker["files"]
        checksums = marker.get("checksums", {})
        if (
            not isinstance(files, dict)
            or not isinstance(checksums, dict)
            or (marker.get("format_version", 1) >= 2 and set(checksums) != set(files))
        ):
            raise ValueError("its file table is malformed")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its marker {marker_file} is "
            f"unreadable ({type(e).__name__}: {e}). Load an earlier "
            "checkpoint."
        ) from e
    check_sizes(path, files, _file_sizes(path))
    return marker


def check_sizes(
    where: Path | str, written: dict[str, int], actual: dict[str, int], prefix: str = ""
) -> None:
    """Refuses a checkpoint whose files differ from what its marker says was written.

    Args:
        where: The checkpoint (a directory or an S3 URI), for the message.
        written: File name -> bytes written, from the marker.
        actual: File name -> bytes found now.
        prefix: Put before each name in the message (the save id on S3).

    Raises:
        CheckpointError: A file is missing or has another size, naming each one.
    """
    problems = []
    for name, size in written.items():
        if name not in actual:
            problems.append(f"{prefix}{name} is missing")
        elif actual[name] != size:
            problems.append(f"{prefix}{name} has {actual[name]} bytes, {size} were written")
    if problems:
        raise CheckpointError(f"checkpoint {where} is corrupt: " + "; ".join(problems) + ".")


def verify_files(path: Path, marker: dict[str, Any], names: list[str]) -> list[str]:
    """Re-checksums ``names`` of checkpoint ``path`` against its marker (``read_marker``).

    Returns:
        One line per file that differs (Note [Checkpoint checksums]); empty when all
        match or the marker predates checksums.
    """
    return integrity.verify(path, names, marker.get("checksums", {}))


def corrupt_error(path: Path | object, problems: list[str]) -> CheckpointError:
    """The error for files whose checksum no longer matches (``path``: a directory or S3 URI)."""
    return CheckpointError(
        f"checkpoint {path} is corrupt: " + "; ".join(problems) + ". Loading it would give "
        "wrong values; load an earlier checkpoint, or copy this one again from its source."
    )


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete checkpoint (it has the completion marker); or ``s3://``."""
    if os.fspath(path).startswith("s3://"):
        from torch_sagemaker.distributed.checkpoint.s3_checkpoint import S3Checkpoint

        return S3Checkpoint(os.fspath(path)).is_complete()
    return (Path(path) / COMPLETION_MARKER).is_file()


__all__ = [
    "CheckpointError",
    "checkpoint_path",
    "commit",
    "corrupt_error",
    "is_complete",
    "prepare_staging",
    "read_marker",
    "remove_replaced",
    "replaced_path",
    "staging_path",
    "verify_files",
]
