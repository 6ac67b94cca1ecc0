"""Checkpoint retention: keep the newest ``num_kept`` checkpoint directories, delete the rest.

SMP exposes this as ``torch.sagemaker.checkpoint.utils``, which re-exports this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch_sagemaker.checkpoint.completeness import (
    TRAINING_KINDS,
    checkpoint_kind,
    is_complete_checkpoint,
)
from torch_sagemaker.checkpoint.location import (
    CheckpointId,
    CheckpointLocation,
    checkpoint_location,
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


def _checkpoint_root(
    path: CheckpointLocation, pattern: re.Pattern[str] | None
) -> tuple[CheckpointLocation, str | None]:
    """The location holding the checkpoints, and the checkpoint ``path`` names (if any)."""
    if pattern is None:
        return path, None
    candidate: CheckpointLocation | None = path
    while candidate is not None:
        parent = candidate.parent()
        if parent is not None and candidate.name and pattern.match(candidate.name):
            return parent, candidate.name
        candidate = parent
    return path, None


def limit_num_subdirs(
    path: CheckpointId,
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
    way ``num_kept`` checkpoints remain once the save is done. Neither that checkpoint nor
    the newest complete one (``is_complete``) is ever deleted (Note [What retention keeps]):
    with ``num_kept=1`` the async types keep two until their next call, so a save that
    fails still leaves one to resume from.

    Which checkpoints count is the location's (``CheckpointLocation.checkpoint_names``). In a
    directory, hidden directories (a save in progress or interrupted, ``.<name>.partial``)
    are never counted; those of deleted checkpoints go too. A directory whose completion
    marker names another kind than a training checkpoint (a ``save_hf_checkpoint`` export)
    is never counted nor deleted, whatever ``regex`` matches (Note [Retention deletes only
    training checkpoints]). ``path`` may be an ``s3://`` URI:
    the checkpoints are then the complete key prefixes under the root (a prefix without its
    marker is a save that failed or is running), and a deleted checkpoint loses its
    completion marker first, so that a deletion cut short never leaves a checkpoint that
    looks complete (Note [S3 checkpoint layout]).

    Args:
        path: A directory, ``s3://`` URI or ``checkpoint_location``. With ``regex``: the
            directory holding the checkpoints, or a checkpoint directory
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
    root, upcoming = _checkpoint_root(checkpoint_location(path, container=True), pattern)
    return _prune(root, upcoming, num_kept, sort_fn, pattern, only_complete=False)


def prune_beside(
    checkpoint: CheckpointLocation, num_kept: int | None, regex: str | None = None
) -> list[str]:
    """``limit_num_subdirs`` of ``checkpoint``'s complete siblings, never deleting ``checkpoint``.

    Only complete training checkpoints count, and only they are deleted (Note [What retention
    keeps], Note [Retention deletes only training checkpoints]).

    ``TrainingState.save`` calls it after a save (the rank that commits).

    Args:
        checkpoint: The checkpoint just saved.
        num_kept: How many to keep (``None``: all).
        regex: Names of the siblings that count (``re.match``; default: all).

    Returns:
        The deleted checkpoints.

    Raises:
        ValueError: If ``num_kept`` is negative.
    """
    root = checkpoint.parent()
    if num_kept is None or root is None:
        return []
    if num_kept < 0:
        raise ValueError(f"num_kept={num_kept} must be >= 0 (or None to keep everything).")
    pattern = re.compile(regex) if regex is not None else None
    return _prune(root, checkpoint.name, num_kept, SORT_BY_LAST_INT, pattern, only_complete=True)


def _prune(
    root: CheckpointLocation,
    upcoming: str | None,
    num_kept: int,
    sort_fn: Callable[[str], SupportsRichComparison],
    pattern: re.Pattern[str] | None,
    only_complete: bool,
) -> list[str]:
    """Deletes what ``_doomed`` picks among the checkpoints under ``root``.

    Note [Retention deletes only training checkpoints]: a directory beside the checkpoints
    may itself carry a completion marker without being one of them: ``save_hf_checkpoint``
    commits its export the same way (kind ``"hugging_face"``), and its name, with no
    number in it, sorts oldest. Counted, it would be the first deleted (the only copy of
    the model in Hugging Face form) and take one of the ``num_kept`` places. So the
    marker's kind decides (``completeness.checkpoint_kind``):

    - ``prune_beside`` counts a sibling only if it is complete and its kind is one of
      ``TRAINING_KINDS``; a marker that is unreadable or names no kind does not count
      either: when unsure, keep.
    - ``limit_num_subdirs`` counts directories without a marker, as SMP does (its scripts'
      ``full`` and ``local`` checkpoints have none), but never one whose marker names a kind
      that is not a training checkpoint, even where ``regex`` matches its name.

    Checked the same way on S3 (one marker read per candidate). ``is_complete`` is left
    as it is: an export is complete, it is just not retention's to delete.
    """

    def complete(name: str) -> bool:
        return is_complete_checkpoint(root.child(name))

    names = {n for n in root.checkpoint_names() if pattern is None or pattern.match(n)}
    if only_complete:  # Note [What retention keeps]
        names = {
            n for n in names if complete(n) and checkpoint_kind(root.child(n)) in TRAINING_KINDS
        }
    else:
        names = {n for n in names if checkpoint_kind(root.child(n)) in (None, *TRAINING_KINDS)}
    deleted = []
    for name in _doomed(names, upcoming, num_kept, sort_fn, complete):
        victim = root.child(name)
        victim.remove()
        deleted.append(str(victim))
        get_logger().info(f"checkpoint retention: deleted {victim} (keeping {num_kept})")
    return deleted


def _doomed(
    names: set[str],
    upcoming: str | None,
    num_kept: int,
    sort_fn: Callable[[str], SupportsRichComparison],
    complete: Callable[[str], bool],
) -> list[str]:
    """The checkpoints to delete among ``names`` (see ``limit_num_subdirs``).

    Note [What retention keeps]: the newest ``num_kept`` by ``sort_fn`` stay, and two more
    whatever their rank: the checkpoint being saved (``upcoming``: it counts as kept whether
    or not it exists yet, so async saves, which prune before writing, end with ``num_kept``),
    and the newest *complete* checkpoint (``complete``). So a save that fails, one whose
    per-rank parts other groups are still committing, a directory a crashed run left
    unfinished under a higher step, or a resumed run that rolled back past newer
    checkpoints never leaves the job without one to resume from, and never deletes what it
    just saved. Which directories are candidates depends on the caller:

    - ``TrainingState.save(..., num_kept)`` (``prune_beside``) writes only checkpoints with
      markers, so only complete training checkpoints count and can be deleted: a directory
      that is not a checkpoint (a ``tensorboard/`` beside them, with no ``regex`` to exclude
      it) or is another kind of one (a Hugging Face export) is never deleted, and an
      unfinished one takes none of the ``num_kept`` places (it would leave fewer
      checkpoints to resume from than asked for).
    - ``limit_num_subdirs``, SMP's function, counts every subdirectory ``regex`` matches (or
      every one, without it), as SMP does: SMP's scripts call it for their ``full`` and
      ``local`` checkpoints too, which ``torch.save`` writes without a marker. Only a
      directory whose marker names another kind is left out (Note [Retention deletes only
      training checkpoints]).

    One gap: an SM-local step written before markers recorded their save's number of parts
    counts as complete once the shard directories it holds are committed, however many
    there should be (``completeness``); newer ones are counted against ``num_parts``.
    """
    if upcoming is not None:
        names = {*names, upcoming}
    ordered = sorted(names, key=sort_fn)
    doomed = ordered[: max(len(ordered) - num_kept, 0)]
    if not doomed:
        return []
    newest_complete = next((n for n in reversed(ordered) if complete(n)), None)
    keep = {upcoming, newest_complete}
    return [name for name in doomed if name not in keep]


__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs", "prune_beside", "sort_by_last_int"]
