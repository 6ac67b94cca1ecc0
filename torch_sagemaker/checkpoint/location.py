"""Where a checkpoint lives: one protocol, a local directory or an S3 prefix behind it.

``checkpoint_location`` is the one place that looks at a ``checkpoint_id`` and the S3
options: a directory becomes an ``atomic_dir.LocalDirectory``, an ``s3://`` URI an
``s3_checkpoint.S3Checkpoint``. Saving, loading, retention and ``TrainingState`` then only
call the methods of ``CheckpointLocation``, so a new store is one class and one line here.
Every public function that takes a ``checkpoint_id`` also takes a location made here, which
carries its S3 options and whether checksums are recorded and verified (Note [Checkpoint
checksums] in ``integrity``); SMP's spelling, a string with ``s3_region=`` and
``s3client_config=``, goes through ``checkpoint_location`` unchanged.

A save runs, with the steps of Note [Commit outcome] in ``_commit``: ``prepare`` (the
coordinator), DCP's write into ``write_root`` through ``storage_writer``, ``commit`` (the
coordinator), ``remove_replaced``. A load runs ``read_marker``, ``verify`` (split among the
ranks), then DCP's read of ``data_root`` through ``storage_reader``.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from torch_sagemaker.checkpoint.atomic_dir import LocalDirectory
from torch_sagemaker.checkpoint.completeness import is_complete_checkpoint
from torch_sagemaker.checkpoint.integrity import Written
from torch_sagemaker.checkpoint.s3_checkpoint import S3Checkpoint
from torch_sagemaker.checkpoint.s3_filesystem import is_s3_uri


@runtime_checkable
class CheckpointLocation(Protocol):
    """One checkpoint's storage: how a save is staged and committed, and read back.

    Attributes:
        checksums: Whether saves record each file's checksum and loads verify it.
        syncs_files: Whether DCP's writer may fsync what it writes here.
    """

    checksums: bool
    syncs_files: bool

    @property
    def name(self) -> str:
        """The checkpoint's own name (last path component)."""
        ...

    def child(self, name: str) -> CheckpointLocation:
        """The checkpoint ``name`` inside this one, with the same options."""
        ...

    def parent(self) -> CheckpointLocation | None:
        """What holds this checkpoint (``None`` at the top)."""
        ...

    def prepare(self, save_id: str) -> None:
        """Readies a new save (the coordinator, before any rank writes)."""
        ...

    def write_root(self, save_id: str) -> Any:
        """DCP's ``checkpoint_id`` for the files of save ``save_id``."""
        ...

    def storage_writer(self, save_id: str, thread_count: int = 1) -> Any:
        """The DCP writer used when the caller passes none."""
        ...

    def commit(self, save_id: str, info: dict[str, Any], recorded: Written | None) -> None:
        """Writes the completion marker and makes save ``save_id`` the checkpoint (coordinator).

        Args:
            save_id: The save that wrote ``write_root(save_id)``.
            info: Facts for the marker (kind, layout, ...).
            recorded: Every file the ranks wrote, with the checksums computed while writing
                (``integrity.merge``); ``None`` where a writer could not be followed.

        Raises:
            CheckpointError: If the save's files are not what the ranks wrote (Note
                [Commit what was written] in ``integrity``).
        """
        ...

    def remove_replaced(self, save_id: str) -> None:
        """Deletes what the commit of ``save_id`` replaced (the coordinator)."""
        ...

    def marker_save_id(self) -> str | None:
        """The save id in the marker, if there is a readable one."""
        ...

    def marker_entries(self) -> dict[str, Any]:
        """The marker's fields as written (its file table unchecked); ``{}`` without one."""
        ...

    def subdirs(self) -> list[str]:
        """The names of the directories (on S3, key prefixes) right under it, sorted."""
        ...

    def is_complete(self) -> bool:
        """Whether a committed checkpoint is there."""
        ...

    def where(self) -> str:
        """What the location holds now, in words."""
        ...

    def read_marker(self) -> dict[str, Any]:
        """The marker, after checking that every file it lists exists with its size."""
        ...

    def verify(self, marker: dict[str, Any], names: list[str]) -> list[str]:
        """One line per file of ``names`` whose checksum differs (none when checksums are off)."""
        ...

    def data_root(self, marker: dict[str, Any] | None = None) -> Any:
        """DCP's ``checkpoint_id`` for the committed files."""
        ...

    def storage_reader(self, marker: dict[str, Any], given: Any = None) -> Any:
        """The DCP reader of the committed files (``given``: the caller's, where usable)."""
        ...

    def file_system(self) -> Any:
        """DCP's ``FileSystem`` over this location's storage."""
        ...

    def checkpoint_names(self) -> set[str]:
        """The checkpoints this location holds that retention counts."""
        ...

    def remove(self) -> None:
        """Deletes the checkpoint."""
        ...


CheckpointId = str | os.PathLike[str] | CheckpointLocation
"""What public functions accept as ``checkpoint_id``."""


def checkpoint_location(
    checkpoint_id: CheckpointId | None,
    s3_region: str | None = None,
    s3client_config: Any = None,
    *,
    checksums: bool = True,
    container: bool = False,
) -> CheckpointLocation:
    """The location of ``checkpoint_id``: an S3 prefix for ``s3://`` URIs, else a directory.

    Args:
        checkpoint_id: A directory, an ``s3://bucket/prefix`` URI, or a location (returned
            as it is).
        s3_region: Region of an ``s3://`` checkpoint's bucket; default ``AWS_REGION``, else
            the bucket's (Note [S3 endpoint and credentials] in ``s3_filesystem``).
        s3client_config: An ``s3torchconnector.S3ClientConfig`` for ``s3://`` checkpoints.
        checksums: Record a checksum of every file on save and verify them on load (Note
            [Checkpoint checksums]); ``False`` records and checks sizes only.
        container: The location holds checkpoints rather than being one (retention's
            root), so an ``s3://`` URI may name a whole bucket.

    Raises:
        ValueError: If ``checkpoint_id`` is ``None``, a bare bucket (unless ``container``),
            or a location given together with S3 options or ``checksums=False`` (they
            belong to the location).
    """
    if isinstance(checkpoint_id, CheckpointLocation):
        if s3_region is not None or s3client_config is not None or not checksums:
            raise ValueError(
                f"checkpoint_id={checkpoint_id!r} is already a location, with its own options; "
                "pass s3_region, s3client_config and checksums to checkpoint_location() "
                "instead."
            )
        return checkpoint_id
    if is_s3_uri(checkpoint_id):
        return S3Checkpoint(
            str(checkpoint_id),
            s3_region,
            s3client_config,
            checksums=checksums,
            container=container,
        )
    if checkpoint_id is None:
        raise ValueError("checkpoint_id is required: pass the checkpoint directory.")
    return LocalDirectory(checkpoint_id, checksums=checksums)


def is_complete(checkpoint_id: CheckpointId) -> bool:
    """Whether ``checkpoint_id`` (a directory, an ``s3://`` URI or a location) is complete.

    A ``TrainingState`` checkpoint saved in per-TP/EP-rank parts (FSDP1 with tensor or
    expert parallelism) is complete once every part is (``completeness``).
    """
    return is_complete_checkpoint(checkpoint_location(checkpoint_id))


__all__ = ["CheckpointId", "CheckpointLocation", "checkpoint_location", "is_complete"]
