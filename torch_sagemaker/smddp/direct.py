"""A direct call path to the smddp all-reduce, for latency-bound small messages.

``dist.all_reduce`` on a small tensor spends most of its time outside the collective:
its Python checks, the c10d dispatcher, and the Work and Future every call creates. On
these 2-core machines that is about 5 microseconds per call with a single rank, while the
shared-memory exchange of a 1 KiB all-reduce between two ranks takes about 2. Where such
calls sit on the critical path (tensor-parallel decoding, scalar reductions in a training
step), :func:`all_reduce_direct` calls the backend's synchronous all-reduce straight from
Python: same algorithm, same ordering with the group's other collectives, same errors
and timeouts, no Work. DeepSpeed's ``inference_all_reduce`` takes the same shortcut.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupMember

from torch_sagemaker._torch_compat import c10d as c10d_compat

_SUM = dist.ReduceOp.SUM
# Bound once: the module attribute lookup would add to every call of the fast path.
_default_group_or_none = c10d_compat.default_group_or_none

# Note [Groups the direct path remembers]: a group whose CPU backend is smddp -> that backend
# (a torch_sagemaker._C.ProcessGroupSMDDP, typed Any), looked up on every call. Entries of
# destroyed groups are dropped at the next miss; until then they keep little, since
# destroy_process_group shuts an smddp backend down (its calls then raise). Other groups are
# remembered weakly, in _elsewhere: a gloo group frees its threads and sockets only when its
# last reference goes, and a strong entry here kept every such group the grad norm or a
# tensor-parallel loss had reduced over alive after tsm.state.reset() destroyed it.
_backends: dict[dist.ProcessGroup | None, Any] = {}
_elsewhere: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
_UNRESOLVED = object()


def _resolve(group: dist.ProcessGroup | None) -> Any:
    if group in _elsewhere:
        return None
    live = set(c10d_compat.live_groups())
    for stale in [g for g in _backends if g not in live]:
        del _backends[stale]
    if group is None or group is GroupMember.NON_GROUP_MEMBER or group not in live:
        return None  # dist.all_reduce applies its rules; nothing worth caching
    try:
        backend = c10d_compat.backend_of(group, torch.device("cpu"))
    except RuntimeError:  # the group has no CPU backend
        backend = None
    if not hasattr(backend, "_all_reduce_direct"):
        _elsewhere.add(group)
        return None
    _backends[group] = backend
    return backend


def all_reduce_direct(
    tensor: torch.Tensor,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Synchronous, in-place all-reduce of ``tensor`` over ``group``, called directly.

    On a group whose CPU backend is smddp, the collective runs in this thread without
    torch.distributed's dispatch (no Work, no Future; see the module docstring). Anything
    else (another backend, a non-CPU tensor, a sparse tensor, a tensor subclass such as
    DTensor, a rank outside the group) goes through ``dist.all_reduce`` with the same
    arguments, so the call is always correct and only sometimes faster.

    Args:
        tensor: The tensor to reduce, in place, on every rank.
        op: The reduction (``SUM``, ``AVG``, ``PREMUL_SUM``, ``MIN``, ``MAX``, ``PRODUCT``;
            bitwise ops for integer tensors).
        group: The process group (default: the default group).

    Raises:
        RuntimeError: The collective failed on this or another rank, timed out, or the
            ranks issued different collectives (the message names them).
        TypeError: The tensor's dtype is not supported by smddp.
        ValueError: The op does not apply to the tensor's dtype.
    """
    # Every check here costs tens of nanoseconds on a path that takes about one microsecond.
    if group is None:
        group = _default_group_or_none()
    backend = _backends.get(group, _UNRESOLVED)
    if backend is _UNRESOLVED:
        backend = _resolve(group)
    if (
        backend is None
        or type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout is not torch.strided
    ):
        dist.all_reduce(tensor, op=op, group=group)
    elif op is _SUM:
        backend._all_reduce_direct(tensor)
    else:
        backend._all_reduce_direct(
            tensor, op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
        )
