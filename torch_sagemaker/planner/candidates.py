"""The configurations the planner tries, and which of them the library accepts.

A ``Candidate`` is one SMP config (the four degrees, offloading and its horizon) plus what
the training script chooses (FSDP1 or FSDP2, activation checkpointing, an MoEConfig for MoE
models, the micro-batches a step). ``enumerate_candidates`` walks every combination the
limits allow; ``check`` rules each valid or invalid with the library's own checks, in the
order a job meets them:

1. ``tsm.init``: ``torch_sagemaker/_init.py:dry_run`` (``config.validate`` and the sharding
   plan, on the cluster's world size and ranks per host);
2. ``tsm.transform``: ``torch_sagemaker/_transform.py:check_model_config`` (heads, experts
   and split sizes against the degrees, MoEConfig against TP/CP, sliding windows with CP);
3. FSDP1's expert units (``ShardingPlan.fsdp1_expert_problem``, as FSDP1's constructor asks);
4. the batch: context parallelism cuts each sequence into ``2 x cp`` chunks
   (``context_parallel/layout.py:check_local_length``, the forward's input check), the
   global batch must split into whole sequences over the data-parallel ranks, and each
   rank's sequences into whole micro-batches (``gradient_accumulation_steps``).

Nothing here restates a rule: an invalid candidate carries the message the library raised.
Two rules are the planner's own, checked first (stage ``planner``): offloading is tried only
with activation checkpointing (SMP's documented use), and expert parallelism only for models
with experts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch_sagemaker import _init, _transform
from torch_sagemaker.config import ConfigError
from torch_sagemaker.context_parallel.layout import check_local_length
from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.planner.inputs import Cluster, Limits, Workload
from torch_sagemaker.planner.model import ModelSpec
from torch_sagemaker.policies import HeadSplit
from torch_sagemaker.sharding_plan import ShardingPlan


@dataclass(frozen=True)
class Candidate:
    """One configuration: SMP's parameters and the script's choices.

    Attributes:
        hybrid_shard_degree: As written in the SMP config (0: native FSDP behaviour).
        tensor_parallel_degree: TP degree.
        context_parallel_degree: CP degree.
        expert_parallel_degree: EP degree.
        fsdp: 1 (``FullyShardedDataParallel``, ``use_orig_params=True``) or 2 (``fully_shard``
            through ``torch_sagemaker.sharding.shard_model``).
        checkpointing: Activation checkpointing of every transformer layer.
        offload: ``sm_activation_offloading`` with ``offload_wrapper`` on the root.
        horizon: ``activation_loading_horizon``.
        moe: Whether ``tsm.transform`` gets an ``MoEConfig`` (``MoELayer``, experts over the EP
            ranks); without one an MoE model keeps its own block (experts split over TP).
        accumulation_steps: Micro-batches per optimizer step (gradient accumulation), each a
            forward and a backward that reduce-scatters its gradients into the shards; the
            replicas' all-reduce runs after the last one only under FSDP2
            (``set_requires_all_reduce(False)`` on the others), after each under FSDP1 (Note
            [Accumulation the planner plans]).
    """

    hybrid_shard_degree: int
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    fsdp: int = 2
    checkpointing: bool = True
    offload: bool = False
    horizon: int = 2
    moe: bool = False
    accumulation_steps: int = 1

    def smp_config(self) -> dict[str, Any]:
        """The SMP config (``tsm.init``'s argument, or ``SM_HP_MP_PARAMETERS``)."""
        return {
            "hybrid_shard_degree": self.hybrid_shard_degree,
            "tensor_parallel_degree": self.tensor_parallel_degree,
            "context_parallel_degree": self.context_parallel_degree,
            "expert_parallel_degree": self.expert_parallel_degree,
            "sm_activation_offloading": self.offload,
            "activation_loading_horizon": self.horizon,
        }

    def script(self) -> dict[str, Any]:
        """What the training script does besides ``tsm.init`` (for the report)."""
        return {
            "fsdp": self.fsdp,
            "activation_checkpointing": self.checkpointing,
            "offload_wrapper": self.offload,
            "transform_config": "MoEConfig()" if self.moe else None,
            "gradient_accumulation_steps": self.accumulation_steps,
        }

    def label(self) -> str:
        """A short one-line description."""
        parts = [
            f"hsd{self.hybrid_shard_degree}",
            f"tp{self.tensor_parallel_degree}",
            f"cp{self.context_parallel_degree}",
        ]
        if self.expert_parallel_degree > 1 or self.moe:
            parts.append(f"ep{self.expert_parallel_degree}")
        parts.append(f"fsdp{self.fsdp}")
        parts.append("ac" if self.checkpointing else "no-ac")
        if self.offload:
            parts.append(f"offload{self.horizon}")
        if self.accumulation_steps > 1:
            parts.append(f"ga{self.accumulation_steps}")
        return " ".join(parts)


# Note [Accumulation the planner plans]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A step of k micro-batches (``Candidate.accumulation_steps``) runs k forwards and backwards of
# ``Checked.micro_batch`` sequences each, then one optimizer step. Each backward
# reduce-scatters its gradients and adds them to the sharded gradients, FSDP's default. The
# alternative, ``no_sync()`` (FSDP1) or ``set_requires_gradient_sync(False)`` (FSDP2), keeps
# every unit's gradients unsharded until the last micro-batch: the whole model's gradients
# on every rank, and FSDP1's ``no_sync`` fails under TP (docs/training.md). So:
# - Memory: from the second micro-batch on, the sharded gradients are held through forward
#   and backward, so the peak adds them to the saved activations (memory.estimate). Under
#   FSDP2 with replicas they are partial sums in the reduction's dtype: with
#   ``set_requires_all_reduce(False)`` FSDP2 keeps each reduce-scatter's output as it is
#   and adds it to the fp32 gradients only after the last micro-batch's all-reduce, so
#   the fp32 gradients appear at the end of the last backward, which may be the peak where
#   the micro-batches are short. (Where some units have replicas and others not, an MoE
#   model's experts over EP, all count fp32: a little high.)
# - Communication: every micro-batch gathers each unit's parameters for its forward and its
#   backward and reduce-scatters its gradients, as a step of one micro-batch does. The
#   all-reduce over the replicas (HSDP) runs once per step under FSDP2, whose
#   ``set_requires_all_reduce(False)`` on all but the last micro-batch leaves the partial
#   sums in the shards (tests/distributed/test_replica_reduction.py checks that recipe
#   against one process), and after every micro-batch under FSDP1, which has no such switch.
# - Compute: the FLOPs of all the sequences, the fixed overheads once per micro-batch; the
#   optimizer once (timing.estimate). On CPU ranks the overheads were calibrated on whole
#   steps, the optimizer's dispatch included, so there the prediction is high by that share
#   for each micro-batch after the first (accelerators have none).
# With the rest of a configuration fixed, more micro-batches never predict a shorter step
# (each collective but FSDP2's all-reduce is repeated, and compute hides less of each), and
# from two on they never predict more memory. So the fewest that fit is the fastest choice
# for a configuration, which is what the search picks when no limit names the steps
# (search.fewest_steps_that_fit).


@dataclass(frozen=True)
class Checked:
    """A candidate the library accepts, with what the models need.

    Attributes:
        candidate: The configuration.
        plan: The sharding plan ``tsm.init`` resolves.
        heads: The head split ``tsm.transform`` computes.
        micro_batch: Sequences each data-parallel rank trains per forward: its share of the
            global batch over ``candidate.accumulation_steps``.
    """

    candidate: Candidate
    plan: ShardingPlan
    heads: HeadSplit
    micro_batch: int


@dataclass(frozen=True)
class Rejected:
    """A candidate the library refuses, with its reason (the library's own message)."""

    candidate: Candidate
    stage: str
    reason: str


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check(
    candidate: Candidate, spec: ModelSpec, cluster: Cluster, workload: Workload
) -> Checked | Rejected:
    """Rules ``candidate`` valid or invalid with the library's checks (module docstring)."""
    c = candidate
    problem = _planner_problem(c, spec)
    if problem:
        return Rejected(c, "planner", problem)
    world = cluster.world_size
    try:
        _, plan = _init.dry_run(
            c.smp_config(), world_size=world, ranks_per_host=cluster.per_host, environ={}
        )
    except ConfigError as e:
        return Rejected(c, "tsm.init", "; ".join(e.problems))
    try:
        _, heads = _transform.check_model_config(
            spec.policy,
            spec.config,
            tp=c.tensor_parallel_degree,
            cp=c.context_parallel_degree,
            ep=c.expert_parallel_degree,
            config=MoEConfig() if c.moe else None,
            model_name=spec.name,
        )
    except (ValueError, TypeError) as e:
        return Rejected(c, "tsm.transform", str(e))
    if c.fsdp == 1:
        problem = plan.fsdp1_expert_problem(use_orig_params=True) if c.moe else None
        if problem:
            return Rejected(c, "FSDP1", problem)
    cp = c.context_parallel_degree
    if workload.seq_len % cp:
        return Rejected(
            c,
            "input",
            f"seq_len={workload.seq_len} does not split over context_parallel_degree={cp} "
            "ranks; use a sequence length divisible by 2 * context_parallel_degree.",
        )
    if cp > 1:
        try:
            check_local_length(workload.seq_len // cp, cp)
        except ValueError as e:
            return Rejected(c, "input", str(e))
    dp = plan.layout.dp_size
    if workload.sequences % dp:
        return Rejected(
            c,
            "input",
            f"the global batch of {workload.sequences} sequences ({workload.global_batch_tokens} "
            f"tokens) does not split over the {dp} data-parallel ranks (world / (tp * cp)); "
            f"use a multiple of {dp} sequences.",
        )
    per_rank, steps = workload.sequences // dp, c.accumulation_steps
    if per_rank % steps:
        return Rejected(
            c,
            "input",
            f"the {per_rank} sequences each data-parallel rank trains per step do not split "
            f"into gradient_accumulation_steps={steps} micro-batches; use a divisor of "
            f"{per_rank}.",
        )
    return Checked(c, plan, heads, per_rank // steps)


def _planner_problem(c: Candidate, spec: ModelSpec) -> str | None:
    """Why the planner itself does not plan ``c`` (its own rules, not the library's), or None."""
    if c.offload and not c.checkpointing:
        return (
            "sm_activation_offloading=True without activation checkpointing: the planner "
            "tries offloading only with checkpointing, as SMP documents it (each "
            "checkpointed layer's input is what goes to the host). Allow "
            "activation_checkpointing=true or activation_offloading=false."
        )
    if c.expert_parallel_degree > 1 and spec.num_experts == 0:
        return (
            f"expert_parallel_degree={c.expert_parallel_degree}: {spec.name} has no experts "
            "to split (a dense model). Use expert_parallel_degree=1."
        )
    return None


def _settings(c: Candidate) -> dict[str, Any]:
    """The value of each limitable setting (``inputs.SETTINGS``) in a candidate."""
    return {
        "hybrid_shard_degree": c.hybrid_shard_degree,
        "tensor_parallel_degree": c.tensor_parallel_degree,
        "context_parallel_degree": c.context_parallel_degree,
        "expert_parallel_degree": c.expert_parallel_degree,
        "activation_loading_horizon": c.horizon,
        "fsdp": c.fsdp,
        "activation_checkpointing": c.checkpointing,
        "activation_offloading": c.offload,
        "moe": c.moe,
        "gradient_accumulation_steps": c.accumulation_steps,
    }


def enumerate_candidates(spec: ModelSpec, cluster: Cluster, limits: Limits) -> Iterator[Candidate]:
    """Every combination of settings ``limits`` allows (valid or not: ``check`` decides).

    Degrees run over the divisors of the world size (and 0 for ``hybrid_shard_degree``);
    offloading is tried with activation checkpointing (SMP's documented use) at horizons
    1 to ``limits.max_horizon`` (at most ``num_layers - 1``, beyond which horizons are all
    equivalent), or at exactly those an ``activation_loading_horizon`` limit names (above
    ``max_horizon`` too); expert parallelism and MoE settings only for MoE models.
    Combinations that cannot work are left out (Note [What the enumeration leaves out]),
    unless a value a limit names would then appear in no candidate at all.
    """
    # Note [What the enumeration leaves out]
    #     The default ranges combine freely, so most combinations of large degrees exceed the
    #     world, and offloading without checkpointing or EP without an MoEConfig are never
    #     planned: listing each as invalid would bury the table's rules under ones nobody
    #     asked about, so they are skipped. A value the user named in a limit is different:
    #     if every combination with it is skipped, the search would answer "0 valid, none
    #     invalid" with no reason. Those combinations are yielded after all, and ``check``
    #     rejects them with the library's message (tensor_parallel_degree=16 on 8 ranks:
    #     "must divide world_size=8") or the planner's own (``_planner_problem``). Only
    #     those whose every reason to skip involves the named setting: with
    #     tensor_parallel_degree=16 the combinations that also offload without
    #     checkpointing stay out, so the rejections name the value asked about.
    kept: list[Candidate] = []
    skipped: list[tuple[Candidate, tuple[frozenset[str], ...]]] = []
    for candidate, reasons in _combinations(spec, cluster, limits):
        if reasons:
            skipped.append((candidate, reasons))
        else:
            kept.append(candidate)
    yield from kept
    used: dict[str, set[Any]] = {}
    for candidate in kept:
        for name, value in _settings(candidate).items():
            used.setdefault(name, set()).add(value)
    unused = {
        (name, value)
        for name, values in limits.allowed.items()
        for value in values
        if value not in used.get(name, set())
    }
    for candidate, reasons in skipped:
        named = {name for name, value in _settings(candidate).items() if (name, value) in unused}
        if any(all(name in reason for reason in reasons) for name in named):
            yield candidate


def _combinations(
    spec: ModelSpec, cluster: Cluster, limits: Limits
) -> Iterator[tuple[Candidate, tuple[frozenset[str], ...]]]:
    """Every combination of the allowed values, with why the enumeration leaves it out.

    Each reason is the set of settings it involves; a combination without one is tried.
    """
    world = cluster.world_size
    degrees = divisors(world)
    moe_model = spec.num_experts > 0
    # By default TP stays inside a host (SMP recommends 1 to 8, intra-node) and CP within two
    # hosts' ranks; limits widen or narrow either.
    settings: dict[str, list[Any]] = {
        "tensor_parallel_degree": [d for d in degrees if d <= cluster.per_host],
        "context_parallel_degree": [d for d in degrees if d <= 2 * cluster.per_host],
        "expert_parallel_degree": degrees if moe_model else [1],
        "hybrid_shard_degree": [0, *degrees],
        "fsdp": [2, 1],
        "activation_checkpointing": [True, False],
        "moe": [False, True] if moe_model else [False],
    }
    values = {
        k: list(limits.allowed[k]) if k in limits.allowed else vs for k, vs in settings.items()
    }
    # Without a limit every candidate starts at one micro-batch, and the search adds the
    # fewest more that make it fit (search.fewest_steps_that_fit).
    steps_tried = limits.allowed.get("gradient_accumulation_steps", (1,))
    offloads = [(False, 2)]
    if limits.allows("activation_offloading", True):
        # A limit names the horizons to try; max_horizon bounds only the default range, which
        # also stops at num_layers - 1: from there on every layer is back on the device at
        # once, so larger horizons are the same configuration (and would only cost time).
        named = limits.allowed.get("activation_loading_horizon")
        top = min(limits.max_horizon, max(1, spec.num_layers - 1))
        horizons = named if named is not None else range(1, top + 1)
        offloads += [(True, h) for h in horizons]
    if not limits.allows("activation_offloading", False):
        offloads = offloads[1:]
    for tp, cp, ep, hsd, fsdp, ac, moe in itertools.product(
        values["tensor_parallel_degree"],
        values["context_parallel_degree"],
        values["expert_parallel_degree"],
        values["hybrid_shard_degree"],
        values["fsdp"],
        values["activation_checkpointing"],
        values["moe"],
    ):
        if hsd == 0 and ep == 1 and "hybrid_shard_degree" not in limits.allowed:
            # 0 means world // tp here, which the explicit degree also says (and means under
            # FSDP1 whatever sharding_strategy the script asks for): not even a rejection.
            continue
        # The product of the degrees cannot exceed the ranks; EP needs an MoEConfig.
        reasons = []
        if tp * cp > world:
            reasons.append(frozenset({"tensor_parallel_degree", "context_parallel_degree"}))
        if tp * ep > world:
            reasons.append(frozenset({"tensor_parallel_degree", "expert_parallel_degree"}))
        if ep > 1 and not moe:
            reasons.append(frozenset({"expert_parallel_degree", "moe"}))
        for (offload, horizon), steps in itertools.product(offloads, steps_tried):
            candidate = Candidate(hsd, tp, cp, ep, fsdp, ac, offload, horizon, moe, steps)
            if offload and not ac:
                ckpt = frozenset({"activation_offloading", "activation_checkpointing"})
                yield candidate, (*reasons, ckpt)
            else:
                yield candidate, tuple(reasons)


__all__ = ["Candidate", "Checked", "Rejected", "check", "divisors", "enumerate_candidates"]
