"""FSDP2 gradients averaged across replicas while backward computes.

``ReplicaReduction(model, group)`` attaches to a model that ``fully_shard`` sharded over a
1-D mesh (the ranks of one replica, usually one host) and averages each unit's sharded
gradients over ``group`` (the replicas: the same shard on every host) with ``async_op=True``
calls, one per FSDP unit, started as soon as the unit's reduce-scatter has produced them.
Backward's last step waits for them, so when ``loss.backward()`` returns every gradient is
the average over all data-parallel ranks, as with HSDP (``fully_shard`` over a 2-D mesh).
``shard_model(..., overlap_replica_reduction=True)`` sets this up from ``tsm.state``'s mesh.

Note [Deferred replica reduction]
FSDP2's HSDP reduce-scatters a unit's gradients inside a replica, all-reduces the result
across replicas and casts it to the parameters' dtype, all in one call of its post-backward
(``foreach_reduce``). On CPU its streams do nothing, so the all-reduce across hosts, the
slow part, runs while the rank waits: a step is its compute plus every byte of the
gradients at line rate. Here FSDP2 only reduce-scatters inside the replica; it then assigns
the sharded gradients and calls their post-accumulate-grad hooks (part of FSDP2's contract:
``foreach_reduce`` calls them after assigning ``.grad``). The hook of a unit's last gradient
copies the unit's gradients into one buffer of ``reduce_dtype`` and starts its all-reduce
across replicas; the caller goes on with the next units' backward while the backend sends.
A callback queued on the autograd engine (it runs once backward's own callbacks, FSDP2's
root reduction among them, are done) starts the units whose gradients were not all
produced, waits for every call in the order started, and writes each buffer back into the
gradients, divided by the number of replicas.

Every replica makes the same calls in the same order, whatever its batch left unused (a
text-only batch of an image-text model leaves the vision tower without gradients): a unit's
buffer holds all its trainable parameters, zeros for those without a gradient on this rank
(which then get one: the average of their peers'; a parameter no replica's batch used keeps
``None``, as in one process, told by one flag per parameter that rides at the end of the
buffer, 1 where the rank had the gradient), and the units start in one fixed order,
the reverse of the model's (backward's usual order). A unit whose gradients are all there
waits for the units before it in that order, as DDP's buckets do. Starting units as they
completed, as this did first, let a rank whose batch skipped parameters start that unit only
at the end, and the replicas' all-reduces no longer matched (gloo aborted on their sizes;
equal sizes would have summed other units' gradients).

Note [Backward's end under reentrant checkpointing]: a reentrant checkpoint (SMP's scripts
checkpoint their layers so) recomputes a layer inside backward and runs that layer's backward
as a nested backward, a graph task of its own; FSDP2's post-backward of the layer's unit, and
so the gradient hooks here, run inside it. A callback queued from there runs when the nested
task ends, long before the model's backward does. So the callback is queued from a hook on
the model's outputs, whose gradients backward computes first, in its outermost task; the
gradient hooks queue it only for a backward that did not start at the model's outputs. (Keyed
on the running task's id, as this was first, each nested task dropped the calls in flight,
whose averages were then never written, and gave wrong gradients.) The forward pre-hook
drops what a backward that raised left behind. Order matters: FSDP2's root registers its own
hook on the same outputs in its post-forward, which ``fully_shard`` installed before this
one, so its final callback (the root unit's reduction among others) is queued, and runs,
first.

Numerics: in a replica FSDP2 reduces in its ``mp_policy.reduce_dtype`` and casts to the
parameter dtype; the buffer here casts back to that dtype (exact: the values came from it,
unless gradients were accumulated in the parameter dtype), so the bytes crossing hosts are
those HSDP sends. The sum over replicas happens in the
backend (smddp adds half-precision partials in fp32 and rounds once per host's partial),
then the division by the replica count in the parameter dtype. Only where divisions fall
differs from HSDP's, so fp32 results agree with HSDP's up to rounding.

Accumulation: ``set_requires_gradient_sync(False)`` (FSDP2's no_sync) on the microbatches
before the last works as with HSDP: FSDP2 reduces nothing there, so nothing is sent. The
HSDP pattern of reduce-scattering every microbatch and all-reducing only the last maps to
``requires_reduction = False`` on the earlier ones. A backward per microbatch with reduction
on (or ``zero_grad(set_to_none=False)``) averages a gradient that already holds an average:
that part is the same on every replica, so its average is itself, and the result is right;
the sends cover the whole gradient, not only the new part, and with a ``reduce_dtype`` below
the gradient's that part is rounded to it once more.

Costs against HSDP: a copy of the gradients into the buffer and one back (memory traffic of
twice the gradient bytes, in the unit's dtypes), the buffer itself (one unit's gradients at a
time per unit in flight, at most the whole model's), and parameters whose DTensor mesh is
the 1-D shard mesh, so a sharded checkpoint's shards are those of one replica (DCP writes
each once and reshards on load).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import autograd as autograd_compat
from torch_sagemaker._torch_compat import fsdp2 as fsdp2_compat
from torch_sagemaker._torch_compat.pytree import tree_leaves


@dataclass
class _InFlight:
    """One unit's all-reduce across replicas: its work, its buffer, the gradients it fills.

    ``buffer`` holds the gradients, then one flag per parameter (1 where this rank had its
    gradient); ``filled`` indexes the parameters given a zero gradient here.
    """

    work: Any
    buffer: torch.Tensor
    grads: list[torch.Tensor]
    params: list[nn.Parameter]
    filled: list[int]


@dataclass
class _Unit:
    """One FSDP unit's own parameters, and the ids of those whose gradients arrived."""

    params: list[nn.Parameter]
    arrived: set[int] = field(default_factory=set)


