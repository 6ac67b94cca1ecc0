"""Whether a checkpoint is complete, for checkpoints committed whole or in per-rank parts.

A save commits one directory (or S3 prefix) and marks it complete (Note [Checkpoint commit
protocol] in ``atomic_dir``). ``TrainingState`` of an FSDP1 model with tensor or expert
parallelism instead writes one checkpoint per TP or EP rank inside the step's directory
(``tp{d}-{r}`` or ``ep{d}-{r}``, as SMP's scripts do), each committed by its own group: the
step's directory is complete once all ``d`` of them are.

Note [The parts of one checkpoint come from one save]
-----------------------------------------------------
Each part (a ``tp{d}-{r}``/``ep{d}-{r}`` part, an SM-local ``tp*_ep*_fsdp*`` shard
directory) is committed by its own group, with a save id of its own. A step saved again
under the same name (after a rollback, or a fixed name such as "latest") in which one group
committed and another died before its commit holds parts of two saves, each with a marker:
by markers alone the step is complete, and each group would load its own part, half the
model from one save and half from the other. So ``TrainingState.save`` agrees on one id for
the whole save over the world before any part is written, and every part's marker records
it (``WHOLE_SAVE_ID``) with the number of parts the save writes (``NUM_PARTS``).
``parts_problem`` refuses parts whose ids differ, a count that differs from the parts
found, and a directory holding both a whole checkpoint and parts (a save of one layout
into a directory committed by a save of the other: each load would pick one of the two,
maybe the stale one). ``is_complete_checkpoint`` then says "not complete", so "latest" and
retention pass it by, and ``TrainingState.load`` raises on every rank naming the parts.
Markers written before these fields existed carry neither: a set of parts none of whose
markers has ``WHOLE_SAVE_ID`` is judged as before (every part committed; the count of
SM-local shards unchecked), so those checkpoints still load. A set in which only some
parts carry one mixes an old save with a new one, and is refused.
"""

from __future__ import annotations

import re
from typing import Any

_PART = re.compile(r"^(tp|ep)(\d+)-(\d+)$")
_SM_LOCAL_SHARD = re.compile(r"^tp\d+_ep\d+_fsdp\d+$")

WHOLE_SAVE_ID = "whole_save_id"
"""Marker field: the id ``TrainingState.save`` shares among all parts of one save."""
NUM_PARTS = "num_parts"
"""Marker field: how many parts (directories committed separately) that save writes."""

