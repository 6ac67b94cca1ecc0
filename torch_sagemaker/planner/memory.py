"""Per-rank device memory of one configuration: model state, activations, buffers, the peak.

- Model state (``shards.state_bytes``): parameters, gradients and AdamW state, exact to the
  byte for FSDP's sharding (tests/distributed/test_planner_memory.py compares them with the
  live storages).
- Saved activations (``activations.activation_bytes``): within 10% of what a
  ``saved_tensors_hooks`` counts, with and without checkpointing and offloading (same test;
  sliding windows in tests/unit/test_planner_memory_terms.py). With checkpointing, a sliding
  window's boolean mask, which the checkpoint's closure keeps and no hook sees, is counted on
  top (Note [A checkpoint's closure keeps the mask]).
- Communication buffers: what FSDP holds unsharded while a unit computes, in the compute
  dtype. The root unit (embedding, final norm, head) stays unsharded from its forward to its
  backward (``shard_model`` gives it ``reshard_after_forward=False``; FSDP1 does not reshard
  its root), a transformer layer's parameters are gathered while it runs and the next
  one's are prefetched (two layers), and one layer's unsharded gradients wait for their
  reduce-scatter. FSDP2 does the same over a shard group of one rank
  (``hybrid_shard_degree=1``): its unsharded parameters are copies of the shards, and its
  gradients pass through the reduce-scatter buffers all the same; only its prefetch
  allocates nothing there (the copy is made when the unit runs), so one layer is gathered,
  not two (measured on two CPU ranks, tests/unit/test_planner.py). FSDP1 over one rank
  is NO_SHARD (PyTorch switches a group of one to it): it computes in its flat parameter
  itself, which in fp32 is no buffer at all; under mixed precision each unit's
  low-precision copy (``_mp_shard``) is counted as gathered.
- Transient: the largest short-lived allocation of a step, either at the loss (the logits,
  their float32 copy and its gradient) or during one layer's backward (with checkpointing its
  recomputed activations, and the activation gradients, taken as four residual-stream tensors).
- Peak: parameters + optimizer state + buffers + the larger of (saved activations + the
  transient) and (gradients + one layer's transient), the end of backward, where FSDP2 with
  replicas and a low-precision reduction also still holds every unit's all-reduce buffer
  (Note [FSDP2's all-reduce buffers]). SMP's scripts zero gradients with
  ``set_to_none=True``, so a step starts backward with its activations and no gradients,
  and ends it the other way round. With gradient accumulation every micro-batch after the
  first runs with the sharded gradients held (FSDP2 with replicas: its partial sums, in the
  reduction's dtype), so the first term adds them (Note [Accumulation the planner plans]
  in ``candidates.py``).

Note [FSDP2's all-reduce buffers]
    With replicas (HSDP), FSDP2 all-reduces each unit's reduce-scattered gradients in the
    reduction's dtype and keeps that buffer until backward ends (torch 2.13's
    ``FSDPParamGroup`` holds it across units, so that the caching allocator cannot hand it
    to the next unit's reduce-scatter while the all-reduce may still run). Under a bf16
    reduction the fp32 gradients are copies, so the end of backward holds both: measured
    on 2 CPU ranks with four micro-batches (``python -m benchmarks planner peak``), the
    resident set rose by a unit's fp32 gradients at each unit's reduction and fell by
    every bf16 buffer only when backward ended. Under an fp32 reduction the gradients are
    views of the buffers: nothing more.

Not modelled (docs/planner.md): the caching allocator's fragmentation and rounding, the CUDA
context and the communication library's own buffers (``Cluster.usable_memory`` leaves room
for them), and the host memory that offloading uses (reported as ``offloaded``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_sagemaker.planner.activations import ActivationShape, activation_bytes
from torch_sagemaker.planner.candidates import Checked
from torch_sagemaker.planner.inputs import Workload
from torch_sagemaker.planner.model import ROOT, ModelSpec
from torch_sagemaker.planner.shards import Sharding, cached_state_bytes, local_shape
from torch_sagemaker.sharding_plan import MESHES


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes on one rank (rank 0, which gets the largest part of uneven splits).

    Attributes:
        parameters: Sharded fp32 parameters.
        gradients: Sharded fp32 gradients.
        optimizer: AdamW state.
        activations: Saved activations on the device at the end of forward.
        buffers: FSDP's unsharded parameters and gradients (module docstring).
        transient: The largest short-lived allocation.
        peak: The predicted peak.
        offloaded: Activations offloading keeps in host memory.
        held_gradients: What gradient accumulation holds through every micro-batch after
            the first (the sharded gradients, or FSDP2's partial sums); 0 with one.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    transient: int
    peak: int
    offloaded: int
    held_gradients: int = 0

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return dict(self.__dict__)


def sharding(spec: ModelSpec, checked: Checked, workload: Workload, rank: int = 0) -> Sharding:
    """The ``Sharding`` of ``rank`` under a checked candidate."""
    c = checked.candidate
    return Sharding(
        plan=checked.plan,
        rank=rank,
        fsdp=c.fsdp,
        heads=checked.heads,
        experts_split=c.moe,
        compute_bytes=workload.compute_bytes,
    )


def activation_shape(checked: Checked, workload: Workload, rank: int = 0) -> ActivationShape:
    """The ``ActivationShape`` of ``rank`` under a checked candidate."""
    layout = checked.plan.layout
    return ActivationShape(
        layout=layout,
        heads=checked.heads,
        micro_batch=checked.micro_batch,
        seq_len=workload.seq_len,
        compute_bytes=workload.compute_bytes,
        moe_layer=checked.candidate.moe,
        tp_rank=layout.coordinates(rank)["tp"],
    )


def _unit_bytes(spec: ModelSpec, s: Sharding) -> dict[str, int]:
    """Elements of the local (TP/EP-cut, unsharded) parameters FSDP gathers together.

    The root's, and each transformer layer's with its experts (Note [A layer gathers its
    experts]).
    """
    # Note [A layer gathers its experts]
    #     ``Param.unit`` names a layer's experts ``experts.<i>`` apart from ``layers.<i>``, but
    #     what FSDP holds unsharded while a layer runs is all of them. Without an MoEConfig
    #     the experts are in the layer's own FSDP unit (``shards._unit_of``,
    #     ``sharding/fsdp2.py``); with one they (and, under mixed precision, the router) are
    #     units of their own nested in the layer, which its forward gathers too, and its
    #     backward reduce-scatters their gradients with the layer's. So the buffers are sized
    #     by whole layers, keyed ``layers.<i>``.
    units: dict[str, int] = {}
    for p in spec.params:
        if p.tied_to is not None:
            continue
        n = 1
        for d in local_shape(p, s):
            n *= d
        key = ROOT if p.unit == ROOT else f"layers.{p.unit.partition('.')[2]}"
        units[key] = units.get(key, 0) + n
    return units


def _dense_group(checked: Checked) -> tuple[int, bool]:
    """(ranks of rank 0's shard group of the dense units, whether FSDP gathers them).

    FSDP1 gathers nothing under NO_SHARD, which it also uses for any group of one rank.
    """
    plan = checked.plan
    if checked.candidate.fsdp == 2:
        mesh, no_shard = plan.fsdp2_dense, False
    else:
        placement = plan.fsdp1(None)
        mesh, no_shard = placement.mesh, placement.strategy.name == "NO_SHARD"
    size = len(plan.dim_ranks(MESHES[mesh][-1], 0))
    return size, not no_shard and (checked.candidate.fsdp == 2 or size > 1)


def _fsdp2_replicas(checked: Checked) -> bool:
    """Whether every FSDP2 unit all-reduces its gradients over replicas (HSDP).

    Then FSDP2 keeps each unit's all-reduce buffer to the end of backward (Note [FSDP2's
    all-reduce buffers]), and accumulation holds partial sums (Note [Accumulation the
    planner plans] in ``candidates.py``).
    """
    plan, c = checked.plan, checked.candidate
    if c.fsdp != 2:
        return False
    meshes = [plan.fsdp2_dense, *([plan.fsdp2_experts] if c.moe else [])]
    return all(len(MESHES[m]) > 1 and len(plan.dim_ranks(MESHES[m][0], 0)) > 1 for m in meshes)


def estimate(
    spec: ModelSpec, checked: Checked, workload: Workload, cache: dict | None = None
) -> MemoryEstimate:
    """The memory estimate of one checked candidate (module docstring).

    ``cache``: a dict shared by the candidates of one search (model state depends only on the
    layout, the FSDP version and the MoE setting, not on checkpointing or offloading).
    """
    c = checked.candidate
    s = sharding(spec, checked, workload)
    state = cached_state_bytes(spec, s, cache)
    act = activation_bytes(
        spec,
        activation_shape(checked, workload),
        checkpointing=c.checkpointing,
        offload=c.offload,
        horizon=c.horizon,
    )
    a = workload.compute_bytes
    ukey = ("unit bytes", checked.plan.layout.tp, checked.plan.layout.ep, c.moe)
    if cache is None or ukey not in cache:
        units = _unit_bytes(spec, s)
        if cache is not None:
            cache[ukey] = units
    else:
        units = cache[ukey]
    layer_units = [n for u, n in units.items() if u != ROOT]
    largest = max(layer_units, default=0)
    gkey = ("dense group", checked.plan.layout, checked.plan.ranks_per_host, c.fsdp)
    if cache is None or gkey not in cache:
        group = _dense_group(checked)
        if cache is not None:
            cache[gkey] = group
    else:
        group = cache[gkey]
    size, gathers = group
    if gathers:  # the root, the running and the prefetched layer, one layer's gradients
        buffers = (units.get(ROOT, 0) + (2 if size > 1 else 1) * largest + largest) * a
    else:  # FSDP1 NO_SHARD: the low-precision copies under mixed precision, else nothing
        buffers = (units.get(ROOT, 0) + 2 * largest) * a if a != 4 else 0
    shape = activation_shape(checked, workload)
    tokens = shape.micro_batch * workload.seq_len // checked.plan.layout.cp
    residual = 4 * tokens * spec.dim("hidden_size") * a
    layer_transient = residual + (act.layer if c.checkpointing else 0)
    loss_transient = act.logits * (1 + (4 + 4) // a)  # logits, their fp32 copy and gradient
    transient = max(layer_transient, loss_transient)
    replicas = _fsdp2_replicas(checked)
    reduce_buffers = state.gradients * a // 4 if replicas and a < 4 else 0
    end_of_backward = state.gradients + reduce_buffers + layer_transient
    held = 0
    if c.accumulation_steps > 1:  # Note [Accumulation the planner plans]
        held = state.gradients * a // 4 if replicas else state.gradients
    during_backward = max(held + act.saved + transient, end_of_backward)
    peak = state.parameters + state.optimizer + buffers + during_backward
    return MemoryEstimate(
        parameters=state.parameters,
        gradients=state.gradients,
        optimizer=state.optimizer,
        activations=act.saved,
        buffers=buffers,
        transient=transient,
        peak=peak,
        offloaded=act.offloaded,
        held_gradients=held,
    )


__all__ = ["MemoryEstimate", "activation_shape", "estimate", "sharding"]
