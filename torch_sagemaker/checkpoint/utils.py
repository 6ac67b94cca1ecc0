"""Checkpoint retention (``torch.sagemaker.checkpoint.utils``)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from torch_sagemaker.checkpoint.constants import REPLACED_SUFFIX, STAGING_SUFFIX
from torch_sagemaker.logger import get_logger

_INT = re.compile(r"\d+")


def sort_by_last_int(name: str) -> tuple[int, str]:
    """Sort key: the last integer in ``name`` (``llama-1200steps`` -> 1200), then the name."""
    numbers = _INT.findall(name)
    return (int(numbers[-1]) if numbers else -1, name)


SORT_BY_LAST_INT = sort_by_last_int
"""The default ``sort_fn`` of ``limit_num_subdirs``."""


def limit_num_subdirs(path: str | os.PathLike[str], num_kept: int | None,
                      sort_fn: Callable[[str], object] = SORT_BY_LAST_INT, regex: str = r".*",
                      log: bool = True) -> list[str]:
    """Deletes all but the newest ``num_kept`` checkpoint directories under ``path``.

    Call it on one rank after a save completed. Hidden directories (a save in progress or
    interrupted, ``.<name>.partial``) are never counted; those of deleted checkpoints go too.

    Args:
        path: The directory holding one subdirectory per checkpoint.
        num_kept: How many to keep (the last ones by ``sort_fn``); ``None`` keeps all.
        sort_fn: Key of a subdirectory name; larger is newer. Default: its last integer.
        regex: Only subdirectories whose name matches it (``re.match``) are considered,
            e.g. ``r"^.*\\d+steps$"``.
        log: Log each deletion.

    Returns:
        The deleted directories.

    Raises:
        ValueError: If ``num_kept`` is negative.
    """
    if num_kept is None:
        return []
    if num_kept < 0:
        raise ValueError(f"num_kept={num_kept} must be >= 0 (or None to keep everything).")
    root = Path(path)
    if not root.is_dir():
        return []
    pattern = re.compile(regex)
    names = sorted((p.name for p in root.iterdir()
                    if p.is_dir() and not p.name.startswith(".") and pattern.match(p.name)),
                   key=sort_fn)
    doomed = names[: max(len(names) - num_kept, 0)]
    deleted = []
    for name in doomed:
        for victim in (root / name, root / f".{name}{STAGING_SUFFIX}", root / f".{name}{REPLACED_SUFFIX}"):
            if victim.exists():
                shutil.rmtree(victim, ignore_errors=True)
        deleted.append(str(root / name))
        if log:
            get_logger().info(f"checkpoint retention: deleted {root / name} (keeping {num_kept})")
    return deleted


__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs", "sort_by_last_int"]
