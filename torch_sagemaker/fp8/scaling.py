"""Per-layer FP8 scaling state, the amax reduction over ranks, and the delayed-scaling update.

Each FP8 linear layer owns one ``LinearScaling``: for its three FP8 tensors (roles ``X``
input, ``W`` weight, ``G`` output gradient) an amax history, the scale in use and the
largest amax seen since the last update ("pending").

Note [Delayed scaling rule] (Transformer Engine's rule, from its documentation and the
behaviour of its update, ``transformer_engine/common/recipe/delayed_scaling.cu`` and
``_amax_and_scale_update`` in its PyTorch package): a tensor's history is
``[amax_history_len]`` long; row 0 is a staging slot for the current step, rows 1.. hold
earlier steps from oldest to newest, all zero at first, and the first scale is 1. At an
update the step's amax goes to row 0; ``amax`` is the maximum over all rows (``"max"``),
row 0 alone (``"most_recent"``) or the recipe's function of the rows; the new scale is
``(fp8_max / amax) / 2**margin``, the old one kept where amax is 0 or not finite, and
fp32's largest value where the ratio overflows (amax below about 1e-36); then the rows
rotate up by one (the oldest drops out, the step's amax becomes the newest) and row 0 is
zeroed. The scale is thus computed from the last ``amax_history_len`` steps including the
current one, and used from the next step on. A tensor that no rank quantized since the last
update is left alone (history not rotated, scale unchanged). So is a tensor whose step amax
is 0 (it was all zeros, or all NaN: ``numerics.amax`` leaves NaNs out) under the named
algorithms, as Transformer Engine's fused update skips it: a zero never enters the history,
where it would push a real amax out of the window early. With a callable
``amax_compute_algo`` or ``scaling_factor_compute_algo`` Transformer Engine takes its
unfused path, which rotates the zero in like any amax; so does this one.

Note [When scales update]: as in Transformer Engine, the amaxes of the inputs and weights
are reduced and applied when the outermost ``fp8_autocast`` region exits
(``update_forward``), and those of the output gradients when the backward pass that
computed them ends (``update_backward``, an autograd engine callback), each with one
all-reduce per group of layers. So the forward of step t+1 and the backward of step t+1 use
histories through step t, and nothing is left pending once a step is done (a model dropped
after its last step leaves no state that some ranks would still reduce and others, having
collected it, would not). Activation checkpointing recomputes a forward during the backward,
after the region exited and the forward scales moved on: the recomputation quantizes with
the scales its original forward used (``LinearScaling.forward_scale``, kept by reference:
an update makes new tensors) and records nothing (Note [FP8 under recomputation] in
``linear.py``), so it rebuilds exactly the FP8 tensors the backward needs and every tensor
gets one history entry per step.

Note [Which ranks reduce amaxes]: with ``reduce_amax`` the pending amaxes are reduced (max)
over the autocast's ``fp8_group`` (``None``: every rank, as in Transformer Engine), so all
ranks hold the same scales. Ranks that hold shards of one tensor parallel layer must agree
in any case (they quantize parts of one tensor): where the group does not contain the
layer's tensor parallel ranks, or ``reduce_amax`` is False, a second reduction runs over
them. As in Transformer Engine, every rank must leave its outermost ``fp8_autocast`` region
and finish its backward passes at the same points, and run the same FP8 layers in each
(the order in which they first ran fixes the layout of the reduced buffer).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker._torch_compat import autograd as autograd_compat
from torch_sagemaker.fp8.numerics import delayed_scales, fp8_max
from torch_sagemaker.fp8.recipe import DelayedScaling

X, W, G = 0, 1, 2  # roles: input, weight, output gradient
ROLES = ("input", "weight", "grad_output")
LOCAL = "local"  # reduce_group of a layer whose recipe says reduce_amax=False

# Note [Scaling state outside inference mode]: a forward under ``torch.inference_mode()``
# (Lightning's default for validation) around ``fp8_autocast`` allocated or updated the
# scaling state there, which made it inference tensors; the next training step's in-place
# ``record`` then failed ("Inplace update to inference tensor outside InferenceMode"). The
# functions that create or replace the state run with inference mode off, so the state is
# always an ordinary tensor; the amaxes of an inference forward are read as inputs, which
# is allowed. Such a forward records amaxes and updates the forward scales, as under
# ``torch.no_grad()``.
_LIVE: weakref.WeakValueDictionary[int, LinearScaling] = weakref.WeakValueDictionary()
_ORDER = itertools.count()


class LinearScaling:
    """The delayed-scaling state of one FP8 linear layer (Note [Delayed scaling rule]).

    Attributes:
        history: ``[amax_history_len, 3]`` fp32, one column per role (``X``, ``W``, ``G``);
            ``None`` until the layer first runs in FP8 with a delayed-scaling recipe.
        scale: ``[3]`` fp32 scales in use.
        pending: ``[3]`` largest amax of each role since the last update, -1 if none.
        recipe: The ``DelayedScaling`` recipe of the last FP8 forward.
        reduce_group: Its amax reduction group (``None``: every rank; ``LOCAL``: none).
        tp_group: The tensor parallel group of a layer split over several ranks, else None.
    """

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.recipe: DelayedScaling | None = None
        self.reduce_group: Any = None
        self.tp_group: dist.ProcessGroup | None = None
        self.forward_scale: torch.Tensor | None = None  # ``scale`` at the last forward
        self.dirty_forward = False  # input or weight amax pending
        self.dirty_backward = False  # output-gradient amax pending
        self.last_settings: Any = None  # the layer's last forward outside a backward
        self._order: int | None = None

    # Set at each forward from the live region and mesh; a process group cannot be copied or
    # pickled, so ``copy.deepcopy(model)`` and ``torch.save(model)`` leave these out.
    _TRANSIENT = ("reduce_group", "tp_group", "last_settings", "forward_scale")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._TRANSIENT:
            state[name] = None
        state["dirty_forward"] = state["dirty_backward"] = False
        return state

    @torch.inference_mode(False)  # Note [Scaling state outside inference mode]
    def prepare(
        self, device: torch.device, recipe: DelayedScaling, group: Any, tp_group: Any
    ) -> None:
        """Allocates (or resizes, or moves) the state for ``recipe`` and records its group."""
        length = recipe.amax_history_len
        if self.history is None:
            self.history = torch.zeros(length, 3, device=device)
            self.scale = torch.ones(3, device=device)
            self.pending = torch.full((3,), -1.0, device=device)
        assert self.scale is not None and self.pending is not None
        if self.history.device != device:
            self.history, self.scale, self.pending = (
                t.to(device) for t in (self.history, self.scale, self.pending)
            )
        if self.history.shape[0] != length:  # keep the newest entries, row 0 stays staging
            kept = self.history[1:][-(length - 1) :] if length > 1 else self.history[:0]
            pad = torch.zeros(length - 1 - kept.shape[0], 3, device=device)
            self.history = torch.cat([torch.zeros(1, 3, device=device), pad, kept])
        self.recipe = recipe
        self.reduce_group = group if recipe.reduce_amax else LOCAL
        self.tp_group = tp_group
        if self._order is None or _LIVE.get(self._order) is not self:  # first use, or a copy
            self._order = next(_ORDER)
            _LIVE[self._order] = self

    @torch.inference_mode(False)  # Note [Scaling state outside inference mode]
    def load(self, history: torch.Tensor, scale: torch.Tensor) -> None:
        """Takes a saved history and scales (``scaling_state.py``), nothing pending.

        ``prepare`` at the next FP8 forward moves them to its device and fits the history to
        the recipe's length.
        """
        self.history = history.detach().float().clone()
        self.scale = scale.detach().float().clone()
        self.pending = torch.full((3,), -1.0, device=self.history.device)
        self.forward_scale = None
        self.dirty_forward = self.dirty_backward = False

    def forward_scale_of(self, role: int, recomputing: bool) -> torch.Tensor:
        """The scale of ``role`` for a forward.

        The current one, kept for a recomputation; or the one kept, when this forward is the
        recomputation (Note [When scales update]).
        """
        if not recomputing or self.forward_scale is None:
            self.forward_scale = self.scale
        assert self.forward_scale is not None, "prepare() first"
        return self.forward_scale[role]

    def scale_of(self, role: int) -> torch.Tensor:
        """The scale in use for ``role`` (an fp32 scalar tensor)."""
        assert self.scale is not None, "prepare() first"
        return self.scale[role]

    @torch.inference_mode(False)  # Note [Scaling state outside inference mode]
    def record(self, role: int, value: torch.Tensor) -> None:
        """Folds an amax of ``role`` into this step's pending maximum.

        The first output-gradient record of a backward pass arranges ``update_backward`` for
        the end of that pass.
        """
        assert self.pending is not None, "prepare() first"
        self.pending[role] = torch.maximum(self.pending[role], value)
        if role == G:
            self.dirty_backward = True
            _update_when_backward_ends()
        else:
            self.dirty_forward = True


def _covers(group: Any, tp_group: dist.ProcessGroup) -> bool:
    """Whether amax reduction over ``group`` already includes every rank of ``tp_group``."""
    if group is None:
        return True
    if group == LOCAL:
        return False
    return set(dist.get_process_group_ranks(tp_group)) <= set(dist.get_process_group_ranks(group))


def reduce_max(t: torch.Tensor, group: Any) -> None:
    """All-reduce (max) of ``t`` in place over ``group`` (``None``: every rank)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def _tensors(members: list[LinearScaling], name: str) -> list[torch.Tensor]:
    """``member.<name>`` of each member (all prepared, so none is None)."""
    out = [getattr(m, name) for m in members]
    assert all(t is not None for t in out)
    return out


