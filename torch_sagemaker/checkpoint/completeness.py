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
    "TRAINING_KINDS",
    "checkpoint_kind",
    "inside_checkpoint_hint",
    "is_complete_checkpoint",
    "part_layout",
    "parts_description",
]
