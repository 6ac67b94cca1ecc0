"""Bytes of parameters, gradients and AdamW state on one rank: FSDP's own arithmetic, exactly.

Each parameter is first cut as ``tsm.transform`` cuts it (its TP style's dimension over the
TP ranks, ``torch_sagemaker/tensor_parallel/styles.py:PARAM_SPLIT_DIMS``; fused experts over
the EP ranks with an MoEConfig), then sharded as the FSDP version shards it over the group
``tsm.state.sharding_plan`` names:

- FSDP2 (``fully_shard``): every parameter on its own, along dim 0, in ``ceil(d0 / S)``-row
  chunks; each rank's storage is one padded chunk (the last ranks' chunks are partly or
  wholly padding). A unit's gradients are views of one reduce-scatter buffer of the padded
  chunks (cast once to the parameter dtype under mixed precision).
- FSDP1 (``FlatParameter``, ``use_orig_params=True`` as SMP forces): a unit's parameters,
  in module order, are flattened into one vector; before each parameter, padding aligns it
  to 16 bytes of the compute dtype, and at the end the vector is padded to a multiple of the
  group size. Each rank keeps one equal slice (the whole vector under NO_SHARD); its
  gradient is a slice of the same size. The original parameters are views of the slice.
- AdamW: ``exp_avg`` and ``exp_avg_sq`` like each parameter's local (unpadded) part, and a
  4-byte float32 ``step``, for every parameter with a gradient on this rank (FSDP1 gives the
  parameters that do not reach into a rank's slice no gradient, so they get no state there).
- Parameters no output of the forward reaches (``ModelSpec.untrained``): FSDP2 gives them
  no gradient (its reduce-scatter holds only the parameters that have one), so no AdamW
  state either; FSDP1's flat gradient covers its whole slice, so they get a zero gradient
  and state there like the others.

Precision: parameters, gradients and optimizer state are float32 (FSDP mixed precision
keeps fp32 masters and casts to bf16 for compute and reduction, as SMP's examples run).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch_sagemaker.planner.model import ROOT, ModelSpec, Param
from torch_sagemaker.policies import HeadSplit
from torch_sagemaker.sharding_plan import MESHES, ShardingPlan
from torch_sagemaker.sharding_plan import resolve as resolve_plan
from torch_sagemaker.tensor_parallel.styles import param_split_dim
from torch_sagemaker.topology import Layout

FP32 = 4
STEP_BYTES = 4  # AdamW's step: a float32 scalar tensor per parameter (not capturable/fused)
ALIGN_BYTES = 16  # FSDP1 aligns each original parameter in the flat parameter to 16 bytes


def chunk(size: int, parts: int, index: int) -> int:
    """Length of chunk ``index`` of ``size`` split in ``parts`` as ``torch.chunk`` splits it."""
    step = math.ceil(size / parts) if size else 0
    return max(0, min(step, size - index * step))


@dataclass(frozen=True)
class StateBytes:
    """A rank's bytes of model state.

    Attributes:
        parameters: Parameter storages.
        gradients: Gradient storages.
        optimizer: AdamW state.
        updated: Parameter elements AdamW updates on this rank (the length of its moments).
    """

    parameters: int
    gradients: int
    optimizer: int
    updated: int

    @property
    def total(self) -> int:
        """All three."""
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class Sharding:
    """How one rank's parameters are cut: the degrees, its coordinates, the FSDP version.

    Attributes:
        plan: The ``ShardingPlan`` ``tsm.init`` would resolve.
        rank: The global rank whose bytes are counted.
        fsdp: 1 or 2.
        heads: The head split over the TP ranks.
        experts_split: Whether an MoEConfig splits the experts over the EP ranks.
        compute_bytes: Bytes of the compute dtype (FSDP1 aligns to it).
    """

    plan: ShardingPlan
    rank: int
    fsdp: int
    heads: HeadSplit
    experts_split: bool
    compute_bytes: int

    @functools.cached_property
    def tp_rank(self) -> int:
        """This rank's TP rank."""
        return self.plan.layout.coordinates(self.rank)["tp"]

    @functools.cached_property
    def ep_rank(self) -> int:
        """This rank's EP rank."""
        return self.plan.layout.ep_rank(self.rank)


def local_shape(param: Param, s: Sharding) -> tuple[int, ...]:
    """The shape of this rank's part of ``param`` after ``tsm.transform``."""
    layout = s.plan.layout
    shape = list(param.shape)
    if param.expert and s.experts_split:
        shape[0] = chunk(shape[0], layout.ep, s.ep_rank)
    elif layout.tp > 1 and param.style is not None:
        dim = param_split_dim(param.style, param.leaf, kv_replicated=s.heads.kv_replicated)
        if dim is not None:
            shape[dim] = chunk(shape[dim], layout.tp, s.tp_rank)
    return tuple(shape)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _unit_of(param: Param, s: Sharding) -> str:
    """The FSDP unit that holds ``param`` (experts and routers are units of their own)."""
    layer = param.unit.partition(".")[2]
    if param.expert and s.experts_split:
        return f"experts.{layer}"
    if param.router and s.experts_split and s.compute_bytes != FP32:
        return f"routers.{layer}"  # fp32 units under mixed precision (sharding/experts.py)
    if param.unit == ROOT:
        return ROOT
    return f"layers.{layer}"


