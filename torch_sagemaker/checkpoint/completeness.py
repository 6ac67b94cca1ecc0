"""Whether a checkpoint is complete, for checkpoints committed whole or in per-rank parts.

A save commits one directory (or S3 prefix) and marks it complete (Note [Checkpoint commit
protocol] in ``atomic_dir``). ``TrainingState`` of an FSDP1 model with tensor or expert
parallelism instead writes one checkpoint per TP or EP rank inside the step's directory
(``tp{d}-{r}`` or ``ep{d}-{r}``, as SMP's scripts do), each committed by its own group: the
step's directory is complete once all ``d`` of them are.
"""

from __future__ import annotations

import re
from typing import Any

_PART = re.compile(r"^(tp|ep)(\d+)-(\d+)$")
_SM_LOCAL_SHARD = re.compile(r"^tp\d+_ep\d+_fsdp\d+$")

TRAINING_KINDS = frozenset({"sharded", "sm_local"})
"""The marker kinds of training checkpoints (``state_dict_saver``), the ones retention manages.

A per-rank part (``tp{d}-{r}``, ``ep{d}-{r}``) is a sharded checkpoint of its own; a
``save_hf_checkpoint`` export is ``"hugging_face"`` (Note [Retention deletes only training
checkpoints] in ``retention``).
"""


def is_complete_checkpoint(location: Any) -> bool:
    """Whether ``location`` (a ``CheckpointLocation``) holds a complete checkpoint.

    Complete: committed itself, or holding the ``tp{d}-{r}`` (or ``ep{d}-{r}``) parts of
    one degree ``d``, every ``r`` in ``0 .. d-1`` committed. Parts of two degrees (a step
    saved again under another layout) are not one checkpoint. An SM-local checkpoint (one
    ``tp{r}_ep{r}_fsdp{r}`` directory per shard, each committed alone, no marker over the
    set) counts when every shard directory it holds is committed: how many there should be
    is not checked.

    Args:
        location: A ``CheckpointLocation``.

    Returns:
        Whether it is complete.
    """
    if location.is_complete():
        return True
    names = location.checkpoint_names()
    shards = [n for n in names if _SM_LOCAL_SHARD.match(n)]
    if shards:
        return all(location.child(n).is_complete() for n in shards)
    degrees: dict[tuple[str, int], set[int]] = {}
    for name in names:
        match = _PART.match(name)
        if match:
            degrees.setdefault((match[1], int(match[2])), set()).add(int(match[3]))
    if len(degrees) != 1:
        return False
    (((family, degree), ranks),) = degrees.items()
    return ranks == set(range(degree)) and all(
        location.child(f"{family}{degree}-{r}").is_complete() for r in range(degree)
    )


def checkpoint_kind(location: Any) -> str | None:
    """The kind of checkpoint ``location`` (a ``CheckpointLocation``) holds, as its markers say.

    Its own marker's kind; for a checkpoint in committed parts (per-TP/EP-rank parts, or
    SM-local shard directories), the kind of its first committed part, since one save wrote
    them all. Only markers are read, not the files they list.

    Args:
        location: A ``CheckpointLocation``.

    Returns:
        ``"sharded"``, ``"sm_local"``, ``"hugging_face"`` (``TRAINING_KINDS`` are the first
        two), or ``None``: no marker (a directory that is not a committed checkpoint, such as
        SMP's ``torch.save`` checkpoints), or one that is unreadable or names no kind.
    """
    if location.is_complete():  # checked first: on S3, reading a missing marker is retried
        return location.marker_kind()
    names = location.checkpoint_names()
    shards = sorted(n for n in names if _SM_LOCAL_SHARD.match(n))
    parts = shards or sorted(n for n in names if _PART.match(n))
    for name in parts:
        part = location.child(name)
        if part.is_complete():
            return part.marker_kind()
    return None


def part_layout(names: list[str]) -> str | None:
    """How a directory with the subdirectories ``names`` is split into committed parts.

    Returns:
        ``"sm_local"`` (``tp{r}_ep{r}_fsdp{r}`` shard directories), ``"tp{d}"`` or ``"ep{d}"``
        (the per-rank parts of one degree ``d``), or ``None`` (none of these).
    """
    if any(_SM_LOCAL_SHARD.match(n) for n in names):
        return "sm_local"
    degrees = {(m[1], int(m[2])) for n in names if (m := _PART.match(n))}
    if len(degrees) == 1:
        ((family, degree),) = degrees
        return f"{family}{degree}"
    return None


__all__ = ["TRAINING_KINDS", "checkpoint_kind", "is_complete_checkpoint", "part_layout"]
