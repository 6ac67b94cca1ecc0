"""Loading checkpoints (``torch.sagemaker.distributed.checkpoint.state_dict_loader``).

``load`` refuses a checkpoint that is missing, unfinished, truncated (its location's
``read_marker``, ``location``) or whose
bytes changed since the save (Note [Checkpoint checksums] in ``integrity``), or that ranks
of one load name differently (Note [The ranks of a load read one checkpoint]), then compares
what is asked for with what the checkpoint holds and reports every missing key and every
shape mismatch at once, before PyTorch DCP reads anything. DCP then reads each rank's pieces
of the saved tensors, whatever layout wrote them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from torch_sagemaker._torch_compat import dcp as dcp_compat
from torch_sagemaker.checkpoint import integrity
from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader
from torch_sagemaker.checkpoint.location import (
    CheckpointId,
    CheckpointLocation,
    checkpoint_location,
)
from torch_sagemaker.checkpoint.marker import (
    CheckpointError,
    corrupt_error,
    not_a_training_checkpoint,
    replaced_error,
)
from torch_sagemaker.checkpoint.state_dict_saver import describe_failure
from torch_sagemaker.checkpoint.state_dict_utils import (
    find_local_layout,
    local_layout_differences,
    resolve_stateful,
)
from torch_sagemaker.logger import get_logger

_SHOWN = 20  # how many offending keys an error lists
_METADATA = ".metadata"  # the file DCP's FileSystemWriter writes its metadata to


def read_metadata(
    checkpoint_id: CheckpointId,
    s3_region: str | None = None,
    s3client_config: Any = None,
) -> Metadata:
    """DCP metadata (keys, global shapes) of a complete checkpoint.

    Args:
        checkpoint_id: A directory, an ``s3://`` URI or a ``checkpoint_location``.
        s3_region: As for ``load``.
        s3client_config: As for ``load``.

    Raises:
        CheckpointError: If the checkpoint is missing, incomplete or its metadata is unreadable.
    """
    location = checkpoint_location(checkpoint_id, s3_region, s3client_config)
    return _read_metadata(location, location.read_marker())


def _read_metadata(path: CheckpointLocation, marker: dict[str, Any]) -> Metadata:
    """The metadata of the checkpoint whose ``marker`` was read, after checking its checksum.

    Raises:
        CheckpointError: If the marker names a kind DCP cannot read (a Hugging Face export),
            or the metadata is corrupt or unreadable.
    """
    problem = not_a_training_checkpoint(path, marker.get("kind"))
    if problem is not None:
        raise problem
    problems = path.verify(marker, [_METADATA])
    if problems:
        raise corrupt_error(path, problems)
    try:
        return path.storage_reader(marker).read_metadata()
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its DCP metadata is unreadable "
            f"({type(e).__name__}: {e})."
        ) from e


def _describe(key: str, value: Any, saved: Any) -> str | None:
    """Why ``value`` cannot be loaded from the saved entry, or ``None`` when it can."""
    if isinstance(value, torch.Tensor):
        if not isinstance(saved, TensorStorageMetadata):
            return (
                f"{key}: a tensor of shape {tuple(value.shape)} is requested, "
                "the checkpoint holds a non-tensor"
            )
        if tuple(saved.size) != tuple(value.shape):
            return f"{key}: checkpoint shape {tuple(saved.size)}, requested {tuple(value.shape)}"
    elif isinstance(saved, TensorStorageMetadata):
        return (
            f"{key}: the checkpoint holds a tensor of shape {tuple(saved.size)}, "
            f"a {type(value).__name__} is requested"
        )
    elif not isinstance(saved, BytesStorageMetadata):
        return f"{key}: unsupported entry {type(saved).__name__}"
    return None


def check_state_dict_matches(
    state_dict: dict[str, Any], metadata: Metadata, path: object
) -> list[str]:
    """Raises if any requested key is missing from the checkpoint or has another shape.

    Returns:
        The flattened keys of ``state_dict`` (as DCP names them).

    Raises:
        CheckpointError: Listing the missing keys and the shape or type mismatches.
    """
    # DCP's own flattening, so that the keys compared here are exactly the keys DCP stores.
    flat, _ = dcp_compat.flatten_state_dict(state_dict)
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    mismatched = [
        m
        for k, v in sorted(flat.items())
        if k in saved
        if (m := _describe(k, v, saved[k])) is not None
    ]
    cast = []
    for k, v in sorted(flat.items()):
        entry = saved.get(k)
        if (
            isinstance(v, torch.Tensor)
            and isinstance(entry, TensorStorageMetadata)
            and entry.properties.dtype not in (None, v.dtype)
        ):
            cast.append(f"{k} ({entry.properties.dtype} -> {v.dtype})")
    if cast:
        # DCP casts while it copies, as SMP's loads do (a bf16 model for inference from a
        # float32 checkpoint); the values loaded are then not the values saved, so say so.
        get_logger().warning(
            f"loading {path}: {len(cast)} tensors are cast from the saved dtype: "
            f"{cast[:_SHOWN]}{' ...' if len(cast) > _SHOWN else ''}."
        )
    if missing or mismatched:
        parts = [f"checkpoint {path} does not match the state dict being loaded."]
        if missing:
            parts.append(f"{len(missing)} keys are missing from the checkpoint: {missing[:_SHOWN]}")
            extra = sorted(k for k in saved if k not in flat)
            if extra:
                parts.append(f"keys it holds that were not requested: {extra[:_SHOWN]}")
        if mismatched:
            parts.append(f"{len(mismatched)} keys differ: " + "; ".join(mismatched[:_SHOWN]))
        raise CheckpointError("\n  ".join(parts))
    return sorted(flat)


def _check_local_layout(marker: dict[str, Any], path: object, state_dict: dict[str, Any]) -> None:
    """An SM-local checkpoint loads only under the shard layout that wrote it."""
    diff = local_layout_differences(marker.get("layout", {}))
    if diff:
        raise CheckpointError(
            f"SM-local checkpoint {path} was saved under another shard layout; it loads only "
            "under the same hybrid_shard_degree, tensor/context/expert parallel degrees and "
            "from the directory of this rank's shard. Differences (saved, here): "
            + ", ".join(f"{k}={a}/{b}" for k, (a, b) in diff.items())
            + ". Save a sharded checkpoint (the default kind) to change the layout."
        )


def _check_files_and_keys(
    path: CheckpointLocation,
    marker: dict[str, Any],
    keys: list[str] | None,
    participants: Participants,
    own_directories: bool,
) -> None:
    """Verifies the data files' checksums, split among the ranks, and that ranks agree on keys.

    One all-gather tells every rank every problem, so all of them raise the same error
    (Note [Checkpoint checksums]). Ranks of one group loading different directories (each
    rank its own SM-local shard, ``own_directories``) cannot split the files; each checks
    every file of its own directory.

    Raises:
        CheckpointError: Naming each file that differs, or the ranks requesting other keys.
    """
    sizes = {n: s for n, s in marker.get("files", {}).items() if n != _METADATA}
    if not participants.distributed:
        problems = path.verify(marker, list(sizes))
        if problems:
            raise corrupt_error(path, problems)
        return
    mine = (
        list(sizes)
        if own_directories
        else integrity.assign(
            sizes, len(participants.ranks), participants.ranks.index(participants.rank)
        )
    )
    problems = path.verify(marker, mine)
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest() if keys is not None else ""
    views = participants.all_gather((str(path), digest, problems))
    corrupt: dict[str, dict[str, None]] = {}  # directory -> problems, ordered, without repeats
    for where, _, found in views:
        if found:
            corrupt.setdefault(where, {}).update(dict.fromkeys(found))
    if corrupt:
        where = str(path) if str(path) in corrupt else next(iter(corrupt))
        raise corrupt_error(where, list(corrupt[where]))
    digests = [v[1] for v in views]
    if len(set(digests)) > 1:
        odd = [r for r, d in zip(participants.ranks, digests) if d != digests[0]]
        raise CheckpointError(
            f"loading {path}: ranks {odd} request other keys than rank {participants.ranks[0]}; "
            "every rank must load the same state dict keys (or pass check_keys_matched=False)."
        )


def agree_to_load(
    path: CheckpointLocation,
    participants: Participants,
    failure: Exception | None,
    save_id: str | None,
    kind: str | None,
) -> bool:
    """Raises on every rank unless every rank can start loading one and the same checkpoint.

    A rank whose checks failed alone (a transient storage error, a state dict that differs
    from its peers') would otherwise leave the others waiting in the next collective until
    the group's timeout. One all-gather of each rank's failure and of the checkpoint it
    names (Note [The ranks of a load read one checkpoint]): a failed rank raises its own
    error, the others one naming it; ranks naming other checkpoints all raise one error
    naming them.

    Args:
        path: This rank's checkpoint.
        participants: The ranks loading together.
        failure: This rank's error in its checks, if any.
        save_id: The save id in this rank's marker (``marker_save_id``).
        kind: The kind its marker names (``None`` when it could not be read).

    Returns:
        Whether the ranks load different directories (each its own SM-local shard).

    Raises:
        CheckpointError: A rank failed its checks, or the ranks name other checkpoints.
    """
    mine = (None if failure is None else str(failure), str(path), save_id, kind)
    views = participants.all_gather(mine)  # [mine] without a process group
    if failure is not None:
        raise failure
    failed = [(r, v[0]) for r, v in zip(participants.ranks, views) if v[0] is not None]
    if failed:
        rank, error = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise CheckpointError(f"loading {path}: rank {rank}{others} could not load it: {error}")
    _raise_if_other_checkpoints(participants.ranks, views)
    return len({v[1] for v in views}) > 1


def _raise_if_other_checkpoints(ranks: list[int], views: list[tuple[Any, str, Any, Any]]) -> None:
    """Raises unless the ranks name one checkpoint, as one save wrote it.

    Note [The ranks of a load read one checkpoint]
        DCP loads whatever directory each rank names, and a sharded checkpoint keeps one
        copy of the step, the data position and every replicated value: ranks that name
        different checkpoints (each resolving "latest" itself while a save commits, a path
        built from a rank-local variable) would each load their own, and train on from two
        steps at once, silently. So the ranks of a load agree on (checkpoint, save id from
        its marker), in the all-gather that already tells them of each other's failures:
        no extra round trip. The name counts as well as the id: a copy elsewhere has the
        same id, but all ranks share one file system, so two names for one load are a
        mistake even where the bytes agree. Only SM-local shards, each rank reading its
        shard's own directory (every rank's marker names kind ``sm_local``), may differ in
        the directory; ranks naming the same directory must still have read the same save.
        One name with two save ids means a save committed over it while the ranks read its
        marker (Note [A save that replaces a checkpoint being loaded]).

    Args:
        ranks: The global ranks of the load, in the order of ``views``.
        views: Each rank's (error, checkpoint, save id, kind), as ``agree_to_load`` gathers.

    Raises:
        CheckpointError: On every rank alike, naming each checkpoint and its ranks.
    """
    named: dict[tuple[str, Any], list[int]] = {}  # (checkpoint, save id) -> ranks
    for rank, (_, where, save_id, _kind) in zip(ranks, views):
        named.setdefault((where, save_id), []).append(rank)
    if len(named) == 1:
        return
    own_shards = all(v[3] == "sm_local" for v in views)
    directories = {where for where, _ in named}
    if own_shards and len(directories) == len(named):
        return  # each rank its SM-local shard's directory, each directory one save
    shown = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {where} (save id {sid})"
        for (where, sid), rs in list(named.items())[:_SHOWN]
    )
    if not own_shards and len(directories) > 1:
        raise CheckpointError(
            f"the ranks loading together name different checkpoints ({shown}), so each "
            "would resume from another one. Every rank of a load must load the same "
            "checkpoint (only SM-local shards are read from one directory per rank): pass "
            "the same checkpoint_id on every rank, e.g. choose it on one rank and send it to "
            "the others with torch.distributed.broadcast_object_list."
        )
    raise CheckpointError(
        f"the ranks loading together read different saves of one checkpoint ({shown}): "
        "another save committed over it while they read its marker. Load it again, and do "
        "not save under a name that is being loaded (give each save its own directory, e.g. "
        "one per step)."
    )


def _checkpoint_id(checkpoint_id: CheckpointId | None, storage_reader: Any) -> CheckpointId | None:
    """``checkpoint_id``, or the directory a file-system ``storage_reader`` reads from."""
    if checkpoint_id is not None or storage_reader is None:
        return checkpoint_id
    # DistributedFileSystemReader keeps the checkpoint it was given (on S3, .path is the
    # committed save's prefix, not the checkpoint).
    reader_path = getattr(storage_reader, "source_checkpoint", None) or getattr(
        storage_reader, "path", None
    )
    if reader_path is None:
        raise ValueError(
            f"load() got a {type(storage_reader).__name__} that does not say which "
            "directory it reads (no .path) and no checkpoint_id; pass checkpoint_id."
        )
    if isinstance(reader_path, CheckpointLocation):
        return reader_path
    return os.fspath(reader_path)


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    check_keys_matched: bool = True,
    coordinator_rank: int = 0,
    s3_region: str | None = None,
    s3client_config: Any = None,
) -> None:
    """Loads a checkpoint in place into ``state_dict``.

    Fills its tensors, DTensors and ``Stateful`` values.

    Args:
        state_dict: The template to fill; its DTensors may be sharded differently than at save.
        checkpoint_id: The checkpoint directory, ``s3://`` URI or ``checkpoint_location``;
            may be left out when ``storage_reader`` knows it (SMP's scripts pass only
            ``storage_reader=DistributedFileSystemReader(path)``).
        storage_reader: Optional DCP ``StorageReader`` (pointed at ``checkpoint_id``). On S3
            the committed save is read through ``s3torchconnector``'s DCP reader instead.
        planner: Optional DCP ``LoadPlanner``.
        process_group: Ranks that load together; default all ranks.
        check_keys_matched: Verify that every rank of the group requests the same keys.
        coordinator_rank: Accepted for SMP compatibility.
        s3_region: Region of an ``s3://`` checkpoint's bucket (default as for ``save``).
        s3client_config: An ``s3torchconnector.S3ClientConfig`` (default as for ``save``).

    Raises:
        CheckpointError: Naming the path and the reason: missing, incomplete, corrupt,
            not a training checkpoint (a Hugging Face export), another SM-local layout,
            missing keys, mismatched shapes, or ranks disagreeing (on the keys, or on the
            checkpoint: Note [The ranks of a load read one checkpoint]).
    """
    del coordinator_rank
    path = checkpoint_location(
        _checkpoint_id(checkpoint_id, storage_reader), s3_region, s3client_config
    )
    participants = Participants(process_group)
    failure: Exception | None = None
    save_id = path.marker_save_id()  # Note [A save that replaces a checkpoint being loaded]
    kind: str | None = None
    try:
        marker = path.read_marker()
        kind = marker.get("kind")
        metadata = _read_metadata(path, marker)
        resolved = resolve_stateful(state_dict)
        if marker.get("kind") == "sm_local" or find_local_layout(resolved) is not None:
            _check_local_layout(marker, path, resolved)
        keys = check_state_dict_matches(resolved, metadata, path)
    except Exception as e:  # noqa: BLE001 - every rank learns of it first (below)
        failure = e
    own_directories = agree_to_load(path, participants, failure, save_id, kind)
    _check_files_and_keys(
        path, marker, keys if check_keys_matched else None, participants, own_directories
    )
    reader = path.storage_reader(marker, storage_reader)
    # Checked above, split among the ranks: the caller's DistributedFileSystemReader need not
    # check again in this load (it does when the caller uses it afterwards).
    unchecked = (
        reader.checked_elsewhere()
        if isinstance(reader, DistributedFileSystemReader)
        else contextlib.nullcontext()
    )
    try:
        with unchecked:
            dcp.load(
                state_dict,
                checkpoint_id=path.data_root(marker),
                storage_reader=reader,
                planner=planner,
                process_group=participants.group,
                no_dist=not participants.distributed,
            )
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(
            f"reading checkpoint {path} failed, a file is probably corrupt: {describe_failure(e)}"
        ) from e
    raise_if_replaced(path, save_id, participants)


def raise_if_replaced(
    path: CheckpointLocation, save_id: str | None, participants: Participants
) -> None:
    """Raises on every rank if a save committed over ``path`` since ``save_id`` was read.

    Note [A save that replaces a checkpoint being loaded]
        A save of the same name (another job, or this one's next save under a fixed name)
        commits by renaming its staging directory over the checkpoint (Note [Checkpoint
        commit protocol]). A load that started before reads the old marker, checks the old
        files, then opens files by name: some of the old save, some of the new one, possibly
        of the same sizes. Nothing else would notice the mix. So the load reads the save id
        in the marker before anything else and again after the data: a different id (or none)
        means another save committed meanwhile, and every rank raises (one all-gather, so the
        ranks agree) rather than train from a mix. Loading again reads the new save whole.
        A load in several reads (``TrainingState.load`` reads the metadata first; SMP's
        FSDP1 ``load_model_checkpoint`` reads the model, then the optimizer through a second
        reader) takes the id before its first read and checks it after its last, so its
        reads are of one save too. ``DistributedFileSystemReader``, which SMP's scripts hand
        to DCP directly, checks its own reads in the same way (Note [What DCP reads through
        DistributedFileSystemReader]).

    Args:
        path: The checkpoint.
        save_id: The save id its marker named before the first read (``marker_save_id``).
        participants: The ranks loading together.

    Raises:
        CheckpointError: The checkpoint's save id changed since ``save_id`` was read.
    """
    now = path.marker_save_id()
    replaced = now != save_id
    if participants.distributed:
        replaced = any(participants.all_gather(replaced))
    if replaced:
        raise replaced_error(path, save_id, now)


__all__ = ["check_state_dict_matches", "load", "read_metadata"]
