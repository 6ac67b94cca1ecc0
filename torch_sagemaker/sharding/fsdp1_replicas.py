"""FSDP1's all-reduce across replicas, run while backward computes (HYBRID_SHARD, NO_SHARD).

``FSDP1ReplicaReduction(root)`` changes how the units of an FSDP1 model average gradients
across replicas: HYBRID_SHARD's all-reduce over the replica group after each unit's
reduce-scatter, and NO_SHARD's all-reduce over its group. The calls become asynchronous and
are waited for at backward's end, so the network carries one unit's gradients while the
ranks compute the next units'. When ``loss.backward()`` returns the gradients are what
FSDP1 would have produced. ``tsm.init``'s FSDP1 patch attaches one to every root that
follows the SMP config in a job over several hosts (``sharding/fsdp1.py``);
``TSM_OVERLAP_REPLICA_REDUCTION`` (``wanted``) turns it off, or on for one host too. A root
built around roots that have one (a model wrapped layer by layer, then whole) takes their
units over, so each unit is deferred by one reduction, which logs once at its first backward.

Note [FSDP1 deferred replica reduction]
FSDP1 offers no hook for this: ``register_comm_hook`` refuses hybrid strategies, and its
reduction casts the reduced gradient to the parameter dtype at once, so an asynchronous
call would be read before it finished. So FSDP1's two reduction functions are wrapped
(``_torch_compat.fsdp1.REDUCE_SHARDED`` / ``REDUCE_NO_SHARD``), for registered units only:

- The wrapper runs FSDP1's own function with the unit's replica group swapped for a group
  of this rank alone, where the all-reduce returns its input (a Python ``ProcessGroup`` that
  c10d never sees). Everything else is FSDP1's:
  the reduce-scatter inside the host, the division (its factors were fixed at construction
  for the whole data-parallel world: after the sum over replicas the gradient is the mean),
  the cast to the parameter dtype, the gradient views of ``use_orig_params``.
- It then starts the real all-reduce of that gradient over the replicas in FSDP1's reduce
  dtype (a cast copy, exact since the values came from that dtype; in place when the dtypes
  agree), with ``async_op=True``, and remembers the gradient tensor.
- A callback queued on the autograd engine after FSDP1's own (which moves each sharded
  gradient, the same tensor, to ``flat_param.grad``) waits for the calls in the order
  started and copies each result into its gradient.

The bytes crossing hosts are FSDP1's. The only numerical difference is where FSDP1's
post-division falls: before the sum across replicas instead of after, which changes no bit
when the factor is a power of two.

On a GPU, FSDP1 divides and casts a hybrid unit's gradient on its all-reduce stream; the
current stream waits for it before the all-reduce starts.

Left to FSDP1's synchronous path: a unit with a communication hook, with CPU offload,
low-precision gradients kept or an optimizer in backward (each reads the gradient inside the
reduction function, before the sum), and a
HYBRID_SHARD unit accumulating into a gradient kept from an earlier backward without
``no_sync`` (its ``_saved_grad_shard``: the sum over replicas has to cover only the new part).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from torch_sagemaker import env_settings
from torch_sagemaker._torch_compat import autograd as autograd_compat
from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.logger import log_rank0

_HYBRID = (ShardingStrategy.HYBRID_SHARD, fsdp1_compat.HYBRID_SHARD_ZERO2)
# Each unit's reduction, by unit; the wrappers do nothing for units not in it.
_reductions: weakref.WeakKeyDictionary[FullyShardedDataParallel, FSDP1ReplicaReduction] = (
    weakref.WeakKeyDictionary()
)
_originals: dict[str, Callable[..., Any]] = {}


class _Alone(dist.ProcessGroup):
    """This rank alone: its all_reduce leaves the tensor as it is (the sum over one rank).

    Written in Python and never registered with c10d, so it is no group the job holds: it
    allocates nothing, and ``tsm.state.reset()`` has nothing of it to destroy. FSDP1 calls
    only ``all_reduce`` on the group it stands in for, inside the wrapped function.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # (rank, size): no store needed

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return c10d_compat.completed_work(tensors)

    def getBackendName(self) -> str:  # noqa: N802 (ProcessGroup's name)
        return "tsm_alone"


_alone: list[_Alone] = []  # made at the first reduction


def _alone_group() -> _Alone:
    if not _alone:
        _alone.append(_Alone())
    return _alone[0]


