"""Saving checkpoints (``torch.sagemaker.distributed.checkpoint.state_dict_saver``).

``save`` writes a state dict with PyTorch DCP and publishes it only once it is complete, at
the checkpoint's location (``location.checkpoint_location``): a directory is staged beside
its name and renamed into place (Note [Checkpoint commit protocol] in ``atomic_dir``); an
``s3://`` prefix is published by its completion marker (Note [S3 checkpoint layout] in
``s3_checkpoint``). ``async_save`` copies the state to CPU memory, returns, and runs the
same save on a background thread over a dedicated gloo process group, so training
collectives and checkpoint collectives never share a communicator.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker.checkpoint import _commit, integrity
from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.async_utils import (
    DEFAULT_ASYNC_REQUEST_QUEUE,
    AsyncCallsQueue,
    maybe_finalize_async_calls,
)
from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemWriter
from torch_sagemaker.checkpoint.location import (
    CheckpointId,
    CheckpointLocation,
    checkpoint_location,
)
from torch_sagemaker.checkpoint.marker import CheckpointError
from torch_sagemaker.checkpoint.state_dict_utils import (
    current_layout,
    find_local_layout,
    resolve_stateful,
)
from torch_sagemaker.logger import get_logger
from torch_sagemaker.state import state as tsm_state


def _write(
    state_dict: dict[str, Any],
    location: CheckpointLocation,
    *,
    storage_writer: Any,
    planner: Any,
    participants: Participants,
    info: dict[str, Any],
    on_commit: Callable[[], None] | None,
    thread_count: int = 1,
) -> None:
    """The save protocol shared by ``save`` and ``async_save``, at any location.

    The steps are Note [Commit outcome]'s; what each does to the storage is the location's
    (Note [Checkpoint commit protocol] in ``atomic_dir``, Note [S3 checkpoint layout] in
    ``s3_checkpoint``).
    """

    # 1. The save's id (Note [Commit outcome]; on S3 it names the save's prefix), and the
    # location readied for it (a fresh staging directory: a stale one is what an earlier
    # crash left behind).
    def prepare() -> str:
        save_id = uuid.uuid4().hex
        location.prepare(save_id)
        return save_id

    save_id = participants.run_on_coordinator(prepare, step=f"starting the save of {location}")
    root = location.write_root(save_id)
    writer = storage_writer
    if writer is None:
        writer = location.storage_writer(save_id, thread_count)
    # 2. Every rank writes its shards, checksumming them on the way (Note [Checkpoint
    # checksums]); DCP's coordinator writes .metadata last.
    records = _dcp_write(state_dict, root, writer, planner, participants, location)

    # 3. The commit on the coordinator, every rank told the outcome; then the replaced
    # checkpoint's removal and the optional hook (e.g. retention).
    def commit(recorded: integrity.Written | None) -> None:
        location.commit(
            save_id, {**info, "num_ranks": len(participants.ranks), "save_id": save_id}, recorded
        )

    def after_commit() -> None:
        try:
            location.remove_replaced(save_id)
        except Exception as e:  # noqa: BLE001 - the checkpoint itself is complete
            get_logger().warning(
                f"checkpoint {location} is complete, but deleting what it replaced "
                f"failed: {type(e).__name__}: {e}"
            )
        _run_hook(on_commit, location)

    _commit.publish(participants, location, save_id, records, commit, after_commit)


def _dcp_write(
    state_dict: dict[str, Any],
    root: Any,
    storage_writer: Any,
    planner: Any,
    participants: Participants,
    location: CheckpointLocation,
) -> integrity.Written | None:
    """DCP's save into ``root``, recording the files written (``None``: not followed).

    Their checksums are recorded too when the location keeps them.
    """
    with contextlib.ExitStack() as stack:
        storage_writer, recorder = stack.enter_context(
            integrity.recording(storage_writer, root, checksums=location.checksums)
        )
        try:
            dcp.save(
                state_dict,
                checkpoint_id=root,
                storage_writer=storage_writer,
                planner=planner,
                process_group=participants.group,
                no_dist=not participants.distributed,
            )
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise CheckpointError(
                f"writing checkpoint {location} failed ({describe_failure(e)}); a previous "
                f"checkpoint there is unchanged and the unfinished files stay in {root} until "
                "the next save."
            ) from e
    return recorder.records() if recorder.following else None


def _run_hook(on_commit: Callable[[], None] | None, where: Any) -> None:
    if on_commit is not None:
        try:
            on_commit()
        except Exception as e:  # noqa: BLE001 - the checkpoint itself is complete
            get_logger().warning(
                f"checkpoint {where} is complete, but its on_commit hook "
                f"failed: {type(e).__name__}: {e}"
            )


def _target(
    checkpoint_id: CheckpointId | None,
    s3_region: str | None,
    s3client_config: Any,
    storage_writer: Any = None,
) -> CheckpointLocation:
    """The validated destination (``location.checkpoint_location``).

    Without ``checkpoint_id``, a file-system ``storage_writer``'s ``path`` names it (HyperPod's
    adapter passes only ``storage_writer=DistributedFileSystemWriter(path)``).
    """
    if checkpoint_id is None and storage_writer is not None:
        checkpoint_id = getattr(storage_writer, "path", None)
    return checkpoint_location(checkpoint_id, s3_region, s3client_config)


def describe_failure(e: BaseException) -> str:
    """One line per failing rank of a DCP ``CheckpointException`` (else the exception itself)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        # Values are (exception, traceback summary) pairs.
        errors = {r: x[0] if isinstance(x, tuple) else x for r, x in failures.items()}
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(errors.items()))
    return f"{type(e).__name__}: {e}"


