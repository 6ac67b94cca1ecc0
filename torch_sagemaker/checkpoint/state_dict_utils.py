"""State-dict kinds and helpers (``torch.sagemaker.distributed.checkpoint.state_dict_utils``).

Two kinds of sharded checkpoints exist:

- **sharded** (default): model and optimizer state as DTensors from
  ``torch.distributed.checkpoint.state_dict.get_state_dict``; DCP records global shapes and
  offsets, so it loads under any world size, hybrid shard degree or TP degree.
- **SM local** (``SMStateDictType.SM_LOCAL_STATE_DICT``): every rank's own local tensors as
  plain tensors, produced without any collective. Fast, but it only loads under the same
  shard layout (hybrid shard degree, tensor, context and expert parallel degrees); the
  number of replicas may change. The layout travels with the state dict and is checked on
  load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torch_sagemaker.checkpoint.constants import (  # SMP's adapter imports them here
    SMP_IS_LOAD_INFO_KEY,
    SMP_IS_PARTIAL_KEY,
)
from torch_sagemaker.state import state


class SMStateDictType(enum.Enum):
    """SMP's additional state-dict kinds (next to ``torch...fsdp.StateDictType``)."""

    SM_LOCAL_STATE_DICT = "sm_local_state_dict"


class SMLocalStateDict(dict):
    """A rank's local tensors (a plain ``dict``) plus ``layout``, their shard layout."""

    layout: dict[str, Any]


def current_layout() -> dict[str, Any]:
    """The parallel layout of this job: world size, degrees and this rank's shard coordinates."""
    distributed = dist.is_available() and dist.is_initialized()
    layout: dict[str, Any] = {"world_size": dist.get_world_size() if distributed else 1}
    if state.initialized:
        layout.update(
            hybrid_shard_degree=state.hybrid_shard_degree,
            tensor_parallel_degree=state.tensor_parallel_degree,
            context_parallel_degree=state.context_parallel_degree,
            expert_parallel_degree=state.expert_parallel_degree,
        )
    return layout


def shard_coordinates() -> dict[str, int]:
    """This rank's position inside one replica: (tp rank, ep rank, rank in the FSDP shard group)."""
    if not state.initialized:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return {"tp_rank": 0, "ep_rank": 0, "fsdp_rank": rank}
    return {
        "tp_rank": state.tp_rank,
        "ep_rank": state.ep_rank,
        "fsdp_rank": dist.get_rank(state.fsdp_shard_process_group),
    }


# What must match for an SM-local shard to load: the degrees that shape a shard and this rank's
# place among the shards. The world size may differ (replicas can change).
LOCAL_LAYOUT_KEYS = (
    "hybrid_shard_degree",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "tp_rank",
    "ep_rank",
    "fsdp_rank",
)