def _group_params(model: nn.Module) -> list[list[nn.Parameter]]:
    """The sharded parameters of each ``fully_shard`` unit of ``model`` (frozen ones too)."""
    groups = (fsdp2_compat.param_group_of(m) for m in model.modules() if isinstance(m, FSDPModule))
    return [fsdp2_compat.sharded_params(g) for g in groups if g is not None]


def fsdp_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """The trainable sharded parameters of each ``fully_shard`` unit of ``model``.

    A unit is one ``FSDPModule``'s parameter group; its parameters are the sharded ones
    FSDP2 assigns gradients to. Frozen ones (``requires_grad=False``) are left out: FSDP2
    reduces no gradient for them.

    Raises:
        ValueError: If ``model`` has no ``FSDPModule``.
    """
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} has no fully_shard unit: ReplicaReduction reduces the "
            "gradients FSDP2 produced. Call fully_shard (or shard_model) on it first."
        )
    units = [[p for p in params if p.requires_grad] for params in _group_params(model)]
    return [params for params in units if params]


class ReplicaReduction:
    """Averages FSDP2's sharded gradients over replicas during backward (module docstring).

    Args:
        model: A model ``fully_shard`` sharded over a 1-D mesh (one replica's ranks). Every
            unit's parameters must be sharded the same way on every replica.
        group: The replicas: the ranks holding the same shards, one per replica.
        reduce_dtype: The dtype the gradients cross ``group`` in; default their own. Pass
            the ``mp_policy.reduce_dtype`` FSDP2 reduced in, as HSDP would.

    Attributes:
        requires_reduction: When False, backward leaves the gradients reduced inside the
            replica only (for the microbatches before the last; module docstring).
        wait_seconds: Seconds the last backward waited for the all-reduces at its end.
        calls: All-reduces started so far (every backward's).
    """

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        *,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.reduce_dtype = reduce_dtype
        self.requires_reduction = True
        self.wait_seconds = 0.0
        self.calls = 0
        self._model = model
        self._units: list[_Unit] = []  # in the order their all-reduces start
        self._unit_of: dict[int, _Unit] = {}
        self._next = 0  # the first unit of self._units not started in this backward
        # Which sharded parameters the hooks were made for: (id, requires_grad) of each. The
        # ids cannot be reused while the hooked (trainable) ones are held by self._units.
        self._hooked: list[tuple[int, bool]] = []
        self._handles: list[Any] = []
        self._inflight: list[_InFlight] = []
        self._queued_for = -1  # the backward whose final callback is queued
        self._hook_parameters()
        # FSDP2 replaces its sharded parameters when a state dict is loaded with assign=True
        # (FSDPParam.reset_sharded_param), and a parameter may be frozen or thawed later: each
        # forward looks again, so the hooks are on the parameters backward will produce.
        self._forward_hook = model.register_forward_pre_hook(self._check_parameters, prepend=True)
        # Note [Backward's end under reentrant checkpointing]
        self._output_hook = model.register_forward_hook(self._hook_outputs)

    def remove(self) -> None:
        """Removes the hooks: later backwards leave the replicas unsynchronised."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._forward_hook.remove()
        self._output_hook.remove()

    def _hook_parameters(self) -> None:
        for handle in self._handles:
            handle.remove()
        # Backward's usual order: the reverse of the model's (the root last).
        self._units = [_Unit(params) for params in reversed(fsdp_units(self._model))]
        self._unit_of = {id(p): u for u in self._units for p in u.params}
        self._hooked = self._sharded()
        hook = _weak_hook(self._on_gradient)  # Note [Gradient hooks that hold their owner weakly]
        self._handles = [
            p.register_post_accumulate_grad_hook(hook) for u in self._units for p in u.params
        ]

    def _sharded(self) -> list[tuple[int, bool]]:
        return [(id(p), p.requires_grad) for ps in _group_params(self._model) for p in ps]

    def _check_parameters(self, module: nn.Module, args: Any) -> None:
        stale = self._queued_for != -1 and autograd_compat.current_graph_task_id() == -1
        if stale:  # a backward that raised never ran its callback: what it started is dropped
            self._reset()
            self._queued_for = -1
        if self._sharded() != self._hooked:
            self._hook_parameters()

    def _hook_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        hook = _weak_hook(self._on_backward_start)
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(hook)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        """A gradient of the model's output: backward has begun, in its outermost task."""
        task = autograd_compat.current_graph_task_id()
        # Another task's callback pending: a backward that raised left it (no forward since).
        if self._queued_for != task and self.requires_reduction and self.replicas > 1:
            self._queue_finish()

    def _queue_finish(self) -> None:
        self._reset()
        self._queued_for = autograd_compat.current_graph_task_id()
        autograd_compat.queue_callback(self._finish)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.requires_reduction or self.replicas == 1:
            return
        if self._queued_for == -1:  # a backward that did not start at the model's output
            self._queue_finish()
        self._unit_of[id(param)].arrived.add(id(param))
        # Note [Deferred replica reduction]: complete units start in the fixed order only.
        while self._next < len(self._units):
            unit = self._units[self._next]
            if len(unit.arrived) < len(unit.params):
                break
            self._start(unit)

    def _reset(self) -> None:
        self._inflight = []
        self._next = 0
        for unit in self._units:
            unit.arrived = set()

    def _start(self, unit: _Unit) -> None:
        """Starts the all-reduce of ``unit``'s gradients, zeros where none arrived."""
        assert unit is self._units[self._next]
        self._next += 1
        filled = [i for i, p in enumerate(unit.params) if p.grad is None]
        with torch.no_grad():
            for i in filled:  # unused by this rank's batch: its peers' average
                unit.params[i].grad = torch.zeros_like(unit.params[i])
        grads = [_local(p.grad) for p in unit.params]
        dtype = self.reduce_dtype or grads[0].dtype
        n = sum(g.numel() for g in grads)
        buffer = torch.empty(n + len(grads), dtype=dtype, device=grads[0].device)
        for view, g in zip(_views(buffer[:n], grads), grads):
            view.copy_(g)
        buffer[n:] = 1.0  # the flags: which parameters this rank's batch used
        buffer[[n + i for i in filled]] = 0.0
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._inflight.append(_InFlight(work, buffer, grads, unit.params, filled))
        self.calls += 1

    def _finish(self) -> None:
        """Backward's end: starts what is left, waits for every call, writes the averages."""
        try:
            # No gradient at all: FSDP2 reduced nothing (no_sync), so neither does this.
            if any(unit.arrived for unit in self._units) or self._inflight:
                while self._next < len(self._units):  # some parameters got no gradient
                    self._start(self._units[self._next])
            start = time.perf_counter()
            for call in self._inflight:
                call.work.wait()
            self.wait_seconds = time.perf_counter() - start
            for call in self._inflight:
                n = call.buffer.numel() - len(call.grads)
                for view, g in zip(_views(call.buffer[:n], call.grads), call.grads):
                    g.copy_(view).div_(self.replicas)  # divided in the gradient's dtype
                if call.filled:  # used by no replica's batch: no gradient, as in one process
                    unused = (call.buffer[n:] == 0).tolist()
                    for i in call.filled:
                        if unused[i]:
                            call.params[i].grad = None
        finally:
            self._reset()
            self._queued_for = -1