PARTS_FIX = (
    "Load an earlier checkpoint; to use this one, save it again (every rank) under a fresh "
    "name, or delete the stale directories."
)
"""The fix that errors about parts of different saves name."""

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
    set) counts when every shard directory it holds is committed and, where the markers
    record them, all come from one save and are as many as it wrote. Parts of two saves, or
    parts beside a whole checkpoint, are not complete (Note [The parts of one checkpoint
    come from one save]).

    Args:
        location: A ``CheckpointLocation``.

    Returns:
        Whether it is complete.
    """
    whole = location.is_complete()
    # The subdirectories as listed, not ``checkpoint_names`` (which on S3 asks each one
    # whether it is complete): a whole checkpoint is listed too, for parts beside it.
    parts = part_names(location.subdirs())
    if whole:
        # A whole checkpoint with committed parts beside it holds two saves.
        return not any(location.child(n).is_complete() for n in parts)
    if not parts:
        return False
    if not any(_SM_LOCAL_SHARD.match(n) for n in parts):
        degrees = {(m[1], int(m[2])) for n in parts if (m := _PART.match(n))}
        if len(degrees) != 1:
            return False
        ((family, degree),) = degrees
        if set(parts) != {f"{family}{degree}-{r}" for r in range(degree)}:
            return False
    if not all(location.child(n).is_complete() for n in parts):
        return False
    return parts_problem(location, parts) is None


def part_names(names: set[str] | list[str]) -> list[str]:
    """The parts among a location's subdirectories ``names``, sorted.

    The SM-local shard directories if there are any, else the per-TP/EP-rank parts.
    """
    shards = sorted(n for n in names if _SM_LOCAL_SHARD.match(n))
    return shards or sorted(n for n in names if _PART.match(n))


def parts_problem(location: Any, parts: list[str] | None = None) -> str | None:
    """Why the committed parts in ``location`` are not one save's, or ``None`` if they are.

    Note [The parts of one checkpoint come from one save]. Reads the markers of the
    committed parts (one read each) and whether ``location`` itself is committed.

    Args:
        location: A ``CheckpointLocation`` holding a checkpoint in parts.
        parts: Its part names (``part_names``); default: listed here.

    Returns:
        The words after "checkpoint <location>" in an error (they name the parts, their
        save ids and the fix), or ``None``.
    """
    if parts is None:
        parts = part_names(location.subdirs())
    found = {}
    for name in parts:
        child = location.child(name)
        if child.is_complete():
            marker = child.marker_entries()
            found[name] = (marker.get(WHOLE_SAVE_ID), marker.get(NUM_PARTS))
    if not found:
        return None
    fix = PARTS_FIX
    if location.is_complete():
        return (
            f"holds both a complete checkpoint of the whole model and per-rank parts "
            f"{sorted(found)}, from two saves of different layouts: a load of either kind "
            f"could read the stale one. {fix}"
        )
    ids = {whole_id for whole_id, _ in found.values()}
    if ids == {None}:
        return None  # written before whole-save ids: judged by the markers alone, as before
    if len(ids) > 1:
        shown = ", ".join(
            f"{n} (save {i or 'of an older version, without an id'})"
            for n, (i, _) in sorted(found.items())
        )
        return (
            f"holds parts written by different saves ({shown}): a save of this name stopped "
            "after some parts were committed, so the others are an older save's, and "
            f"loading them together would mix the two. {fix}"
        )
    counts = {count for _, count in found.values()}
    if len(counts) == 1 and isinstance(count := next(iter(counts)), int) and count != len(found):
        return (
            f"holds {len(found)} committed parts {sorted(found)} of save {ids.pop()}, "
            f"which wrote {count}: the others were not committed, or were deleted. {fix}"
        )
    return None


def marker_kind(location: Any) -> str | None:
    """The kind ``location``'s own marker names.

    ``"sharded"``, ``"sm_local"`` or ``"hugging_face"``; ``None`` without a readable marker, or
    one that names no kind.
    """
    kind = location.marker_entries().get("kind")
    return kind if isinstance(kind, str) else None


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
        return marker_kind(location)
    names = location.checkpoint_names()
    shards = sorted(n for n in names if _SM_LOCAL_SHARD.match(n))
    parts = shards or sorted(n for n in names if _PART.match(n))
    for name in parts:
        part = location.child(name)
        if part.is_complete():
            return marker_kind(part)
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


def parts_description(names: list[str]) -> str | None:
    """What a location without a marker of its own holds, when its parts carry the markers.

    The words after "checkpoint <path>" in the error of a load that looked for a marker at
    the top: a checkpoint saved in parts is not incomplete, it is of another kind than the
    one asked for. The same on a file system and on S3.

    Args:
        names: The location's subdirectories (on S3, key prefixes).

    Returns:
        The sentence, naming the kind and how to load it; ``None`` when ``names`` are not
        the parts of a checkpoint (``part_layout``).
    """
    layout = part_layout(names)
    if layout == "sm_local":
        return (
            "holds an SM-local checkpoint (one tp<r>_ep<r>_fsdp<r> directory per shard, "
            "each committed alone), which has no marker of its own: load it with "
            "kind='local', on the layout that saved it."
        )
    if layout is not None:
        return (
            f"holds the per-rank parts ({layout}-<r>) that TrainingState writes for an FSDP1 "
            "model with tensor or expert parallelism: load it under FSDP1 with the same "
            "tensor (or expert) parallel degree, and the parts are found; to change the "
            "layout, save it from FSDP2 (torch_sagemaker.sharding.shard_model) instead."
        )
    return None


def inside_checkpoint_hint(parent: object, parent_kind: str | None, name: str) -> str:
    """Why a load found no checkpoint ``name`` inside the complete checkpoint ``parent``.

    A load looks inside the checkpoint it is given in two cases: an FSDP1 model with tensor
    or expert parallelism reads its rank's part ``tp{d}-{r}`` (or ``ep{d}-{r}``), and an
    SM-local load reads its shard's directory ``tp{r}_ep{r}_fsdp{r}``. Either way the
    checkpoint given was saved whole, so the fix depends on which of the two looked.

    Args:
        parent: The complete checkpoint (for the message).
        parent_kind: The kind its marker names (``None`` if it names none).
        name: What the load looked for inside it.

    Returns:
        The sentence to append to "checkpoint <parent>/<name> does not exist.".
    """
    if parent_kind == "hugging_face":
        return (
            f" {parent} is a Hugging Face export (save_hf_checkpoint), not a training "
            "checkpoint: read it with transformers' from_pretrained, and resume training "
            "from a checkpoint of TrainingState.save."
        )
    if parent_kind == "sm_local":
        return (
            f" {parent} is itself the directory of one shard of an SM-local checkpoint: load "
            "the directory that holds the shard directories, with kind='local'."
        )
    what = "a complete checkpoint" + (f" (kind {parent_kind!r})" if parent_kind else "")
    if _PART.match(name):
        return (
            f" {parent} is itself {what} of the whole model, not one saved in per-rank parts: "
            f"{name} is the part an FSDP1 model with tensor or expert parallelism reads (its "
            "shards hold TP-/EP-local tensors, so it loads only the parts saved under the "
            f"same degree). Load {parent} into a model sharded by FSDP2 "
            "(torch_sagemaker.sharding.shard_model), which reads any layout, or under FSDP1 "
            "without tensor and expert parallelism."
        )
    if _SM_LOCAL_SHARD.match(name):
        return (
            f" {parent} is itself {what}, not an SM-local one: {name} is the shard directory "
            "an SM-local load looks for. Load it with the kind it was saved as "
            "(kind='sharded', the default)."
        )
    return f" {parent} is itself {what}: load {parent} instead."


__all__ = [
    "marker_kind",
    "NUM_PARTS",
    "PARTS_FIX",
    "TRAINING_KINDS",
    "WHOLE_SAVE_ID",
    "checkpoint_kind",
    "inside_checkpoint_hint",
    "is_complete_checkpoint",
    "part_layout",
    "part_names",
    "parts_problem",
    "parts_description",
]
