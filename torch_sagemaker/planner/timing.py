"""Predicted step time: compute from FLOPs, plus the communication compute does not hide.

Compute, per rank and step:

- Matrix multiplies: each weight matrix a token passes through costs 2 FLOPs per element
  in forward (the embedding none, an expert only for the rows routed to it), attention
  ``b x s^2 x heads x (qk + v) / cp`` (causal; ``qk`` and ``v`` the query/key and value
  head sizes, both ``head_dim`` but under latent attention); backward twice forward; checkpointing
  runs each layer's forward again. At ``Machine.matmul_flops`` (peak times the stated
  efficiency, or a measured rate).
- Elementwise work (norms, activations, softmax, residual adds, the loss) reads and writes
  the activations: four passes over what the layers would save without checkpointing (one
  more forward with checkpointing), at the memory bandwidth. A rough count, stated as one.
- The optimizer: AdamW over the rank's parameter shard, ``Machine.optimizer_seconds`` per
  element: every element its AdamW state covers (``shards.state_bytes``), the dense units'
  shard of their group and the experts' shard of theirs, which under expert parallelism is
  another, smaller group (and FSDP2's dim-0 chunks can leave rank 0 a whole expert).
- Framework overhead that does not grow with the tensors (operator dispatch, autograd,
  FSDP's hooks and DTensor's dispatch in the optimizer): ``Machine.step_overhead`` per step,
  ``Machine.layer_overhead`` per transformer layer (a third more with checkpointing, which
  runs the forward again) and ``Machine.unit_overhead`` per FSDP unit. Measured on CPU ranks
  (Note [Fixed overhead]); zero for accelerators, whose host runs ahead of their kernels.

Communication (``comm.seconds`` on the cluster's fabric), per layer and step:

- FSDP: all-gather of each unit's parameters in forward and again in backward (not the
  root's), reduce-scatter of its gradients, all-reduce over the replicas (HSDP) or of the
  whole gradients (no sharding), in the compute dtype.
- TP (sequence parallel): two all-gathers and two reduce-scatters of the residual stream per
  layer in forward, as many in backward, again in a recomputation; two more around the
  embedding and the head.
- CP: each layer's keys and values travel the ring (an all-gather of them) in forward and
  with their gradients in backward (an all-gather and a reduce-scatter).
- EP: each MoE layer's dispatch and combine (all-to-all of the rows) in forward and
  backward.

With gradient accumulation (``Candidate.accumulation_steps`` micro-batches a step) all of
the above is per micro-batch and repeats for each, but the optimizer and, under FSDP2, the
replicas' all-reduce run once a step (Note [Accumulation the planner plans] in
``candidates.py``).

What compute hides, where the cluster overlaps (``Cluster.overlap``): FSDP's collectives run
beside the compute of the layer before (prefetch), so each layer exposes only what exceeds
its compute, plus the first all-gather and the last reduction; CP's ring runs beside the
attention kernel. TP and EP collectives sit between the operations that need them and are
exposed whole. Without overlap (CPU ranks sharing cores with their collectives) everything
adds up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch_sagemaker.planner import comm
from torch_sagemaker.planner.activations import (
    ActivationShape,
    activation_bytes,
    experts_on_every_token,
    sparse_layers,
)
from torch_sagemaker.planner.candidates import Checked
from torch_sagemaker.planner.inputs import Workload
from torch_sagemaker.planner.model import ROOT, ModelSpec
from torch_sagemaker.planner.shards import Sharding, cached_state_bytes, chunk, local_shape
from torch_sagemaker.sharding_plan import MESHES
from torch_sagemaker.sharding_plan import resolve as resolve_plan
from torch_sagemaker.topology import AXES, Layout


@dataclass(frozen=True)
class Machine:
    """How fast one rank computes.

    Attributes:
        matmul_flops: FLOP/s of matrix multiplies (peak x efficiency, or measured).
        memory_bandwidth: Bytes/s of elementwise work.
        optimizer_seconds: Seconds of AdamW per parameter element.
        host_rate: Bytes/s to host memory, one direction (offloading); 0 for CPU ranks.
        step_overhead: Seconds per step that no layer accounts for (the embedding's, the
            head's and the loss's dispatch, the optimizer's start).
        layer_overhead: Seconds per transformer layer and step (forward, backward and its
            optimizer step) that do not depend on the tensors' sizes.
        unit_overhead: Seconds per FSDP unit and step beyond ``layer_overhead`` (hooks,
            gathered-parameter bookkeeping, DTensor dispatch in the optimizer).
        fsdp_byte_seconds: Seconds per byte of an FSDP unit's parameters and step that
            FSDP spends beside its collectives (copies into and out of the gathered buffers,
            their allocation).
    """

    matmul_flops: float
    memory_bandwidth: float
    optimizer_seconds: float
    host_rate: float = 0.0
    step_overhead: float = 0.0
    layer_overhead: float = 0.0
    unit_overhead: float = 0.0
    fsdp_byte_seconds: float = 0.0


# Note [Fixed overhead]
# ~~~~~~~~~~~~~~~~~~~~~
# On CPU ranks every operator costs its dispatch (Python, the dispatcher, autograd's
# bookkeeping) whatever its size, and FSDP2 adds its hooks and, in the optimizer, DTensor's
# dispatch per parameter. For the small models the benchmarks train this is a third of a
# step: bench multihost --train's Llama (hidden 256, 4 layers) spent about 95 of its 190 ms
# outside matrix multiplies on 2 ranks, of which the elementwise passes over its
# activations explain a few ms. The calibration (benchmarks/planner/calibration.py)
# measures the three terms on a model of the same family shrunk until its arithmetic is
# negligible (hidden 64, 8 tokens): one and three layers, with and without FSDP2 over a
# group of one rank, each with its optimizer step; the differences give the per-layer and
# per-unit terms and the rest the per-step one. The same difference on wider layers (hidden
# 512), less the per-unit term, over the layer's parameter bytes is FSDP2's cost per byte
# beside its collectives: on CPU ranks it copies every gathered parameter out of the
# gathered buffer and every gradient into the reduction's, and allocates both afresh,
# which page-faults; on bench training's Llama (234 MB of parameters on 2 ranks) that was
# about 0.2 s of a 1.3 s step. The backward is taken to cost twice the
# forward here as in FLOPs, so checkpointing's second forward adds a third of a layer's
# term. Accelerators launch kernels asynchronously: their host's overhead hides behind the
# kernels unless a model is tiny, which the planner does not model (terms 0).


@dataclass(frozen=True)
class TimeEstimate:
    """One step's predicted time on one rank.

    Attributes:
        flops: Matrix-multiply FLOPs of the rank.
        compute: Seconds of forward and backward compute (matmuls, elementwise work and
            the fixed overhead of Note [Fixed overhead]).
        optimizer: Seconds of the optimizer step.
        comm: Seconds of each kind of communication (``fsdp``, ``tp``, ``cp``, ``ep``) and,
            with offloading, the copies to the host that the compute does not hide.
        exposed: Seconds of communication the compute does not hide.
        step: The step: compute + optimizer + exposed.
        tokens_per_second: Tokens of the whole job per second.
    """

    flops: float
    compute: float
    optimizer: float
    comm: dict[str, float]
    exposed: float
    step: float
    tokens_per_second: float


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class _Units:
    """Elements of the layer and root units and the expert units, TP/EP-local."""

    layer: list[int]  # per layer: its dense weights' elements
    experts: list[int]  # per layer: its experts' elements on this rank
    root: int
    matmul_dense: list[int]  # per layer: elements of its 2-D weights (FLOPs)
    head: int  # elements of the output projection


def _units(spec: ModelSpec, s: Sharding, cache: dict | None) -> _Units:
    """``_count_units``, remembered per TP/EP cut in ``cache``."""
    layout = s.plan.layout
    key = ("units", layout.tp, layout.ep, s.experts_split, s.heads.kv_replicated)
    if cache is None:
        return _count_units(spec, s)
    if key not in cache:
        cache[key] = _count_units(spec, s)
    return cache[key]


def _count_units(spec: ModelSpec, s: Sharding) -> _Units:
    n = spec.num_layers
    layer, experts, dense = [0] * n, [0] * n, [0] * n
    root = head = 0
    embedding = spec.embedding
    for p in spec.params:
        if p.tied_to is not None:
            if p.tied_to == embedding:
                head += _numel(local_shape(p, s))  # a head tied to the embedding computes
            continue
        count = _numel(local_shape(p, s))
        if p.unit == ROOT:
            root += count
            if len(p.shape) == 2 and p.name != embedding:
                head += count
            continue
        index = int(p.unit.partition(".")[2])
        if p.expert:
            experts[index] += count
        else:
            layer[index] += count
            if len(p.shape) == 2:
                dense[index] += count
    return _Units(layer, experts, root, dense, head)


def _axis_ranks(layout: Layout, axis: str, count: int) -> list[int]:
    """Rank 0's group along ``axis``: its first ``count`` coordinates, the others at 0."""
    base = {a: 0 for a in AXES}
    return [layout.rank_at({**base, axis: k}) for k in range(count)]


def _group(checked: Checked, mesh: str) -> tuple[list[int], list[int]]:
    """(shard ranks, replicate ranks) of rank 0 on a mesh the plan names."""
    return _mesh_ranks(checked.plan.layout, checked.plan.ranks_per_host, mesh)


@functools.lru_cache(maxsize=4096)
def _mesh_ranks(layout: Layout, ranks_per_host: int, mesh: str) -> tuple[list[int], list[int]]:
    plan = resolve_plan(layout, ranks_per_host)  # a function of these two; cached by them
    dims = MESHES[mesh]
    shard = plan.dim_ranks(dims[-1], 0)
    replicate = plan.dim_ranks(dims[0], 0) if len(dims) > 1 else []
    return shard, replicate


@functools.lru_cache(maxsize=4096)
def _dim_ranks(layout: Layout, ranks_per_host: int, dim: str) -> list[int]:
    return resolve_plan(layout, ranks_per_host).dim_ranks(dim, 0)


def _fsdp_groups(checked: Checked, experts: bool) -> tuple[list[int], list[int], bool]:
    """(shard ranks, replicate ranks, sharded) of the dense or expert parameters."""
    c, plan = checked.candidate, checked.plan
    if c.fsdp == 2:
        mesh = plan.fsdp2_experts if experts else plan.fsdp2_dense
        shard, replicate = _group(checked, mesh)
        return shard, replicate, len(shard) > 1
    placement = plan.fsdp1(None, experts=experts)
    if placement.strategy.name == "NO_SHARD":
        ranks = _dim_ranks(plan.layout, plan.ranks_per_host, MESHES[placement.mesh][-1])
        return [], ranks, False
    shard, replicate = _group(checked, placement.mesh)
    return shard, replicate, True


def estimate(
    spec: ModelSpec,
    checked: Checked,
    workload: Workload,
    machine: Machine,
    fabric: comm.Fabric,
    *,
    overlap: bool,
    cache: dict | None = None,
) -> TimeEstimate:
    """The step time of one checked candidate (module docstring).

    ``cache``: a dict shared by the candidates of one search (what depends only on the TP/EP
    cut is computed once).
    """
    c, layout = checked.candidate, checked.plan.layout
    s = Sharding(checked.plan, 0, c.fsdp, checked.heads, c.moe, workload.compute_bytes)
    units = _units(spec, s, cache)
    a = workload.compute_bytes
    b, seq = checked.micro_batch, workload.seq_len
    tokens = b * seq // layout.cp
    heads_local, (qk_dim, v_dim) = checked.heads.local_heads, spec.qk_v_head_dims
    top_k = spec.policy.moe.top_k(spec.config) if spec.policy.moe else 0
    experts_total = spec.num_experts or 1
    sparse = sparse_layers(spec)
    # Rows each expert this rank holds computes: its share of the tokens' picks, from every
    # EP rank's tokens with an MoEConfig (TP ranks each see their own experts' picks only).
    expert_rows = tokens * top_k / experts_total * (layout.ep if c.moe else 1)
    if not c.moe and experts_on_every_token(spec):  # Note [Experts on every token]
        expert_rows = tokens
    attention = b * seq * seq * heads_local * (qk_dim + v_dim) / layout.cp
    fwd_layers = [
        2 * tokens * units.matmul_dense[i] + 2 * expert_rows * units.experts[i] + attention
        for i in range(spec.num_layers)
    ]
    fwd_head = 2 * tokens * units.head
    flops = 3 * (sum(fwd_layers) + fwd_head) + (sum(fwd_layers) if c.checkpointing else 0)
    shape = ActivationShape(layout, checked.heads, b, seq, a, c.moe)
    full = activation_bytes(spec, shape, checkpointing=False, offload=False, horizon=1)
    passes = 4 + (1 if c.checkpointing else 0)
    elementwise = passes * full.saved / machine.memory_bandwidth
    per_flop = 1 / machine.matmul_flops
    compute = flops * per_flop + elementwise
    layer_fwd = [f * per_flop + elementwise / passes / max(1, spec.num_layers) for f in fwd_layers]
    elements = units.root + sum(units.layer) + sum(units.experts)  # the rank's, TP/EP-local
    optimizer = cached_state_bytes(spec, s, cache).updated * machine.optimizer_seconds
    shard_dense = _fsdp_groups(checked, experts=False)
    # Note [Fixed overhead]: every layer, and one FSDP unit per layer and the root (every
    # candidate wraps them so; the per-unit term was measured with FSDP2).
    overhead = (
        machine.step_overhead
        + spec.num_layers * machine.layer_overhead * (1 + (1 / 3 if c.checkpointing else 0))
        + (spec.num_layers + 1) * machine.unit_overhead
        + elements * a * machine.fsdp_byte_seconds
    )
    compute += overhead

    def t(op: str, nbytes: float, ranks: list[int]) -> float:
        return comm.seconds(fabric, op, nbytes, ranks)

    def fsdp_unit(elements: int, groups: tuple[list[int], list[int], bool], root: bool):
        """(forward, backward, replicas' all-reduce) seconds of one unit per micro-batch."""
        shard, replicate, sharded = groups
        size = elements * a
        if not sharded:
            return 0.0, 0.0, t("all_reduce", size, replicate)
        gather = t("all_gather", size, shard)
        reduce = t("reduce_scatter", size, shard)
        all_reduce = t("all_reduce", size / max(1, len(shard)), replicate)
        return gather, (0.0 if root else gather) + reduce, all_reduce

    shard_experts = _fsdp_groups(checked, experts=True) if c.moe else shard_dense
    tp_group = _axis_ranks(layout, "tp", layout.tp)
    cp_group = _axis_ranks(layout, "cp", layout.cp)
    ep_group = _axis_ranks(layout, "dp_replicate", layout.ep)  # ep consecutive replicas
    residual = tokens * spec.dim("hidden_size") * a
    tp_layer = 4 * t("all_gather", residual, tp_group) if layout.tp > 1 else 0.0
    kv = tokens * checked.heads.local_kv_heads * (qk_dim + v_dim) * a * layout.cp
    cp_fwd = t("all_gather", kv, cp_group)
    cp_bwd = cp_fwd + t("reduce_scatter", kv, cp_group)
    ep_rows = tokens * top_k * spec.dim("hidden_size") * a
    ep_layer = 2 * t("all_to_all", ep_rows, ep_group) if c.moe and layout.ep > 1 else 0.0
    recompute = 1 if c.checkpointing else 0
    # Note [Accumulation the planner plans] in candidates.py: what follows is per
    # micro-batch, `steps` of them a step; `reducing` of them all-reduce over the replicas.
    steps = c.accumulation_steps
    reducing = steps if c.fsdp == 1 else 1
    totals = {"fsdp": 0.0, "tp": 0.0, "cp": 0.0, "ep": 0.0}
    exposed = 0.0
    root_fwd, root_bwd, root_ar = fsdp_unit(units.root, shard_dense, root=True)
    root = steps * (root_fwd + root_bwd) + reducing * root_ar
    totals["fsdp"] += root
    exposed += root  # the first gather and the last reduction wait
    # Layers alike in what they hold and compute cost alike: each kind is priced once.
    kinds: dict[tuple[int, int, bool, float], int] = {}
    for i in range(spec.num_layers):
        kind = (units.layer[i], units.experts[i], i in sparse, layer_fwd[i])
        kinds[kind] = kinds.get(kind, 0) + 1
    for (dense_elements, expert_elements, is_sparse, c_fwd), count in kinds.items():
        fwd, bwd, ar = fsdp_unit(dense_elements, shard_dense, root=False)
        if expert_elements:
            e_fwd, e_bwd, e_ar = fsdp_unit(expert_elements, shard_experts, root=False)
            fwd, bwd, ar = fwd + e_fwd, bwd + e_bwd, ar + e_ar
        c_bwd = (2 + recompute) * c_fwd
        tp = tp_layer * (2 + recompute)
        cp_t = (cp_fwd * (1 + recompute) + cp_bwd) if layout.cp > 1 else 0.0
        ep = ep_layer * (2 + recompute) if is_sparse else 0.0
        totals["fsdp"] += count * (steps * (fwd + bwd) + reducing * ar)
        totals["tp"] += count * steps * tp
        totals["cp"] += count * steps * cp_t
        totals["ep"] += count * steps * ep
        if overlap:
            attn = attention * per_flop * (3 + recompute)
            behind = (
                steps * max(0.0, fwd - c_fwd)
                + reducing * max(0.0, bwd + ar - c_bwd)
                + (steps - reducing) * max(0.0, bwd - c_bwd)
            )
            exposed += count * (behind + steps * (max(0.0, cp_t - attn) + tp + ep))
        else:
            exposed += count * (steps * (fwd + bwd + tp + cp_t + ep) + reducing * ar)
    if layout.tp > 1:
        edges = 2 * 2 * t("all_gather", residual, tp_group)  # embedding and head, both ways
        totals["tp"] += steps * edges
        exposed += steps * edges
    # Offloading copies each offloaded byte to the host in forward and back in backward:
    # on their own streams beside the compute on accelerators, by the CPU itself otherwise.
    offloaded = 0.0
    if c.offload:
        kept = activation_bytes(
            spec, shape, checkpointing=c.checkpointing, offload=True, horizon=c.horizon
        )
        copy_rate = machine.host_rate if overlap and machine.host_rate else 0.0
        if copy_rate:
            offloaded = max(0.0, 2 * kept.offloaded / copy_rate - compute)
        else:
            offloaded = 2 * kept.offloaded / machine.memory_bandwidth
        totals["offload"] = steps * offloaded
        exposed += steps * offloaded
    step = steps * compute + optimizer + exposed
    return TimeEstimate(
        flops=steps * flops,
        compute=steps * compute,
        optimizer=optimizer,
        comm=totals,
        exposed=exposed,
        step=step,
        tokens_per_second=workload.global_batch_tokens / step,
    )


__all__ = ["Machine", "TimeEstimate", "chunk", "estimate"]
