"""Private ``torch.distributed.distributed_c10d`` names: the world's bookkeeping and helpers.

The package reads c10d's registry of live groups (``_world``), asks a process group for its
per-device backend (``ProcessGroup._get_backend``) and the timeout a backend reports in its
options (``options._timeout``), builds a group with the helper
``new_group`` itself uses (``_new_process_group_helper``), so that the group's name can be
chosen, and makes a finished ``Work`` from a future (``_create_work_from_future``) for groups
written in Python. Code that ``torch.compile`` traces sums over a group with the functional
all-reduce (``_functional_collectives.all_reduce``), which Dynamo records in the graph. A
functional collective's result (``AsyncCollectiveTensor``) that nobody uses is waited for
when it is dropped (``wait_when_dropped``).

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as _funcol
from torch.distributed import distributed_c10d as _c10d

from torch_sagemaker._torch_compat.tensor import local_tensor_or_self


def object_collective_device() -> str:
    """The device the object collectives of the default group use (``"cpu"``, ``"cuda:0"``, ...)."""
    return _c10d._get_object_coll_device()


def default_store() -> dist.Store:
    """The store of the default process group.

    Raises:
        ValueError: If there is no default process group (torch's error).
    """
    return _c10d._get_default_store()


def default_group() -> dist.ProcessGroup:
    """The default process group.

    Raises:
        ValueError: If there is none (torch's error).
    """
    return _c10d._get_default_group()


def default_group_or_none() -> dist.ProcessGroup | None:
    """The default process group, or ``None`` before ``init_process_group``; no checks."""
    return _c10d._world._default_pg


def default_timeout(backend: dist.Backend) -> timedelta:
    """The timeout a new group of ``backend`` gets when none is given."""
    return _c10d._get_default_timeout(backend)


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout of ``group``'s collectives, where its backend object keeps it; else ``None``.

    A backend reports it in its options (``Backend.options._timeout``, its C++
    ``getBackendOptions``): gloo, NCCL and smddp do. It is what ``init_process_group`` or
    ``new_group`` gave the group (torch's default for the backend when they were given
    none: ``new_group`` does not inherit the default group's), or what
    ``ProcessGroup.set_timeout`` set since. A backend without options (torch's base class
    raises) gives ``None``. The backend of CPU tensors is asked first, then that of CUDA
    tensors; torch gives every backend of a group the same timeout.

    Checked on torch 2.13 (``Backend.options``, ``Backend.Options._timeout``).

    Args:
        group: A process group this rank is a member of.

    Returns:
        The timeout, or ``None`` where no backend of the group keeps one in its options.
    """
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:  # no backend for that device type
            continue
        try:
            timeout = backend.options._timeout
        except (AttributeError, RuntimeError):  # a backend that implements no options
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def live_groups() -> dict[dist.ProcessGroup, tuple[str, dist.Store]]:
    """c10d's own map of the live process groups to their backend name and store.

    The dictionary itself, not a copy: a destroyed group leaves it.
    """
    return _c10d._world.pg_map


def set_group_ranks(group: dist.ProcessGroup, ranks: dict[int, int]) -> None:
    """Records ``{global rank: group rank}`` of ``group`` where c10d looks the ranks up."""
    _c10d._world.pg_group_ranks[group] = ranks


def new_process_group_helper(
    group_size: int,
    group_rank: int,
    global_ranks: list[int],
    backend: str,
    store: dist.Store,
    *,
    group_name: str,
    timeout: timedelta,
) -> tuple[dist.ProcessGroup, Any]:
    """Builds a process group the way ``dist.new_group`` does, under the name given.

    Only the members call it. The group's ranks are not recorded: see ``set_group_ranks``.

    Args:
        group_size: The number of ranks in the group.
        group_rank: This rank's rank in the group.
        global_ranks: The global ranks of the members, in group-rank order.
        backend: The backend's name (``"gloo"``, ...).
        store: The store the members meet in (the default group's).
        group_name: The group's name, the same on every member.
        timeout: The timeout of the group's collectives.

    Returns:
        ``(group, its prefixed store)``, what torch's helper returns.
    """
    return _c10d._new_process_group_helper(
        group_size,
        group_rank,
        global_ranks,
        backend,
        store,
        group_name=_c10d.GroupName(group_name),
        timeout=timeout,
    )


def backend_of(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The backend object that runs ``group``'s collectives on ``device``'s type.

    Typed ``Any``: for smddp it is the extension's ``ProcessGroupSMDDP``, with methods of its
    own.

    Raises:
        RuntimeError: If the group has no backend for that device type.
    """
    return group._get_backend(device)


# Renamed public collectives. torch 2.13 calls the tensor forms ``all_gather_single`` and
# ``reduce_scatter_single`` and keeps ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
# as deprecated aliases; torch 2.11 has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def traceable_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over ``group``, a new tensor, in an op Dynamo traces into a graph.

    Dynamo cannot trace ``dist.all_reduce`` or a group's backend object (an opaque object
    whose members it does not know); the functional collective is what DTensor itself uses
    in compiled code.
    """
    return _funcol.all_reduce(tensor, "sum", group)


# Note [Collectives nobody waits for]
#
# A functional collective (what DTensor's redistribute runs) registers its Work in c10d's
# registry and returns an ``AsyncCollectiveTensor``; the first op that uses it waits, which
# takes the Work out of the registry. One that no op ever uses is never waited for, and its
# Work, holding the output tensor, stays in the registry for the life of the process.
# Non-reentrant activation checkpointing makes such results every step: the recompute stops
# at the last tensor the backward needs (its early stop), after the layer issued collectives
# whose results only the rest of the forward would have used. GPT-NeoX's parallel residual
# (the attention's reduce-scatter, summed only after the MLP) leaked one activation-sized
# Work per layer and step under tensor parallelism, until out of memory. Turning the early
# stop off (what torchtitan does) would recompute the rest of every layer, its collectives
# included, for every model; a finalizer on the unused result waits for the collective when
# the result dies, which is when the recompute stops. A result that was waited for already
# has nothing left in the registry, so the finalizer's wait returns at once.
def wait_when_dropped(tensor: Any) -> None:
    """Makes sure the functional collective behind ``tensor`` is waited for, used or not.

    Note [Collectives nobody waits for]. Anything that is not a pending functional
    collective's result (or a DTensor whose local tensor is one) is left as it is.

    Args:
        tensor: A tensor, DTensor, or any other value.
    """
    local = local_tensor_or_self(tensor) if isinstance(tensor, torch.Tensor) else tensor
    if isinstance(local, _funcol.AsyncCollectiveTensor) and not local.completed:
        finalizer = weakref.finalize(local, _funcol.wait_tensor, local.elem)
        # At exit the process groups may be gone; a collective left then stays unwaited.
        finalizer.atexit = False


def unwaited_collectives() -> int:
    """How many functional collectives of this process are still registered, never waited for.

    Note [Collectives nobody waits for].
    """
    return torch._C._distributed_c10d._get_work_registry_size()


def completed_work(result: Any) -> dist.Work:
    """A ``Work`` that is already done, its future holding ``result``.

    For process groups written in Python (``dist.ProcessGroup`` subclasses), whose
    collectives must return a ``Work``.
    """
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]