def _info(state_dict: dict[str, Any]) -> dict[str, Any]:
    local = find_local_layout(state_dict)
    if local is not None:
        return {"kind": "sm_local", "layout": local}
    return {"kind": "sharded", "layout": current_layout()}


def _leaves(value: Any, key: str = "") -> Any:
    """(dotted key, value) of every leaf of a nested state dict."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{key}.{i}")
    else:
        yield key, value


def _refuse_tp_local_shards_across_ranks(
    state_dict: dict[str, Any], process_group: dist.ProcessGroup | None, where: object
) -> None:
    """Raises if ``state_dict``'s TP-/EP-local FSDP1 shards would be saved over TP/EP ranks.

    Note [FSDP1 shards are saved per TP/EP rank]
        FSDP1's sharded state dict of a model with tensor or expert parallelism holds
        DTensors on FSDP's own mesh whose global shape is the TP-/EP-local one (Note [FSDP1
        sharded state dict layout] in ``sharding/fsdp1_layout.py``): every TP rank has the
        same keys, shapes and offsets, with other values. DCP's planner keeps one copy of
        equal (key, offset) items across the saving ranks, so a save over ranks of several
        TP ranks writes one TP rank's shards and drops the others', without an error. So
        a save whose group reaches beyond such a DTensor's mesh is refused before anything
        is written. FSDP2 (DTensors over the TP mesh too) and the per-TP-rank saves of SMP's
        scripts and ``TrainingState`` (each over ranks of one TP rank) are not affected.

    Raises:
        ValueError: Naming the key, the mesh's ranks, the group's ranks and the fix.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.tensor import DTensor

    from torch_sagemaker.sharding.fsdp1_layout import is_tp_local_mesh

    group = set(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    for key, value in _leaves(state_dict):
        if not isinstance(value, DTensor) or not is_tp_local_mesh(value.device_mesh):
            continue
        mesh = sorted(value.device_mesh.mesh.flatten().tolist())
        if group <= set(mesh):
            continue
        raise ValueError(
            f"save({where}): {key} is an FSDP1 shard of a model with tensor or expert "
            f"parallelism, whose tensors are local to this rank's TP/EP rank (its mesh: ranks "
            f"{mesh}), but the save's process group spans ranks {sorted(group)}, of other "
            "TP/EP ranks with the same keys: DCP would keep one TP rank's shards and drop the "
            "others'. Save one directory per TP/EP rank, <checkpoint>/tp{degree}-{rank} (or "
            "ep{degree}-{rank}), with process_group=model.process_group, as SMP's scripts "
            "do; or use TrainingState.save, which does that; or shard with FSDP2 "
            "(torch_sagemaker.sharding.shard_model) for one reshardable checkpoint."
        )


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: str | None = None,
    s3client_config: Any = None,
    on_commit: Callable[[], None] | None = None,
    marker_info: dict[str, Any] | None = None,
) -> None:
    """Saves ``state_dict`` to the directory ``checkpoint_id``, visible only once complete.

    Every rank of ``process_group`` must call it. DTensor and sharded values are written as
    shards with their global layout, so the checkpoint loads under another world size or
    parallel layout; values replicated across ranks are written once.

    Args:
        state_dict: Nested dict of tensors, DTensors, ``Stateful`` objects and picklable values.
        checkpoint_id: Directory of the checkpoint (replaced atomically if it exists), an
            ``s3://bucket/prefix`` URI (Note [S3 checkpoint layout] in ``s3_checkpoint``), or
            a ``checkpoint_location`` (which carries the S3 options and whether checksums
            are kept); may be left out when ``storage_writer`` has a ``path`` (as HyperPod's
            adapter calls).
        storage_writer: Optional DCP ``StorageWriter``; it is pointed at the staging directory
            (on S3: the save's prefix).
        planner: Optional DCP ``SavePlanner``.
        process_group: Ranks that save together; default all ranks.
        coordinator_rank: Global rank that publishes the checkpoint; default the group's first.
        wait_error_handling: Accepted for SMP compatibility; errors always reach every rank.
        force_check_all_plans: Accepted for SMP compatibility (DCP always checks plans).
        s3_region: Region of an ``s3://`` checkpoint's bucket; default ``AWS_REGION``, else
            the bucket's (Note [S3 endpoint and credentials] in ``s3_filesystem``).
        s3client_config: An ``s3torchconnector.S3ClientConfig``; default 64 MiB parts (and
            path-style requests when ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` is set).
        on_commit: Called on the coordinator right after the checkpoint became visible.
        marker_info: More JSON-able fields for the completion marker (``TrainingState``
            records its whole-save id there: Note [The parts of one checkpoint come from one
            save] in ``completeness``).

    Raises:
        ValueError: If ``state_dict`` holds an FSDP1 model's shards with tensor or expert
            parallelism and ``process_group`` spans several TP/EP ranks (Note [FSDP1 shards
            are saved per TP/EP rank]); nothing is written.
        CheckpointError: If any rank failed to write or the checkpoint could not be published;
            a previous checkpoint at ``checkpoint_id`` then stays as it was. If a rank failed
            after the commit, the error has ``committed=True``: the checkpoint is complete
            and loadable (Note [Commit outcome]).
    """
    del wait_error_handling, force_check_all_plans
    target = _target(checkpoint_id, s3_region, s3client_config, storage_writer)
    participants = Participants(process_group, coordinator_rank)
    state_dict = resolve_stateful(state_dict)
    _refuse_tp_local_shards_across_ranks(state_dict, process_group, target)
    _write(
        state_dict,
        target,
        storage_writer=storage_writer,
        planner=planner,
        participants=participants,
        info={**_info(state_dict), **(marker_info or {})},
        on_commit=on_commit,
    )


