"""Makes a checkpoint directory visible only once it is complete.

Note [Checkpoint commit protocol]
    A save of ``<parent>/<name>`` writes into the sibling ``<parent>/.<name>.partial``. When
    every rank has written its files (PyTorch DCP's coordinator writes ``.metadata`` only
    after collecting every rank's write results), the coordinator
      0. checks that the staging directory still holds the files the ranks wrote, at the
         sizes they wrote (Note [Commit what was written] in ``integrity``),
      1. writes the completion marker (format, layout, the size and checksum of every file,
         Note [Checkpoint checksums] in ``integrity``, and the save's id) and fsyncs it,
      2. renames an existing ``<name>`` out of the way to ``.<name>.replaced``,
      3. renames the staging directory to ``<name>`` (atomic on POSIX file systems),
      4. deletes the replaced directory.
    A crash before step 3 leaves the previous ``<name>`` untouched; the next save removes the
    stale staging directory. A crash between steps 2 and 3 leaves the previous checkpoint
    complete under ``.<name>.replaced``, and loading ``<name>`` says so; a step 3 that fails
    without a crash renames it back first. A failed sync of the parent directory after step
    3 is a warning, not a failed save: the checkpoint is committed, only whether the rename
    survives a power loss is unknown, so the previous one is kept under
    ``.<name>.replaced`` until the next save of the name. Loading requires the marker and
    checks the recorded file sizes and checksums, so a partial, truncated or garbled
    checkpoint is reported instead of read. All ranks must see one shared file system (as
    DCP requires). What each rank reports when a peer fails around step 3 is
    Note [Commit outcome] in ``_commit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from torch_sagemaker.checkpoint import integrity
from torch_sagemaker.checkpoint.completeness import (
    inside_checkpoint_hint,
    marker_kind,
    parts_description,
)
from torch_sagemaker.checkpoint.constants import (
    COMPLETION_MARKER,
    REPLACED_SUFFIX,
    STAGING_SUFFIX,
)
from torch_sagemaker.checkpoint.marker import (
    CheckpointError,
    check_sizes,
    corrupt_error,
    incomplete_error,
    new_marker,
    read_marker_bytes,
)
from torch_sagemaker.logger import get_logger


def checkpoint_path(checkpoint_id: str | os.PathLike[str] | None) -> Path:
    """Validates ``checkpoint_id`` and returns it as an absolute local path.

    Raises:
        ValueError: If it is ``None``, an S3 URI (not supported here), or text that only
            looks like one (``S3://``, or a ``pathlib.Path`` of an URI, which keeps one
            slash): written here, it would land on local disk under ``./s3:``.
    """
    if checkpoint_id is None:
        raise ValueError("checkpoint_id is required: pass the checkpoint directory.")
    text = os.fspath(checkpoint_id)
    if text.startswith("s3://"):
        raise ValueError(
            f"checkpoint_id={text!r}: S3 paths are not supported; save to a local or shared "
            "file system path and upload the directory afterwards."
        )
    if text[:4].lower() == "s3:/":
        raise ValueError(
            f"checkpoint_id={checkpoint_id!r} looks like an S3 URI but is not one, so it "
            "would be a local directory named 's3:'. Pass the URI as a str that starts with "
            "'s3://' in lower case (a pathlib.Path turns 's3://bucket/key' into "
            "'s3:/bucket/key')."
        )
    return Path(text).absolute()


def staging_path(path: Path) -> Path:
    """The temporary sibling directory a save of ``path`` writes into."""
    return path.parent / f".{path.name}{STAGING_SUFFIX}"


def replaced_path(path: Path) -> Path:
    """Where a previous checkpoint at ``path`` waits while it is being replaced."""
    return path.parent / f".{path.name}{REPLACED_SUFFIX}"


def check_replaceable(path: Path) -> None:
    """Refuses a save to ``path`` where something other than a checkpoint is there.

    Note [Saves replace only checkpoints]: a commit replaces whatever directory is at
    ``path`` (step 2 of Note [Checkpoint commit protocol]), which is right for an earlier
    checkpoint of the same name and wrong for anything else: a job's output directory, or
    the directory that holds its checkpoints (``save(root)`` instead of ``save(root/step)``),
    would be deleted whole. So the target must not exist, be an empty directory, or hold a
    complete checkpoint (its marker). Checked before the save writes anything, and again at
    the commit.

    Raises:
        CheckpointError: Naming the path, what is there, and the fix.
    """
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise CheckpointError(
            f"cannot save checkpoint {path}: a file is there, and a checkpoint is a directory. "
            "Pass a path that does not exist yet, or remove the file."
        )
    if is_complete(path):
        return
    entries = sorted(os.listdir(path))
    if entries:
        shown = ", ".join(entries[:5]) + (
            f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        )
        raise CheckpointError(
            f"cannot save checkpoint {path}: the directory holds {shown}, and it is not a "
            "checkpoint (no completion marker), so saving would delete it (a save replaces "
            "the whole directory). Save each checkpoint to a directory of its own, such as "
            f"{path / 'step-100'}, or remove what is there."
        )


def prepare_staging(path: Path) -> Path:
    """Removes a stale staging directory of ``path`` and creates an empty one (coordinator only).

    Raises:
        CheckpointError: If something other than a checkpoint is at ``path``
            (``check_replaceable``).
    """
    check_replaceable(path)
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
    recorded: integrity.Written | None = None,
    *,
    cleanup: bool = True,
    checksums: bool = True,
) -> bool:
    """Marks ``staging`` complete and renames it to ``path`` (Note [Checkpoint commit protocol]).

    Args:
        staging: The fully written staging directory.
        path: The final checkpoint directory.
        info: JSON-serializable facts stored in the marker (kind, layout, ...).
        recorded: Every file the save wrote, with the checksums computed while writing
            (``integrity.merge``); the staging directory must hold exactly these (Note
            [Commit what was written]). Checksums missing from it are read once here.
            ``None``: not known (nothing is compared).
        cleanup: Delete the replaced previous checkpoint now (else call ``remove_replaced``).
        checksums: Record every file's checksum in the marker; ``False`` writes sizes only.

    Returns:
        Whether the commit is durable: ``False`` when syncing the parent directory failed
        after the renames (the previous checkpoint is then kept, whatever ``cleanup`` says).

    Raises:
        CheckpointError: If the staging directory does not hold what ``recorded`` lists, or
            something other than a checkpoint is at ``path`` (``check_replaceable``).
    """
    for f in staging.rglob("*"):
        if f.is_file():
            _fsync(f)
    sizes = _file_sizes(staging)
    if recorded is not None:
        check_as_written(path, staging, sizes, recorded)
    table = integrity.checksums_for(staging, sizes, recorded or {}) if checksums else None
    check_replaceable(path)  # something may have appeared there since the save started
    marker_file = staging / COMPLETION_MARKER
    marker_file.write_bytes(new_marker(sizes, table, info))
    _fsync(marker_file)
    old = replaced_path(path)
    moved_aside = path.exists()
    if moved_aside:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    try:
        os.replace(staging, path)
    except OSError:
        if moved_aside:
            # Step 2 undone, so the previous checkpoint stays where loads look for it. If
            # this fails too, it stays complete under ``old`` (the error's ``where``).
            with contextlib.suppress(OSError):
                os.replace(old, path)
        raise
    try:
        _fsync(path.parent)
    except OSError as e:
        # Both renames happened: the checkpoint is committed and loadable. Only whether the
        # renames survive a power loss is unknown, so the previous checkpoint is kept aside
        # (the next save of this name removes it). Not a failed save.
        get_logger().warning(
            f"checkpoint {path} is committed, but syncing its directory {path.parent} failed "
            f"({type(e).__name__}: {e}): the rename may not survive a power loss; the "
            f"previous checkpoint stays at {old} until the next save of {path.name}."
        )
        return False
    if cleanup:
        remove_replaced(path)
    return True


def check_as_written(
    where: Any, staging: Any, found: dict[str, int], recorded: integrity.Written
) -> None:
    """Refuses a commit whose staging area lost or changed a file the save wrote.

    Note [Commit what was written] in ``integrity``; files the save did not write are
    logged and committed.

    Raises:
        CheckpointError: Naming the files missing or of another size.
    """
    problems, extras = integrity.not_as_written(found, recorded)
    if extras:
        get_logger().warning(
            f"checkpoint {where}: committing files this save did not write through DCP: "
            f"{extras[:5]}{' ...' if len(extras) > 5 else ''} (a post-write hook's files, or "
            "another save of the same checkpoint)."
        )
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise CheckpointError(
            f"checkpoint {where} was not committed: {staging} no longer holds what this save "
            f"wrote ({shown}). Something changed it while the save ran, such as another save "
            "of the same checkpoint (a second job, or a save started before the last one "
            "finished); give each job's checkpoints names of their own. A previous "
            "checkpoint there is unchanged."
        )


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
        elif is_complete(path.parent):
            parent_kind = marker_kind(LocalDirectory(path.parent))
            hint = inside_checkpoint_hint(path.parent, parent_kind, path.name)
        raise CheckpointError(f"checkpoint {path} does not exist.{hint}")
    marker_file = path / COMPLETION_MARKER
    if not marker_file.is_file():
        other = _kind_of_unmarked(path)
        if other is not None:
            raise CheckpointError(f"checkpoint {path} {other}")
        raise incomplete_error(path)
    marker = read_marker_bytes(marker_file.read_bytes, path, marker_file)
    check_sizes(path, marker["files"], _file_sizes(path))
    return marker


def _kind_of_unmarked(path: Path) -> str | None:
    """What ``path``, which has no marker of its own, holds, with the fix.

    Returns:
        The sentence, where it is a checkpoint of another kind whose parts carry the
        markers (``completeness.parts_description``); ``None`` otherwise.
    """
    return parts_description([p.name for p in path.iterdir() if p.is_dir()])


def verify_files(path: Path, marker: dict[str, Any], names: list[str]) -> list[str]:
    """Re-checksums ``names`` of checkpoint ``path`` against its marker (``read_marker``).

    Returns:
        One line per file that differs (Note [Checkpoint checksums]); empty when all
        match or the marker predates checksums.
    """
    return integrity.verify(path, names, marker.get("checksums", {}))


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether the directory ``path`` is a complete checkpoint (it has the completion marker)."""
    return (Path(path) / COMPLETION_MARKER).is_file()