_CONSTANTS: dict[tuple, torch.Tensor] = {}


@torch.inference_mode(False)  # Note [Scaling state outside inference mode]
def _constant(device: torch.device, what: str, values: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of ``values`` on ``device``, made once.

    Made afresh at each update, it would be a copy from host memory, which on a GPU waits for
    the device to finish its queued work and so stops the host from running ahead.
    """
    key = (device, what, values, dtype)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return _CONSTANTS[key]


@torch.inference_mode(False)  # Note [Scaling state outside inference mode]
def _update(members: list[LinearScaling], roles: tuple[int, ...]) -> None:
    """Reduces the members' pending amaxes of ``roles`` and applies the rule to them at once."""
    first = members[0]
    recipe = first.recipe
    assert recipe is not None
    pending = torch.stack(_tensors(members, "pending"))  # [n, 3]
    device = pending.device
    wanted = _constant(device, "roles", tuple(r in roles for r in range(3)), torch.bool)
    amaxes = torch.where(wanted, pending, -1.0)
    if first.reduce_group != LOCAL:
        reduce_max(amaxes, first.reduce_group)
    if first.tp_group is not None and not _covers(first.reduce_group, first.tp_group):
        reduce_max(amaxes, first.tp_group)
    seen = amaxes >= 0  # quantized on some rank since the last update
    history = torch.stack(_tensors(members, "history"), dim=1)  # [L, n, 3]
    old = torch.stack(_tensors(members, "scale"))  # [n, 3]
    staged = history.clone()
    staged[0] = torch.where(seen, amaxes, history[0])
    fmt = recipe.fp8_format
    limits = (fp8_max(fmt.forward_dtype),) * 2 + (fp8_max(fmt.backward_dtype),)
    max_value = _constant(device, "limits", limits, torch.float32).expand_as(old)
    if recipe.scaling_factor_compute_algo is not None:
        max_value = max_value.clone()  # a user's function gets its own, not the cached one
    length, n = staged.shape[0], len(members)
    new = delayed_scales(
        staged.reshape(length, 3 * n), old.reshape(-1), max_value.reshape(-1), recipe
    ).reshape(n, 3)
    rotated = staged.roll(-1, dims=0)
    rotated[0] = 0.0
    unfused = callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None
    applied = seen if unfused else seen & (amaxes != 0)  # Note [Delayed scaling rule]
    history = torch.where(applied, rotated, history)
    scale = torch.where(applied, new, old)
    pending = torch.where(wanted, -1.0, pending)
    for i, m in enumerate(members):
        m.history, m.scale, m.pending = history[:, i].clone(), scale[i].clone(), pending[i].clone()


def _update_roles(roles: tuple[int, ...], dirty: str) -> None:
    """Applies the pending amaxes of ``roles`` of every layer whose ``dirty`` flag is set."""
    states = [state for _, state in sorted(_LIVE.items()) if getattr(state, dirty)]
    buckets: dict[tuple, list[LinearScaling]] = {}
    for state in states:
        setattr(state, dirty, False)
        key = (
            state.reduce_group if state.reduce_group in (None, LOCAL) else id(state.reduce_group),
            id(state.tp_group) if state.tp_group is not None else None,
            state.recipe,
            None if state.pending is None else state.pending.device,
        )
        buckets.setdefault(key, []).append(state)
    for members in buckets.values():
        _update(members, roles)


def update_forward() -> None:
    """Applies the pending input and weight amaxes, when the outermost region exits.

    Notes [When scales update], [Which ranks reduce amaxes]. No collective when no layer ran
    in FP8 in the region.
    """
    _update_roles((X, W), "dirty_forward")


def update_backward() -> None:
    """Applies the pending output-gradient amaxes, when a backward that ran FP8 layers ends."""
    _update_roles((G,), "dirty_backward")


_CALLBACK_QUEUED: set[int] = set()  # backward passes (graph task ids) that will update


def _update_when_backward_ends() -> None:
    task = autograd_compat.current_graph_task_id()
    if task == -1:  # not inside a backward pass (a direct call): apply now
        update_backward()
        return
    if task not in _CALLBACK_QUEUED:
        _CALLBACK_QUEUED.add(task)

        def done() -> None:
            _CALLBACK_QUEUED.discard(task)
            update_backward()

        autograd_compat.queue_callback(done)


__all__ = [
    "G",
    "LOCAL",
    "ROLES",
    "W",
    "X",
    "LinearScaling",
    "reduce_max",
    "update_backward",
    "update_forward",
]