class PyTorchDistSaveShardedStrategy:
    """How ``async_save`` writes: PyTorch DCP's file-system writer with ``thread_count`` threads.

    SMP's default ``sharded_strategy`` (its Megatron-core based "torch_dist" strategy). Here it
    needs no Megatron: DCP does the sharded write, and replicated values are written once
    (DCP's de-duplication), which is what ``keep_only_main_replica`` asks for.

    Args:
        backend: Only ``"torch_dist"``.
        version: Format version; only ``1``.
        keep_only_main_replica: Must be ``True`` (DCP always writes one copy of replicas).
        thread_count: Writer threads per rank.

    Raises:
        ValueError: For another backend, version or ``keep_only_main_replica=False``, or
            ``thread_count < 1``.
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
    ) -> None:
        if backend != "torch_dist" or version != 1:
            raise ValueError(
                f"PyTorchDistSaveShardedStrategy(backend={backend!r}, version={version}): "
                "only backend='torch_dist', version=1 exist here."
            )
        if not keep_only_main_replica:
            raise ValueError(
                "keep_only_main_replica=False is not supported: DCP writes every "
                "replicated value once."
            )
        if thread_count < 1:
            raise ValueError(f"thread_count={thread_count} must be >= 1.")
        self.backend, self.version, self.thread_count = backend, version, thread_count

    def storage_writer(self, path: str | os.PathLike[str]) -> DistributedFileSystemWriter:
        """The writer for a checkpoint directory."""
        return DistributedFileSystemWriter(path, thread_count=self.thread_count)


# One dedicated gloo group per rank set, for the background thread (see module docstring and
# Note [Async save groups]). Held weakly: tsm.state owns these groups (adopt_group), and a gloo
# group frees its threads and sockets only when its last reference goes, so a strong entry
# kept the group that tsm.state.reset() destroyed alive until the next save on those ranks.
_ASYNC_GROUPS: weakref.WeakValueDictionary[tuple[int, ...], dist.ProcessGroup] = (
    weakref.WeakValueDictionary()
)
_ASYNC_GENERATIONS: dict[tuple[int, ...], int] = {}  # groups made per rank set (their names)
_ASYNC_GROUPS_LOCK = threading.Lock()


def _async_group(
    process_group: dist.ProcessGroup | None, timeout: timedelta
) -> dist.ProcessGroup | None:
    """The gloo group of ``process_group``'s ranks that background saves run on.

    A group made here gets ``timeout``; one made earlier keeps its own until the worker
    thread sets the save's (Note [Async save timeout]).

    Note [Async save groups]
        Only the saving ranks call ``async_save`` (SMP's scripts: the replica-0 ranks of each
        shard group, or one replication group each), so the group must be created by its
        members alone. PyTorch's ``new_group(use_local_synchronization=True)`` names such a
        group after its ranks *and the number of groups the calling rank already has*; ranks
        that took part in different earlier subsets (an ``async_sharded`` save on the shard
        group, then an ``async_local`` one on the replication group) then compute different
        names and wait for each other forever. Here the name depends on the ranks alone, and
        each rank set gets one group per process, so every member finds the same one.
        ``tsm.state.reset()`` destroys these groups (the state owns every group the library
        makes); the next one for the same ranks gets a new name, with the number of groups
        made for that rank set so far, which every member counts alike: gloo would otherwise
        meet the destroyed group's addresses under the old name in the store.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    with _ASYNC_GROUPS_LOCK:
        group = _ASYNC_GROUPS.get(ranks)
        if group is None or group not in c10d_compat.live_groups():  # destroyed since
            generation = _ASYNC_GENERATIONS[ranks] = _ASYNC_GENERATIONS.get(ranks, -1) + 1
            group = _ASYNC_GROUPS[ranks] = _members_only_gloo_group(ranks, generation, timeout)
        return group


