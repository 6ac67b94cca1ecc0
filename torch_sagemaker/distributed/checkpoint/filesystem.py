"""File-system storage for checkpoints (``torch.sagemaker.distributed.checkpoint.filesystem``).

SMP's scripts load async checkpoints with ``load(..., storage_reader=
DistributedFileSystemReader(path))``. Both classes here are PyTorch DCP's file-system
storage with SMP's names and keywords: the reader is DCP's ``FileSystemReader``; the writer
is DCP's ``FileSystemWriter`` plus SMP's write hooks and ``is_coordinator``. S3 paths are
not supported (no network here); ``path_to_file_system`` says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

#: A write hook: called with the writer (``writer.path``, ``writer.is_coordinator``, ``writer.fs``).
WriteHook = Callable[["DistributedFileSystemWriter"], None]


def path_to_file_system(path: str | os.PathLike[str]) -> FileSystem:
    """The DCP file system that stores ``path``.

    Raises:
        ValueError: For ``s3://`` paths (S3 is not supported here).
    """
    if os.fspath(path).startswith("s3://"):
        raise ValueError(
            f"{os.fspath(path)!r}: S3 checkpoints are not supported; write to a local "
            "or shared file system and upload the directory afterwards."
        )
    return FileSystem()


class DistributedFileSystemReader(FileSystemReader):
    """Reads a checkpoint directory written by DCP (every rank reads the pieces it needs).

    Args:
        path: The checkpoint directory (``.path`` afterwards, as SMP's loader reads it).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path_to_file_system(path)
        super().__init__(path)


class DistributedFileSystemWriter(FileSystemWriter):
    """DCP's file-system writer with SMP's hooks.

    Args:
        path: The checkpoint directory.
        single_file_per_rank: As DCP's ``FileSystemWriter``.
        sync_files: As DCP's ``FileSystemWriter``.
        thread_count: As DCP's ``FileSystemWriter``.
        per_thread_copy_ahead: As DCP's ``FileSystemWriter``.
        cache_staged_state_dict: As DCP's ``FileSystemWriter``.
        overwrite: As DCP's ``FileSystemWriter``.
        pre_write_hooks: Called with the writer on every writing rank before it writes its files.
        post_write_hooks: Called with the writer on every writing rank after its files are written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        pre_write_hooks: Iterable[WriteHook] | None = None,
        post_write_hooks: Iterable[WriteHook] | None = None,
    ) -> None:
        path_to_file_system(path)
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )
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
