"""Checkpoint retention: keep the newest ``num_kept`` checkpoint directories, delete the rest.

SMP exposes this as ``torch.sagemaker.checkpoint.utils``, which re-exports this module.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from torch_sagemaker.distributed.checkpoint.constants import REPLACED_SUFFIX, STAGING_SUFFIX
from torch_sagemaker.distributed.checkpoint.s3_filesystem import (
    format_s3_path,
    is_s3_uri,
    join_s3,
    parse_s3_uri,
)
from torch_sagemaker.logger import get_logger

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison  # what sorted() accepts as a key

_INT = re.compile(r"\d+")


def sort_by_last_int(name: str) -> tuple[int, str]:
    """Sort key: the last integer in ``name`` (``llama-1200steps`` -> 1200), then the name."""
    numbers = _INT.findall(name)
    return (int(numbers[-1]) if numbers else -1, name)


SORT_BY_LAST_INT = sort_by_last_int
"""The default ``sort_fn`` of ``limit_num_subdirs``."""


def _checkpoint_root(path: Path, pattern: re.Pattern[str] | None) -> tuple[Path, str | None]:
    """The directory holding the checkpoints, and the checkpoint ``path`` names (if any)."""
    if pattern is None:
        return path, None
    for candidate in (path, *path.parents):
        if candidate.name and pattern.match(candidate.name):
            return candidate.parent, candidate.name
    return path, None


def limit_num_subdirs(
    path: str | os.PathLike[str],
    num_kept: int | None,
    sort_fn: Callable[[str], SupportsRichComparison] = SORT_BY_LAST_INT,
    regex: str | None = None,
    log: bool = True,
) -> list[str]:
    r"""Deletes all but the newest ``num_kept`` checkpoint directories.

    SMP's example scripts call it with the new checkpoint's own folder (possibly a per-TP-rank
    subfolder such as ``/ckpt/llama_v2-100steps/tp2-0``), ``regex=r"^.*\d+steps$"`` and
    ``log=(rank == 0)``; the rank passing ``log=True`` logs and deletes, the others return at
    once. The ``sharded`` type calls it right after the save; the async types call it just
    before writing the new checkpoint, whose folder does not exist yet: a checkpoint named
    by ``path`` counts as one of the ``num_kept`` whether or not it exists, so that either
    way ``num_kept`` checkpoints remain once the save is done. The newest complete checkpoint
    is never deleted before the new one exists (with ``num_kept=1`` the async types keep two
    until their next call), so a save that fails still leaves one to resume from.

    Hidden directories (a save in progress or interrupted, ``.<name>.partial``) are never
    counted; those of deleted checkpoints go too.

    ``path`` may be an ``s3://`` URI: the checkpoints are then the key prefixes under the
    root, and a deleted checkpoint loses its completion marker first, so that a deletion cut
    short never leaves a checkpoint that looks complete (Note [S3 checkpoint layout]).

    Args:
        path: With ``regex``: the directory holding the checkpoints, or a checkpoint directory
            (its name matches ``regex``) or a directory inside one; the checkpoints are then
            the siblings of the nearest such directory. Without ``regex``: the directory
            holding the checkpoints, every subdirectory of which counts.
        num_kept: How many to keep (the last ones by ``sort_fn``); ``None`` keeps all.
        sort_fn: Key of a subdirectory name; larger is newer. Default: its last integer.
        regex: Names of checkpoint directories (``re.match``), e.g. ``r"^.*\d+steps$"``.
        log: Whether this rank acts: it logs each deletion and deletes. ``False`` does nothing
            (so that one rank of a job deletes, as in SMP's scripts).

    Returns:
        The deleted directories (empty where ``log`` is ``False``).

    Raises:
        ValueError: If ``num_kept`` is negative.
    """
    if num_kept is None:
        return []
    if num_kept < 0:
        raise ValueError(f"num_kept={num_kept} must be >= 0 (or None to keep everything).")
    if not log:
        return []
    pattern = re.compile(regex) if regex is not None else None
    if is_s3_uri(os.fspath(path)):
        return _limit_s3(os.fspath(path), num_kept, sort_fn, pattern)
    root, upcoming = _checkpoint_root(Path(path).absolute(), pattern)
    if not root.is_dir():
        return []
    names = {
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (pattern is None or pattern.match(p.name))
    }
    deleted = []
    for name in _doomed(names, upcoming, num_kept, sort_fn):
        for victim in (
            root / name,
            root / f".{name}{STAGING_SUFFIX}",
            root / f".{name}{REPLACED_SUFFIX}",
        ):
            if victim.exists():
                shutil.rmtree(victim, ignore_errors=True)
        deleted.append(str(root / name))
        get_logger().info(f"checkpoint retention: deleted {root / name} (keeping {num_kept})")
    return deleted


def _doomed(
    names: set[str],
    upcoming: str | None,
    num_kept: int,
    sort_fn: Callable[[str], SupportsRichComparison],
) -> list[str]:
    """The checkpoints to delete among ``names`` (see ``limit_num_subdirs``)."""
    keep = set()
    if upcoming is not None and upcoming not in names:
        # About to be written (async types): it counts as kept, and the newest complete
        # checkpoint stays until it is, so that a failed save never leaves none.
        existing = sorted(names, key=sort_fn)
        keep = {upcoming, *existing[-1:]}
        names = {*names, upcoming}
    ordered = sorted(names, key=sort_fn)
    return [name for name in ordered[: max(len(ordered) - num_kept, 0)] if name not in keep]


def _s3_root(uri: str, pattern: re.Pattern[str] | None) -> tuple[str, str | None]:
    """``_checkpoint_root`` for an ``s3://`` URI."""
    uri = format_s3_path(uri)
    if pattern is not None:
        bucket, key = parse_s3_uri(uri)
        parts = key.split("/") if key else []
        for i in range(len(parts), 0, -1):
            if pattern.match(parts[i - 1]):
                return format_s3_path(bucket, "/".join(parts[: i - 1])), parts[i - 1]
    return uri, None


def _limit_s3(
    uri: str,
    num_kept: int,
    sort_fn: Callable[[str], SupportsRichComparison],
    pattern: re.Pattern[str] | None,
) -> list[str]:
    """``limit_num_subdirs`` on S3: the "directories" are the key prefixes under the root."""
    from torch_sagemaker.distributed.checkpoint import s3_checkpoint

    root, upcoming = _s3_root(uri, pattern)
    # Only complete checkpoints count and can be deleted. A prefix without its completion
    # marker is a save that failed or is still running (on a file system it would be a
    # hidden staging directory): counting it could make it "the newest", kept in place of
    # the last complete one, which would then be deleted.
    names = {
        name
        for name in s3_checkpoint.list_subdirs(root)
        if not name.startswith(".")
        and (pattern is None or pattern.match(name))
        and name != upcoming
        and s3_checkpoint.S3Checkpoint(join_s3(root, name)).is_complete()
    }
    deleted = []
    for name in _doomed(names, upcoming, num_kept, sort_fn):
        victim = join_s3(root, name)
        s3_checkpoint.delete_prefix(victim)
        deleted.append(victim)
        get_logger().info(f"checkpoint retention: deleted {victim} (keeping {num_kept})")
    return deleted


__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs", "sort_by_last_int"]