def _mirrored_timeout(process_group: dist.ProcessGroup | None) -> timedelta:
    """The timeout of ``process_group`` (default: the default group), for its async group.

    Note [Async save timeout]
        The async group's collectives wait as long as those of the group the save mirrors
        (``process_group``, else the default group): the job's timeout, what
        ``init_process_group(..., timeout=...)`` or ``new_group`` gave, not gloo's default of
        30 minutes. A saving rank that stops answering (its host died or hangs) then fails
        the others' background save within about that timeout, as it fails their training
        collectives. (A group from ``new_group`` without a timeout has torch's default for
        its backend, 30 minutes for gloo and smddp, not the default group's, and so has its
        async group; ``tsm.init``'s groups are given the default group's, ``mesh.py``.)
        With gloo's default, on 3 CPU ranks whose default group had a 10 s timeout and one
        rank stopped (SIGSTOP) in its write, the others' save had not failed after 90 s,
        and a rank whose main thread had raised meanwhile (its training collective timed out
        after 10 s) did not exit either: Python joins the queue's worker thread at exit. With
        the default group's timeout both others' save failed after 10 s, and the rank whose
        collective timed out exited as it raised, 13 s after the save began. (A rank killed on
        a live host closes its sockets, and gloo fails its peers' save at once either way:
        0.0-0.1 s, before and after.)
        The worker stays a non-daemon thread: a daemon one would be stopped at exit in the
        middle of a save that was about to complete (its files written, the commit not yet
        made), losing that checkpoint. With every wait of the save bounded, exit waits at
        most for the save in progress and those queued after it, each failing within the
        timeout when its peers are gone: each of DCP's collectives and the commit's gather
        and broadcast wait up to the timeout, and a rank whose commit collectives failed then
        polls up to ``OUTCOME_WAIT_S`` for the outcome (Note [Commit outcome]).
        A timeout is found in the options of the group's backend (``c10d_compat.
        group_timeout``: gloo, NCCL and smddp report it there). Failing that, the default
        group's; failing that too (a backend registered from elsewhere that reports no
        options), gloo's default, as before.
        One async group serves every save over the same ranks, whose groups may have other
        timeouts: the worker thread sets the save's on it before the save, so it never
        changes under a collective of the group (only that thread runs them).
    """
    default = c10d_compat.default_group()
    for group in (process_group or default, default):
        timeout = c10d_compat.group_timeout(group)
        if timeout is not None:
            return timeout
    return c10d_compat.default_timeout(dist.Backend("gloo"))


