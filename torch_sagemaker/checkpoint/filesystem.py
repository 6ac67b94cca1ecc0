"""File-system storage for checkpoints (``torch.sagemaker.distributed.checkpoint.filesystem``).

SMP's scripts load async checkpoints with ``load(..., storage_reader=
DistributedFileSystemReader(path))``. Both classes here are PyTorch DCP's file-system
storage with SMP's names and keywords: the reader is DCP's ``FileSystemReader`` that checks
what it reads against the checkpoint's completion marker (Note [What DCP reads through
DistributedFileSystemReader]); the writer is DCP's ``FileSystemWriter`` plus SMP's write
hooks and ``is_coordinator``. Their ``fs`` is the checkpoint location's
(``location.checkpoint_location``): for ``s3://`` paths ``s3_filesystem.S3FileSystem``, and
the reader reads the save a checkpoint's completion marker names (Note [S3 checkpoint
layout] in ``s3_checkpoint``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torch_sagemaker.checkpoint.constants import DCP_METADATA
from torch_sagemaker.checkpoint.location import (
    CheckpointId,
    CheckpointLocation,
    checkpoint_location,
)
from torch_sagemaker.checkpoint.marker import (
    corrupt_error,
    not_a_training_checkpoint,
    replaced_error,
)
from torch_sagemaker.checkpoint.s3_filesystem import path_to_file_system

#: A write hook: called with the writer (``writer.path``, ``writer.is_coordinator``, ``writer.fs``).
WriteHook = Callable[["DistributedFileSystemWriter"], None]


# Note [What DCP reads through DistributedFileSystemReader]
#     SMP's scripts call DCP's ``load`` (and torch's ``load_sharded_optimizer_state_dict``)
#     with this reader directly, not through our ``load``, which checks every file against the
#     checkpoint's completion marker. So the reader checks what it reads itself: when it is
#     made, that the checkpoint is complete and every file the marker lists has its size
#     (``read_marker``); the metadata's checksum before DCP reads it; and, before each
#     ``read_data``, the checksums of the files this rank's plan reads, each file once per
#     reader. A mismatch raises ``CheckpointError`` naming the files. Each check, and the
#     end of each ``read_data``, also compares the save id in the marker with the one read
#     when the reader was made: DCP opens files by name, so a save committed over the
#     checkpoint meanwhile would otherwise be read in part, or by some ranks and not others,
#     each consistent with the marker it read (Note [A save that replaces a checkpoint being
#     loaded] in ``state_dict_loader``); a changed id raises ``CheckpointError`` saying so.
#     A reader used again after another save committed raises too, even when that save is
#     the job's own: one reader may serve the model's and then the optimizer's load, which
#     must read one save; a new load of the new save takes a new reader.
#     In ``read_data`` either error fails that rank's step of DCP's load, whose gather
#     raises on every rank, so no rank waits for another. Cost: each file a rank reads is
#     read once more for its checksum, as ``load`` does (docs/checkpoint.md, "Integrity"),
#     and the marker once per check. A directory without a marker (written by DCP's own
#     ``save``) is read unchecked, as DCP reads it; a marker without checksums
#     (``checksums=False``, or written before them) is checked by size only. Our ``load``
#     checks the files before DCP reads them and reads through the reader it was given in
#     ``checked_elsewhere``: nothing is checked twice, and the reader checks again when the
#     caller uses it afterwards. DCP's ``load`` given a ``checkpoint_id`` resets the reader
#     to it (``reset``): another checkpoint's marker is then read, so that checkpoint's files
#     are checked against their own marker (the old one named other files, in another
#     directory); the reader's own checkpoint, named either way, keeps the committed files.


class DistributedFileSystemReader(FileSystemReader):
    """Reads a checkpoint directory written by DCP (every rank reads the pieces it needs).

    What it reads is checked against the checkpoint's completion marker, where there is one
    (Note [What DCP reads through DistributedFileSystemReader]): sizes when it is made, then
    the checksums of the metadata and of each file a rank reads. A checkpoint without a
    marker (written by DCP's own ``save``) is read unchecked, as DCP's ``FileSystemReader``
    reads it; one whose marker has no checksums, by size only.

    Args:
        path: The checkpoint directory, ``s3://`` URI or ``checkpoint_location`` (``.path``
            afterwards, as SMP's loader reads it: the committed files, which on S3 are the
            save the marker names).
        s3_region: Region of an ``s3://`` checkpoint's bucket (default as for ``save``).
        s3client_config: An ``s3torchconnector.S3ClientConfig`` for ``s3://`` paths.

    Raises:
        CheckpointError: For an ``s3://`` checkpoint that is missing or incomplete, or a
            checkpoint with a marker whose files are missing or have other sizes.
    """

    def __init__(
        self,
        path: CheckpointId,
        s3_region: str | None = None,
        s3client_config: Any = None,
    ) -> None:
        super().__init__(".")
        #: The checkpoint this reader reads (``load`` takes it when no checkpoint_id is given;
        #: DCP's own ``checkpoint_id`` property is ``path``, the committed save on S3).
        self.source_checkpoint: CheckpointId = path
        self._s3_options = (s3_region, s3client_config)  # for another checkpoint (``reset``)
        self._checks = True  # False while the caller has checked the files (``load``)
        self._open(checkpoint_location(path, s3_region, s3client_config))

    def _open(self, location: CheckpointLocation) -> None:
        """Reads ``location``'s marker (``None`` without one) and points ``path`` at its files."""
        self._location = location
        # The save id first: a save committing between the two reads then fails the first
        # check as a replacement, rather than passing the id check with the other's marker.
        self._save_id = location.marker_save_id()
        # Read once per checkpoint: every check of this reader compares with this marker.
        self._marker: dict[str, Any] | None = (
            location.read_marker() if location.is_complete() else None
        )
        self._checked: set[str] = set()  # files whose checksum matched (or need no check)
        # The committed files, so that DCP used directly (SMP's scripts load the optimizer
        # state with this reader) reads exactly those (on S3 the marker names them).
        self.fs = location.file_system()
        self.path = self.fs.init_path(location.data_root(self._marker))
        self._root = str(self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's ``reset``: a ``checkpoint_id`` naming another checkpoint is read instead.

        DCP's ``load`` calls it with its own ``checkpoint_id``, when given one. This
        reader's checkpoint, named by its committed files or by the checkpoint itself (on S3
        DCP alone would then read the checkpoint's prefix, not the save under it), keeps
        ``path`` and the marker read; another checkpoint's marker is read, as when the
        reader is made (Note [What DCP reads through DistributedFileSystemReader]).
        """
        if checkpoint_id is not None and str(self.fs.init_path(checkpoint_id)) != self._root:
            region, config = self._s3_options
            location = checkpoint_location(checkpoint_id, region, config)
            if str(location) != str(self._location):
                self._open(location)
        super().reset()  # a new load id; ``path`` stays the committed files

    @contextmanager
    def checked_elsewhere(self) -> Iterator[None]:
        """Within it, the reader reads without checking: the caller checked every file.

        ``load`` checks the files (split among the ranks) before DCP reads them through the
        reader it was given; afterwards the reader checks again.
        """
        before, self._checks = self._checks, False
        try:
            yield
        finally:
            self._checks = before

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, after checking the marker's kind and the metadata file's checksum.

        Raises:
            CheckpointError: A Hugging Face export (or another kind DCP cannot read), or
                metadata whose bytes changed since the save.
        """
        if self._checks and self._marker is not None:
            problem = not_a_training_checkpoint(self._location, self._marker.get("kind"))
            if problem is not None:
                raise problem
            # Where the global metadata fails, DCP asks for a rank's own
            # (``read_metadata(rank=r)``, ``__{r}.metadata``). A checkpoint of ``save`` has
            # none: a file the marker does not list is left to DCP, which finds it missing.
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            if name in self._marker["files"]:
                self._check([name])
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Checks the files ``plan`` reads against the marker, then reads them as DCP does.

        Raises:
            CheckpointError: Naming each of those files whose bytes changed since the save.
        """
        if self._checks and self._marker is not None:
            # DCP's reader groups the plan's items by file (``relative_path``): these are
            # the files this rank opens, each checked whole once.
            names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            self._check(sorted(names))
            future = super().read_data(plan, planner)
            future.wait()  # DCP's file-system reader reads before it returns: a no-op there
            self._check_not_replaced()  # the files opened by name may be another save's
            return future
        return super().read_data(plan, planner)

    def _check(self, names: list[str]) -> None:
        """Raises ``CheckpointError`` for the files of ``names`` that differ from the save's."""
        assert self._marker is not None
        self._check_not_replaced()
        todo = [n for n in names if n not in self._checked]
        unlisted = [n for n in todo if n not in self._marker["files"]]
        problems = [f"{n}: not a file this save wrote" for n in unlisted]
        problems += self._location.verify(self._marker, [n for n in todo if n not in unlisted])
        if problems:
            raise corrupt_error(self._location, problems)
        self._checked.update(todo)

    def _check_not_replaced(self) -> None:
        """Raises ``CheckpointError`` if a save committed over the checkpoint since ``_open``."""
        now = self._location.marker_save_id()
        if now != self._save_id:
            raise replaced_error(self._location, self._save_id, now, reader=True)


class DistributedFileSystemWriter(FileSystemWriter):
    """DCP's file-system writer with SMP's hooks.

    Args:
        path: The checkpoint directory, an ``s3://`` URI (``fs`` is then ``S3FileSystem``),
            or a ``checkpoint_location``.
        single_file_per_rank: As DCP's ``FileSystemWriter``.
        sync_files: As DCP's ``FileSystemWriter`` (ignored on S3).
        thread_count: As DCP's ``FileSystemWriter``.
        per_thread_copy_ahead: As DCP's ``FileSystemWriter``.
        cache_staged_state_dict: As DCP's ``FileSystemWriter``.
        overwrite: As DCP's ``FileSystemWriter``.
        pre_write_hooks: Called with the writer on every writing rank before it writes its files.
        post_write_hooks: Called with the writer on every writing rank after its files are written.
    """

    def __init__(
        self,
        path: CheckpointId,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        pre_write_hooks: Iterable[WriteHook] | None = None,
        post_write_hooks: Iterable[WriteHook] | None = None,
    ) -> None:
        location = checkpoint_location(path)
        super().__init__(
            ".",
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files and location.syncs_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )
        self.fs = location.file_system()
        self.path = self.fs.init_path(str(location))
        self.pre_write_hooks = list(pre_write_hooks or [])
        self.post_write_hooks = list(post_write_hooks or [])
        self.is_coordinator = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Records whether this rank is DCP's coordinator (it writes the metadata)."""
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Runs the pre-write hooks, DCP's write, then the post-write hooks."""
        for hook in self.pre_write_hooks:
            hook(self)
        future = super().write_data(plan, planner)
        if self.post_write_hooks:
            future.wait()  # the files must exist before the hooks look at them
            for hook in self.post_write_hooks:
                hook(self)
        return future


__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter", "path_to_file_system"]