@functools.lru_cache(maxsize=4096)
def _group_of(layout: Layout, ranks_per_host: int, rank: int, mesh: str) -> tuple[int, int]:
    # A plan is a function of its layout and host size; rebuilt here so that it can be cached.
    plan = resolve_plan(layout, ranks_per_host)
    ranks = plan.dim_ranks(MESHES[mesh][-1], rank)
    return len(ranks), ranks.index(rank)


def _group(s: Sharding, mesh: str) -> tuple[int, int]:
    """(size, this rank's index) of the sharding dimension (the last) of ``mesh``."""
    return _group_of(s.plan.layout, s.plan.ranks_per_host, s.rank, mesh)


def _fsdp2(units: dict[str, list[tuple[tuple[int, ...], bool]]], s: Sharding) -> StateBytes:
    params = grads = optimizer = updated = 0
    for unit, shapes in units.items():
        mesh = s.plan.fsdp2_experts if unit.startswith("experts.") else s.plan.fsdp2_dense
        size, index = _group(s, mesh)
        for shape, trained in shapes:
            rows, rest = shape[0], _numel(shape[1:])
            padded = math.ceil(rows / size) * rest * FP32
            params += padded
            if not trained:
                continue
            # One reduce-scatter buffer per unit: the padded chunks of those with a gradient.
            grads += padded
            mine = chunk(rows, size, index) * rest
            updated += mine
            optimizer += 2 * mine * FP32 + STEP_BYTES
    return StateBytes(params, grads, optimizer, updated)


def _flat_layout(shapes: list[tuple[int, ...]], align: int, pad_to: int) -> tuple[list[int], int]:
    """Offsets of the parameters in FSDP1's flat parameter, and its padded length."""
    offsets, total = [], 0
    for shape in shapes:
        if total % align:
            total += align - total % align
        offsets.append(total)
        total += _numel(shape)
    if total % pad_to:
        total += pad_to - total % pad_to
    return offsets, total


def _fsdp1(units: dict[str, list[tuple[tuple[int, ...], bool]]], s: Sharding) -> StateBytes:
    params = optimizer = updated = 0
    align = ALIGN_BYTES // s.compute_bytes
    for unit, entries in units.items():
        shapes = [shape for shape, _ in entries]  # all get a (zero) gradient: module docstring
        experts = unit.startswith("experts.")
        if experts and s.plan.expert_group_size == 1:
            # Left out of FSDP1 (Note [FSDP1 experts on one rank]): plain local DTensors.
            local = sum(_numel(shape) for shape in shapes)
            params += local * FP32
            updated += local
            optimizer += sum(2 * _numel(sh) * FP32 + STEP_BYTES for sh in shapes)
            continue
        placement = s.plan.fsdp1(None, experts=experts)
        size, index = _group(s, placement.mesh)
        offsets, total = _flat_layout(shapes, align, size)
        sharded = placement.strategy.name != "NO_SHARD"
        length = total // size if sharded else total
        start = index * length if sharded else 0
        params += length * FP32
        for offset, shape in zip(offsets, shapes, strict=True):
            mine = max(0, min(offset + _numel(shape), start + length) - max(offset, start))
            if mine:
                updated += mine
                optimizer += 2 * mine * FP32 + STEP_BYTES
    return StateBytes(params, params, optimizer, updated)


def state_bytes(spec: ModelSpec, s: Sharding) -> StateBytes:
    """Parameter, gradient and AdamW bytes of rank ``s.rank`` (the module docstring).

    FSDP1 is taken as SMP's scripts call it: ``use_orig_params=True``, FULL_SHARD asked
    (``hybrid_shard_degree`` then decides), each transformer layer (and each split experts
    module) a unit.
    """
    units: dict[str, list[tuple[tuple[int, ...], bool]]] = {}
    untrained = spec.untrained
    # Note [Tied parameters count once]: a tied parameter (a head tied to the embedding) is
    # one parameter under every layout, so it is counted under its first name only. FSDP2
    # keeps the module's own (tied) parameters; FSDP1 flattens it once and records its other
    # names as shared, under tensor parallelism too (Note [Tied DTensor parameters under
    # FSDP1] in torch_sagemaker/sharding/fsdp1_tied.py; before that fix each name had its
    # own copy). The validation case "qwen2 tp2 no-shard FSDP1" measures it to the byte.
    for param in spec.params:
        if param.tied_to is None:
            trained = param.name not in untrained
            units.setdefault(_unit_of(param, s), []).append((local_shape(param, s), trained))
    return _fsdp2(units, s) if s.fsdp == 2 else _fsdp1(units, s)


def cached_state_bytes(spec: ModelSpec, s: Sharding, cache: dict | None) -> StateBytes:
    """``state_bytes``, remembered in ``cache`` (a dict shared by the candidates of one search).

    Within a search (one model) the model state depends on the layout, the FSDP version and
    the MoE setting, not on checkpointing or offloading.
    """
    key = (
        "state",
        s.plan.layout,
        s.plan.ranks_per_host,
        s.rank,
        s.fsdp,
        s.experts_split,
        s.compute_bytes,
        s.heads.kv_replicated,
    )
    if cache is None:
        return state_bytes(spec, s)
    if key not in cache:
        cache[key] = state_bytes(spec, s)
    return cache[key]


__all__ = ["Sharding", "StateBytes", "cached_state_bytes", "chunk", "local_shape", "state_bytes"]