def local_layout_differences(saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The keys of ``LOCAL_LAYOUT_KEYS`` where ``saved`` differs from this rank: (saved, here)."""
    here = {**current_layout(), **shard_coordinates()}
    return {
        k: (saved.get(k), here.get(k)) for k in LOCAL_LAYOUT_KEYS if saved.get(k) != here.get(k)
    }


def local_subdir() -> str:
    """SMP's directory name of this rank's SM-local shard: ``tp{r}_ep{r}_fsdp{r}``."""
    c = shard_coordinates()
    return f"tp{c['tp_rank']}_ep{c['ep_rank']}_fsdp{c['fsdp_rank']}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_state_dict(model: nn.Module) -> SMLocalStateDict:
    """The model's parameters and buffers as this rank holds them (no communication)."""
    sd = SMLocalStateDict()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        sd[name] = _local(t).detach()
    sd.layout = {**current_layout(), **shard_coordinates()}
    return sd


def load_local_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Copies a ``local_state_dict`` back into ``model`` (same shard layout required).

    A state dict that carries its ``layout`` (as ``local_state_dict`` returns it) must have
    been saved by a rank with this rank's shard layout: shards of equal shapes from another TP
    rank or FSDP shard rank would otherwise load silently.

    Raises:
        ValueError: Naming the layout differences, or the missing, unexpected and wrongly
            shaped keys.
    """
    saved_layout = getattr(state_dict, "layout", None)
    if isinstance(saved_layout, dict):
        diff = local_layout_differences(saved_layout)
        if diff:
            raise ValueError(
                "SM-local state dict was saved under another shard layout; it loads only "
                "under the same hybrid_shard_degree, tensor/context/expert parallel degrees "
                "and on the rank of the same shard. Differences (saved, here): "
                + ", ".join(f"{k}={a}/{b}" for k, (a, b) in diff.items())
                + ". Load each rank's own state dict, or save a sharded checkpoint (the "
                "default kind) to change the layout."
            )
    targets = dict([*model.named_parameters(), *model.named_buffers()])
    missing = sorted(set(targets) - set(state_dict)) if strict else []
    unexpected = sorted(set(state_dict) - set(targets)) if strict else []
    shapes = [
        f"{k}: saved {tuple(v.shape)}, here {tuple(_local(targets[k]).shape)}"
        for k, v in state_dict.items()
        if k in targets and v.shape != _local(targets[k]).shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            "SM-local state dict does not fit this model's local shards (SM-local checkpoints "
            f"load only under the layout they were saved with): missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}, shape mismatches {shapes[:10]}."
        )
    with torch.no_grad():
        for k, v in state_dict.items():
            if k in targets:
                _local(targets[k]).copy_(v)


def local_optim_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with DTensor states replaced by their local tensors."""
    sd = optimizer.state_dict()
    sd["state"] = {
        idx: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for idx, s in sd["state"].items()
    }
    return sd


def load_local_optim_state_dict(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Loads a ``local_optim_state_dict``; states of DTensor parameters become DTensors again."""
    optimizer.load_state_dict(state_dict)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        if not isinstance(p, DTensor) or p not in optimizer.state:
            continue
        state = optimizer.state[p]
        for k, v in state.items():
            if (
                isinstance(v, torch.Tensor)
                and not isinstance(v, DTensor)
                and v.shape == p.to_local().shape
                and v.dim() > 0
            ):
                state[k] = DTensor.from_local(
                    v,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )


@contextlib.contextmanager
def sm_state_dict_type(
    model: nn.Module,
    state_dict_type: Any,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """Selects what ``model.state_dict()`` / ``model.load_state_dict()`` return and accept.

    Args:
        model: The (FSDP-wrapped) model.
        state_dict_type: ``SMStateDictType.SM_LOCAL_STATE_DICT``, or a
            ``torch.distributed.fsdp.StateDictType`` (forwarded to
            ``FSDP.state_dict_type`` for FSDP1 models; for other models ``FULL_STATE_DICT``
            gathers full tensors on every rank and ``SHARDED_STATE_DICT`` is the default).
        state_dict_config: Forwarded to FSDP1.
        optim_state_dict_config: Forwarded to FSDP1.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    if state_dict_type is SMStateDictType.SM_LOCAL_STATE_DICT:
        overrides = {
            "state_dict": lambda *a, **k: local_state_dict(model),
            "load_state_dict": lambda sd, strict=True, **k: load_local_state_dict(
                model, sd, strict
            ),
        }
    elif isinstance(state_dict_type, StateDictType) and isinstance(model, FSDP):
        with FSDP.state_dict_type(
            model, state_dict_type, state_dict_config, optim_state_dict_config
        ):
            yield
        return
    elif state_dict_type == StateDictType.FULL_STATE_DICT:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        overrides = {"state_dict": lambda *a, **k: get_model_state_dict(model, options=opts)}
    elif state_dict_type in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        overrides = {}
    else:
        raise ValueError(
            f"state_dict_type={state_dict_type!r} is not an SMStateDictType or "
            "torch.distributed.fsdp.StateDictType."
        )
    for name, fn in overrides.items():
        setattr(model, name, fn)  # an instance attribute shadows the class method
    try:
        yield
    finally:
        for name in overrides:
            model.__dict__.pop(name, None)


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = True) -> None:
    """Creates the optimizer's state (zeros) so a state-dict template exists before a load.

    Runs one step with zero gradients and learning rate 0, which leaves parameters unchanged
    (the loaded state then overwrites the step counts). Does nothing when state exists.

    Args:
        optimizer: The optimizer.
        skip_empty_param: Leave out parameters with no local elements (empty FSDP shards).
    """
    if optimizer.state:
        return
    params = [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad and not (skip_empty_param and p.numel() == 0)
    ]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    created = [p for p in params if p.grad is None]
    for p in created:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
        for p in created:
            p.grad = None


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``state_dict``, top-level ``Stateful`` values replaced by their state."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def find_local_layout(state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The layout of an ``SMLocalStateDict`` at the top level or one level down, if any."""
    for value in [state_dict, *state_dict.values()]:
        if isinstance(value, SMLocalStateDict):
            return value.layout
    return None


@dataclasses.dataclass
class _Interval:
    """What ``compute_auto_checkpoint_interval`` decided, and from which measurements.

    A plain dataclass of numbers: HyperPod's adapter stores it with ``dataclasses.asdict``
    in its checkpoints and restores it with ``_Interval(**state)``.

    Attributes:
        interval: Save every ``interval`` steps (at least 1).
        step_duration: Median seconds of a step without a save.
        checkpoint_overhead: Median seconds a save adds to the step that starts it (the
            blocking part: preprocessing, staging the state to CPU).
        io_duration: Median seconds the background write takes.
        max_overhead_fraction: The bound on saving's share of training time that was used.
    """

    interval: int = 1
    step_duration: float = 0.0
    checkpoint_overhead: float = 0.0
    io_duration: float = 0.0
    max_overhead_fraction: float = 0.0


def compute_auto_checkpoint_interval(
    step_durations: Sequence[float],
    step_ckpt_durations: Sequence[float],
    ckpt_preprocessing_durations: Sequence[float],
    ckpt_io_durations: Sequence[float],
    max_overhead_fraction: float = 0.05,
) -> _Interval:
    """The checkpoint interval (in steps) from measured step and save times ("auto checkpoint").

    Note [Automatic checkpoint interval]
        Asynchronous saves cost the training loop twice: the step that starts a save is
        longer by the save's blocking part (``overhead``: the step with a save minus a plain
        step, and at least the measured preprocessing), and the next save must wait until
        the previous background write (``io``) is done. Saving every ``n`` steps of
        ``step`` seconds therefore costs ``overhead / (n * step)`` of the training time, and
        writes never queue up when ``n * step >= io``. The interval is the smallest ``n``
        meeting both: ``n = max(1, ceil(overhead / (fraction * step)), ceil(io / step))``.
        The measurements are medians over the warm-up samples, so one slow step (a
        compilation, a first allocation) does not set the interval. The smaller the interval,
        the less work a failure loses, so the smallest ``n`` within the bound is the choice.

    Args:
        step_durations: Seconds of steps without a save.
        step_ckpt_durations: Seconds of steps that started a save.
        ckpt_preprocessing_durations: Seconds of each save's blocking preprocessing.
        ckpt_io_durations: Seconds of each save's background write.
        max_overhead_fraction: Largest share of training time saving may take (0 < f <= 1).

    Returns:
        The decision and its inputs (``.interval`` is the number of steps).

    Raises:
        ValueError: If a list is empty, a duration is negative or not finite, no plain step
            took any time, or ``max_overhead_fraction`` is outside (0, 1].
    """
    if not 0.0 < max_overhead_fraction <= 1.0:
        raise ValueError(
            f"max_overhead_fraction={max_overhead_fraction} must be in (0, 1], e.g. 0.05 "
            "for at most 5% of training time spent saving."
        )
    samples = {
        "step_durations": step_durations,
        "step_ckpt_durations": step_ckpt_durations,
        "ckpt_preprocessing_durations": ckpt_preprocessing_durations,
        "ckpt_io_durations": ckpt_io_durations,
    }
    for name, values in samples.items():
        if len(values) == 0:
            raise ValueError(f"{name} is empty; measure at least one step of each kind.")
        bad = [v for v in values if not math.isfinite(v) or v < 0]
        if bad:
            raise ValueError(f"{name} holds {bad[:3]}; durations are finite seconds >= 0.")
    step = statistics.median(step_durations)
    if step <= 0:
        raise ValueError(
            f"step_durations has median {step} s; plain steps must take time to compute "
            "an interval from."
        )
    overhead = max(
        statistics.median(step_ckpt_durations) - step,
        statistics.median(ckpt_preprocessing_durations),
        0.0,
    )
    io = statistics.median(ckpt_io_durations)
    interval = max(
        1,
        math.ceil(overhead / (max_overhead_fraction * step)),
        math.ceil(io / step),
    )
    return _Interval(
        interval=interval,
        step_duration=step,
        checkpoint_overhead=overhead,
        io_duration=io,
        max_overhead_fraction=max_overhead_fraction,
    )


__all__ = [
    "SMP_IS_LOAD_INFO_KEY",
    "SMP_IS_PARTIAL_KEY",
    "SMLocalStateDict",
    "_Interval",
    "compute_auto_checkpoint_interval",
    "SMStateDictType",
    "current_layout",
    "init_optim_state",
    "load_local_optim_state_dict",
    "load_local_state_dict",
    "local_optim_state_dict",
    "local_state_dict",
    "local_subdir",
    "resolve_stateful",
    "shard_coordinates",
    "sm_state_dict_type",
]