class LocalDirectory:
    """A checkpoint in a directory of a file system all ranks share: the local location.

    Saves follow Note [Checkpoint commit protocol]; see ``location.CheckpointLocation`` for
    what each method does in the protocol.

    Args:
        path: The checkpoint directory (made absolute).
        checksums: Record and verify file checksums (Note [Checkpoint checksums]); ``False``
            writes and checks sizes only.

    Raises:
        ValueError: If ``path`` is ``None`` or an ``s3://`` URI (``checkpoint_path``).
    """

    #: DCP's writer may fsync the files it writes (real file descriptors).
    syncs_files = True

    def __init__(self, path: str | os.PathLike[str], *, checksums: bool = True) -> None:
        self.path = checkpoint_path(path)
        self.checksums = checksums
        self._keep_replaced = False  # the last commit's renames may not be durable

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LocalDirectory({str(self.path)!r}, checksums={self.checksums})"

    # ---------------------------------------------------------------- naming
    @property
    def name(self) -> str:
        """The directory's own name."""
        return self.path.name

    def child(self, name: str) -> LocalDirectory:
        """The checkpoint ``name`` inside this directory, with the same options."""
        return LocalDirectory(self.path / name, checksums=self.checksums)

    def parent(self) -> LocalDirectory | None:
        """The directory holding this one (``None`` at the file system's root)."""
        if self.path.parent == self.path:
            return None
        return LocalDirectory(self.path.parent, checksums=self.checksums)

    # ------------------------------------------------------------------ save
    def prepare(self, save_id: str) -> None:
        """Step 1 (coordinator): a fresh staging directory."""
        del save_id  # one staging directory per checkpoint name
        prepare_staging(self.path)

    def write_root(self, save_id: str) -> Path:
        """Where DCP writes save ``save_id``: the staging directory."""
        del save_id
        return staging_path(self.path)

    def storage_writer(self, save_id: str, thread_count: int = 1) -> FileSystemWriter:
        """DCP's file-system writer into the staging directory."""
        return FileSystemWriter(self.write_root(save_id), thread_count=thread_count)

    def commit(
        self, save_id: str, info: dict[str, Any], recorded: integrity.Written | None
    ) -> None:
        """Steps 1-3 of the commit (coordinator): marker, then the atomic rename.

        Raises:
            CheckpointError: If the staging directory lost or changed a file the save
                wrote (Note [Commit what was written]).
        """
        self._keep_replaced = not commit(
            self.write_root(save_id),
            self.path,
            info,
            recorded,
            cleanup=False,
            checksums=self.checksums,
        )

    def remove_replaced(self, save_id: str) -> None:
        """Step 4 (coordinator): deletes the previous checkpoint moved aside by the commit.

        Kept when the commit's renames may not be durable (``commit`` returned ``False``).
        """
        del save_id
        if not self._keep_replaced:
            remove_replaced(self.path)

    def marker_save_id(self) -> str | None:
        """The save id the marker names, if there is a readable marker."""
        try:
            return json.loads((self.path / COMPLETION_MARKER).read_text()).get("save_id")
        except (OSError, ValueError, AttributeError):
            return None

    def marker_entries(self) -> dict[str, Any]:
        """The marker's fields as written (its file table unchecked); ``{}`` without one."""
        try:
            marker = json.loads((self.path / COMPLETION_MARKER).read_text())
        except (OSError, ValueError):
            return {}
        return marker if isinstance(marker, dict) else {}

    def subdirs(self) -> list[str]:
        """The names of the directories in it (hidden ones too: saves staged there), sorted."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.is_dir())

    def is_complete(self) -> bool:
        """Whether the directory holds a committed checkpoint."""
        return is_complete(self.path)

    def where(self) -> str:
        """What the location holds now (for an outcome nobody could tell)."""
        if self.is_complete():
            return f"{self.path} holds a complete checkpoint from an earlier save"
        if replaced_path(self.path).is_dir():
            return (
                f"the previous checkpoint is at {replaced_path(self.path)}; rename it "
                "back to use it"
            )
        return f"{self.path} holds no complete checkpoint"

    # ------------------------------------------------------------------ load
    def read_marker(self) -> dict[str, Any]:
        """The marker, after checking every file it lists is there with its size."""
        return read_marker(self.path)

    def verify(self, marker: dict[str, Any], names: list[str]) -> list[str]:
        """Problems found by re-checksumming ``names`` (none when checksums are off)."""
        if not self.checksums:
            return []
        return verify_files(self.path, marker, names)

    def data_root(self, marker: dict[str, Any] | None = None) -> Path:
        """Where DCP reads the committed files: the directory itself."""
        del marker
        return self.path

    def storage_reader(self, marker: dict[str, Any], given: Any = None) -> Any:
        """``given`` (the caller's reader), else DCP's file-system reader of the directory."""
        del marker
        return given if given is not None else FileSystemReader(self.path)

    def file_system(self) -> FileSystem:
        """DCP's file system for this location's files."""
        return FileSystem()

    # ------------------------------------------------------------- retention
    def checkpoint_names(self) -> set[str]:
        """The checkpoints in this directory: its subdirectories but hidden ones (saves)."""
        if not self.path.is_dir():
            return set()
        return {p.name for p in self.path.iterdir() if p.is_dir() and not p.name.startswith(".")}

    def remove(self) -> None:
        """Deletes the checkpoint, and what an unfinished save of it left.

        Its completion markers go first (its own, and its parts'), as on S3: a deletion cut
        short then leaves a checkpoint that is incomplete, never one that looks complete
        over missing files.
        """
        if self.path.is_dir():
            for marker in sorted(self.path.rglob(COMPLETION_MARKER), key=lambda p: len(p.parts)):
                marker.unlink(missing_ok=True)
            _fsync(self.path)
        for victim in (self.path, staging_path(self.path), replaced_path(self.path)):
            if victim.exists():
                shutil.rmtree(victim, ignore_errors=True)


__all__ = [
    "CheckpointError",
    "LocalDirectory",
    "check_sizes",
    "check_replaceable",
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