def wanted(several_hosts: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``tsm.init``'s FSDP1 patch should attach an ``FSDP1ReplicaReduction``.

    ``TSM_OVERLAP_REPLICA_REDUCTION`` (``env_settings.overlap_replica_reduction``): ``1`` always,
    ``0`` never, unset: when the job spans several hosts. On one host the replicas'
    all-reduce goes through shared memory in a few ms, and run beside backward it only
    competes for the cores (docs/log/multi_node.md, build e50b94d: the one-host runs).

    Args:
        several_hosts: Whether the job's ranks are on more than one host.
        environ: The environment; ``os.environ`` by default.

    Raises:
        ConfigError: If the variable is set to anything but ``0`` or ``1``.
    """
    setting = env_settings.overlap_replica_reduction(environ)
    return several_hosts if setting is None else setting


@dataclass
class _InFlight:
    work: Any
    buffer: torch.Tensor
    grad: torch.Tensor


class FSDP1ReplicaReduction:
    """Defers the replica all-reduce of every unit of an FSDP1 root (module docstring).

    Args:
        root: The root ``FullyShardedDataParallel`` instance (collective: every rank calls
            it for the same model). Units whose strategy has no replicas are left alone.

    Attributes:
        wait_seconds: Seconds the last backward waited for the all-reduces at its end.
        calls: All-reduces started so far (every backward's).
        units: How many units it defers.
    """

    def __init__(self, root: FullyShardedDataParallel) -> None:
        self.wait_seconds = 0.0
        self.calls = 0
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._inflight: list[_InFlight] = []
        self._queued_for = -1
        self.units = 0
        self._announced = False
        for unit in FullyShardedDataParallel.fsdp_modules(root):
            group = _replica_group(unit)
            if group is None or dist.get_world_size(group) == 1:
                continue
            earlier = _reductions.get(unit)
            if earlier is not None:  # wrapped again by an outer root: its units move here
                del earlier._groups[id(unit)]
                earlier.units -= 1
            self._groups[id(unit)] = group
            _reductions[unit] = self
            self.units += 1
        if self.units:
            _install()

    def remove(self) -> None:
        """Gives the units back to FSDP1's synchronous reduction."""
        for unit in [u for u, r in _reductions.items() if r is self]:
            del _reductions[unit]

    def _defers(self, unit: FullyShardedDataParallel, handle: Any) -> bool:
        if handle is None or fsdp1_compat.has_comm_hook(unit):
            return False
        if fsdp1_compat.reads_grad_at_reduction(handle):
            return False
        hybrid = fsdp1_compat.unit_sharding(unit) in _HYBRID
        return not (hybrid and fsdp1_compat.saved_grad_shard(handle.flat_param) is not None)

    def _start(self, handle: Any, grad: torch.Tensor, group: dist.ProcessGroup) -> None:
        if not self._announced:
            # Said at the first backward, not at construction: a model wrapped layer by layer
            # builds a root per layer before the outer root takes their units over.
            self._announced = True
            log_rank0(
                f"FSDP: the all-reduce across replicas runs during backward for {self.units} "
                "units (TSM_OVERLAP_REPLICA_REDUCTION=0: synchronous)"
            )
        task = autograd_compat.current_graph_task_id()
        if self._queued_for != task:
            self._inflight = []  # a backward that raised never ran its callback: dropped
            self._queued_for = task
            autograd_compat.queue_callback(self._finish)
        dtype = fsdp1_compat.reduce_dtype(handle) or grad.dtype
        buffer = grad if dtype == grad.dtype else grad.to(dtype)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        self._inflight.append(_InFlight(work, buffer, grad))
        self.calls += 1

    def _finish(self) -> None:
        try:
            start = time.perf_counter()
            for call in self._inflight:
                call.work.wait()
            self.wait_seconds = time.perf_counter() - start
            for call in self._inflight:
                if call.buffer is not call.grad:
                    call.grad.copy_(call.buffer)
        finally:
            self._inflight = []
            self._queued_for = -1


def _replica_group(unit: FullyShardedDataParallel) -> dist.ProcessGroup | None:
    """The group a unit all-reduces over across replicas, or ``None`` (no such all-reduce)."""
    strategy = fsdp1_compat.unit_sharding(unit)
    if strategy in _HYBRID:
        return getattr(unit, fsdp1_compat.inter_node_group_attr())
    if strategy is ShardingStrategy.NO_SHARD:
        return unit.process_group
    return None


@contextlib.contextmanager
def _swapped(unit: FullyShardedDataParallel, attr: str, group: dist.ProcessGroup) -> Iterator[None]:
    saved = getattr(unit, attr)
    setattr(unit, attr, group)
    try:
        yield
    finally:
        setattr(unit, attr, saved)


def _reduce_sharded(unit: FullyShardedDataParallel, handle: Any) -> None:
    reduction = _reductions.get(unit)
    original = _originals[fsdp1_compat.REDUCE_SHARDED]
    hybrid = fsdp1_compat.unit_sharding(unit) in _HYBRID
    if reduction is None or not hybrid or not reduction._defers(unit, handle):
        return original(unit, handle)
    group = reduction._groups[id(unit)]
    with _swapped(unit, fsdp1_compat.inter_node_group_attr(), _alone_group()):
        original(unit, handle)
    fsdp1_compat.wait_for_all_reduce_stream(unit)  # where FSDP1 divided and cast (GPU)
    reduction._start(handle, fsdp1_compat.saved_grad_shard(handle.flat_param), group)


def _reduce_no_shard(unit: FullyShardedDataParallel, handle: Any) -> None:
    reduction = _reductions.get(unit)
    original = _originals[fsdp1_compat.REDUCE_NO_SHARD]
    if reduction is None or not reduction._defers(unit, handle):
        return original(unit, handle)
    group = reduction._groups[id(unit)]
    with _swapped(unit, "process_group", _alone_group()):
        original(unit, handle)
    reduction._start(handle, handle.flat_param.grad, group)


def _install() -> None:
    """Wraps FSDP1's two reduction functions (once; they pass unregistered units through)."""
    if _originals:
        return
    for name, wrapper in (
        (fsdp1_compat.REDUCE_SHARDED, _reduce_sharded),
        (fsdp1_compat.REDUCE_NO_SHARD, _reduce_no_shard),
    ):
        _originals[name] = fsdp1_compat.reduction_function(name)
        fsdp1_compat.set_reduction_function(name, wrapper)


def uninstall() -> None:
    """Restores FSDP1's own reduction functions."""
    for name, original in _originals.items():
        fsdp1_compat.set_reduction_function(name, original)
    _originals.clear()


__all__ = ["FSDP1ReplicaReduction", "uninstall", "wanted"]
