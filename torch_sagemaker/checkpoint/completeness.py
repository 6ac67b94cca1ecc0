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


__all__ = ["is_complete_checkpoint", "part_layout"]
