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
    root, upcoming = _checkpoint_root(Path(path).absolute(), pattern)
    if not root.is_dir():
        return []
    names = {
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (pattern is None or pattern.match(p.name))
    }
    keep = set()
    if upcoming is not None and upcoming not in names:
        # About to be written (async types): it counts as kept, and the newest complete
        # checkpoint stays until it is, so that a failed save never leaves none.
        existing = sorted(names, key=sort_fn)
        keep = {upcoming, *existing[-1:]}
        names.add(upcoming)
    ordered = sorted(names, key=sort_fn)
    doomed = [name for name in ordered[: max(len(ordered) - num_kept, 0)] if name not in keep]
    deleted = []
    for name in doomed:
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


__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs", "sort_by_last_int"]