def _members_only_gloo_group(
    ranks: tuple[int, ...], generation: int, timeout: timedelta
) -> dist.ProcessGroup:
    """A gloo group created by its members only, named after its ranks and ``generation``.

    See Note [Async save groups]; ``timeout``: Note [Async save timeout].
    """
    name = "tsm_async_save_" + "_".join(map(str, ranks)) + (f"_g{generation}" if generation else "")
    default_store = c10d_compat.live_groups()[c10d_compat.default_group()][1]
    # The same helper ``new_group`` uses, with a name every member computes alike.
    group, _ = c10d_compat.new_process_group_helper(
        len(ranks),
        ranks.index(dist.get_rank()),
        list(ranks),
        "gloo",
        default_store,
        group_name=name,
        timeout=timeout,
    )
    c10d_compat.set_group_ranks(group, {rank: i for i, rank in enumerate(ranks)})
    tsm_state.adopt_group(group)  # tsm.state.reset() destroys it with the library's other groups
    return group


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    queue: AsyncCallsQueue | None = None,
    sharded_strategy: Any = None,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: str | None = None,
    s3client_config: Any = None,
    on_commit: Callable[[], None] | None = None,
    marker_info: dict[str, Any] | None = None,
) -> int:
    """Like ``save``, but writes in the background; training may go on meanwhile.

    The state is copied to CPU memory before the call returns, so later updates of the
    model do not leak into the checkpoint. Call ``maybe_finalize_async_calls`` to collect
    results (and errors); the checkpoint becomes visible as soon as its write finished.

    Args:
        state_dict: As for ``save``.
        checkpoint_id: As for ``save``.
        storage_writer: As for ``save`` (used from the background thread).
        planner: As for ``save``.
        process_group: As for ``save``; a gloo group with the same ranks carries the
            background collectives.
        coordinator_rank: As for ``save``.
        queue: The ``AsyncCallsQueue`` to run on; default the module's global queue.
        sharded_strategy: A ``PyTorchDistSaveShardedStrategy`` (the default), whose writer
            thread count the location's writer takes when ``storage_writer`` is ``None``.
        wait_error_handling: As for ``save``.
        force_check_all_plans: As for ``save``.
        s3_region: As for ``save``.
        s3client_config: As for ``save``.
        on_commit: As for ``save`` (runs on the background thread).
        marker_info: As for ``save``.

    Returns:
        The index of the request in ``queue``.
    """
    del wait_error_handling, force_check_all_plans
    queue = queue if queue is not None else DEFAULT_ASYNC_REQUEST_QUEUE
    # Fail fast on a bad id, before staging.
    target = _target(checkpoint_id, s3_region, s3client_config, storage_writer)
    strategy = sharded_strategy or PyTorchDistSaveShardedStrategy()
    if not isinstance(strategy, PyTorchDistSaveShardedStrategy):
        raise TypeError(
            f"sharded_strategy must be a PyTorchDistSaveShardedStrategy, got "
            f"{type(strategy).__name__}."
        )
    resolved = resolve_stateful(state_dict)
    _refuse_tp_local_shards_across_ranks(resolved, process_group, target)
    info = {**_info(resolved), **(marker_info or {})}
    staged = BlockingAsyncStager().stage(resolved)
    participants = Participants(process_group, coordinator_rank)
    timeout: timedelta | None = None
    if participants.distributed:
        timeout = _mirrored_timeout(process_group)
        participants.group = _async_group(process_group, timeout)

    def write() -> None:
        # On the worker thread, the only one that runs the group's collectives (Note [Async
        # save timeout]).
        if participants.group is not None and timeout is not None:
            participants.group.set_timeout(timeout)
        _write(
            staged,
            target,
            storage_writer=storage_writer,
            planner=planner,
            participants=participants,
            info=info,
            on_commit=on_commit,
            thread_count=strategy.thread_count,
        )

    return queue.schedule_async_request(write, description=f"async save of {checkpoint_id}")


__all__ = [
    "PyTorchDistSaveShardedStrategy",
    "async_save",
    "maybe_finalize_async_calls",
    "save",
]