# Note [Gradient hooks that hold their owner weakly]: PyTorch keeps a tensor's
# post-accumulate-grad hooks in C++ and does not show them to Python's garbage collector, so a
# cycle parameter -> hook -> ReplicaReduction -> parameter is never freed, and with it the
# model, its DTensors' meshes and every process group of those meshes (a gloo group keeps
# three threads and its sockets). The hooks therefore hold the reduction weakly; the model's
# forward pre-hook (an ordinary module hook, which the collector sees) keeps it alive as long
# as the model, and the user's reference as long as they keep it.
def _weak_hook(bound: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls the method ``bound`` while its object lives."""
    method = weakref.WeakMethod(bound)

    def hook(tensor: torch.Tensor) -> None:
        call = method()
        if call is not None:
            call(tensor)

    return hook


def _views(buffer: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``buffer`` cut into consecutive pieces shaped like ``grads``."""
    pieces = buffer.split([g.numel() for g in grads])
    return [piece.view_as(g) for piece, g in zip(pieces, grads)]


def _local(grad: torch.Tensor | None) -> torch.Tensor:
    """The local shard of a (DTensor) gradient; writes to it change the gradient."""
    assert grad is not None  # the hook runs after FSDP2 assigned it
    with torch.no_grad():
        return grad.to_local() if isinstance(grad, DTensor) else grad


__all__ = ["ReplicaReduction", "fsdp_units"]
