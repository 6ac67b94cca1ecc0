"""The search: every candidate checked, sized and timed, then ranked.

``plan`` is the planner's Python API (``torch_sagemaker.planner.plan``); the command line
(``python -m torch_sagemaker.planner``) builds the same arguments. Ranking (``rank``):
configurations whose predicted peak fits the usable memory first, by predicted tokens/s
(within 0.1% of the fastest of a group they tie, and the simpler layout goes first; Note
[Ties]); then those that do not fit, by peak.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_sagemaker.planner import comm, memory, timing
from torch_sagemaker.planner.candidates import (
    Candidate,
    Checked,
    Rejected,
    check,
    divisors,
    enumerate_candidates,
)
from torch_sagemaker.planner.inputs import Cluster, Limits, Workload
from torch_sagemaker.planner.model import ModelSpec, load_model
from torch_sagemaker.planner.presets import (
    ACCELERATORS,
    INSTANCES,
    Accelerator,
    accelerator,
    instance,
)
from torch_sagemaker.planner.probe import with_activations

#: Fraction of peak FLOP/s the compute reaches by default on accelerators (docs/planner.md).
DEFAULT_EFFICIENCY = 0.5
#: Bytes AdamW moves per parameter element on accelerators: reads the parameter, gradient
#: and both moments, writes the parameter and moments (7 x 4 bytes), plus PyTorch's
#: multi-tensor implementation's intermediates (counted as 3 more passes).
ADAMW_BYTES = 40


@dataclass(frozen=True)
class Evaluated:
    """A valid configuration with its predictions.

    Attributes:
        checked: The configuration and what ``tsm.init``/``tsm.transform`` resolved.
        memory: Its per-rank memory.
        time: Its step time.
        fits: Whether the peak is within the cluster's memory budget.
    """

    checked: Checked
    memory: memory.MemoryEstimate
    time: timing.TimeEstimate
    fits: bool

    @property
    def candidate(self) -> Candidate:
        """The configuration."""
        return self.checked.candidate


@dataclass(frozen=True)
class Plan:
    """The planner's answer.

    Attributes:
        model: The model planned for.
        cluster: The cluster.
        workload: The workload.
        machine: The compute rates the time model used.
        ranked: Valid configurations, best first (fitting ones first).
        rejected: Invalid configurations, each with the library's reason.
    """

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    machine: timing.Machine
    ranked: list[Evaluated]
    rejected: list[Rejected]

    @property
    def fitting(self) -> list[Evaluated]:
        """Valid configurations whose peak fits, best first."""
        return [e for e in self.ranked if e.fits]

    @property
    def best(self) -> Evaluated | None:
        """The best fitting configuration, or ``None`` when none fits."""
        fitting = self.fitting
        return fitting[0] if fitting else None


def accelerator_machine(acc: Accelerator, dtype: str, efficiency: float) -> timing.Machine:
    """The compute rates of an accelerator preset at ``efficiency`` of its peak."""
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)):
        raise TypeError(
            f"efficiency={efficiency!r}: must be a number, the fraction of peak FLOP/s the "
            "compute reaches (e.g. 0.5)."
        )
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency}: a fraction of peak FLOP/s in (0, 1].")
    return timing.Machine(
        matmul_flops=acc.flops(dtype) * efficiency,
        memory_bandwidth=acc.memory_bandwidth,
        optimizer_seconds=ADAMW_BYTES / acc.memory_bandwidth,
        host_rate=acc.host_rate,
    )


def fabric_of(cluster: Cluster) -> comm.Fabric:
    """The cluster's network as the cost model sees it."""
    costs = cluster.costs if cluster.costs is not None else comm.accelerator_costs()
    assert isinstance(costs, comm.Costs)
    return comm.Fabric(
        per_host=cluster.per_host,
        nic_rate=cluster.nic_rate,
        link_rate=cluster.accelerator.link_rate,
        costs=costs,
        cores=cluster.cores_per_host,
        machine_ranks=0,
    )


def evaluate(
    spec: ModelSpec,
    checked: Checked,
    cluster: Cluster,
    workload: Workload,
    machine: timing.Machine,
    fabric: comm.Fabric | None = None,
    cache: dict | None = None,
) -> Evaluated:
    """Memory and time of one checked configuration (``cache``: shared within a search)."""
    mem = memory.estimate(spec, checked, workload, cache)
    time = timing.estimate(
        spec,
        checked,
        workload,
        machine,
        fabric or fabric_of(cluster),
        overlap=cluster.overlap,
        cache=cache,
    )
    return Evaluated(checked, mem, time, mem.peak <= cluster.memory_budget)


def search(
    spec: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    machine: timing.Machine,
    limits: Limits | None = None,
) -> Plan:
    """Checks, sizes, times and ranks every candidate ``limits`` allows."""
    limits = limits or Limits()
    fabric = fabric_of(cluster)
    evaluated, rejected = [], []
    cache: dict = {}
    # A limit names the micro-batch counts to try; without one each configuration gets the
    # fewest that fit.
    accumulate = "gradient_accumulation_steps" not in limits.allowed
    for candidate in enumerate_candidates(spec, cluster, limits):
        result = check(candidate, spec, cluster, workload)
        if isinstance(result, Rejected):
            rejected.append(result)
            continue
        e = evaluate(spec, result, cluster, workload, machine, fabric, cache)
        if accumulate and not e.fits:
            e = fewest_steps_that_fit(e, spec, cluster, workload, machine, fabric, cache)
        evaluated.append(e)
    return Plan(spec, cluster, workload, machine, rank(evaluated), rejected)


def fewest_steps_that_fit(
    e: Evaluated,
    spec: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    machine: timing.Machine,
    fabric: comm.Fabric,
    cache: dict | None = None,
) -> Evaluated:
    """``e``'s configuration with the fewest micro-batches a step that fit.

    ``e`` is evaluated with all of a rank's sequences in one micro-batch; the counts tried are
    the divisors of that number. From two micro-batches on, the predicted peak only falls as
    they grow (Note [Accumulation the planner plans]), so the fewest that fit are found by
    bisection. Where none fits, the one of least memory: the most micro-batches, or ``e``
    itself where holding the gradients through later micro-batches costs more than the
    activations they save.
    """
    per_rank = e.checked.micro_batch * e.candidate.accumulation_steps
    counts = [k for k in divisors(per_rank) if k > 1]

    def at(steps: int) -> Evaluated:
        candidate = dataclasses.replace(e.candidate, accumulation_steps=steps)
        checked = dataclasses.replace(e.checked, candidate=candidate, micro_batch=per_rank // steps)
        return evaluate(spec, checked, cluster, workload, machine, fabric, cache)

    if not counts:
        return e
    low, high = 0, len(counts) - 1
    best = at(counts[high])
    if not best.fits:
        return min((e, best), key=lambda x: x.memory.peak)
    while low < high:  # counts[high] fits; find the first that does
        middle = (low + high) // 2
        tried = at(counts[middle])
        if tried.fits:
            high, best = middle, tried
        else:
            low = middle + 1
    return best


#: Configurations within this fraction of a faster one's tokens/s tie with it (Note [Ties]).
TIE_TOLERANCE = 1e-3


def _tie_break(e: Evaluated) -> tuple:
    """Order among ties: the simpler layout first, then more memory to spare, then FSDP2.

    Simpler: no offloading, no checkpointing, fewer model-parallel ranks, fewer micro-batches.
    """
    c = e.candidate
    return (
        c.offload,
        c.checkpointing,
        c.tensor_parallel_degree * c.context_parallel_degree * c.expert_parallel_degree,
        c.accumulation_steps,
        e.memory.peak,
        -c.fsdp,
    )


def rank(evaluated: list[Evaluated]) -> list[Evaluated]:
    """Fitting configurations first, fastest first with ties broken; then the rest by peak.

    Note [Ties]
        Predicted step times that differ by less than the model's own precision should not
        decide between a simple and a complicated layout, so configurations tie when they
        are within ``TIE_TOLERANCE`` (0.1%) of the fastest of their group: fitting ones are
        sorted by tokens/s, a group starts at the fastest one not yet placed and takes every
        one within 0.1% of it, and a group is ordered by ``_tie_break``. The first
        configuration is therefore never more than 0.1% slower than the fastest that fits.
        (A key that rounds tokens/s to significant digits would tie 100,499 with 100,000 but
        not 100,500 with 100,499: bands of up to 1%, cut at arbitrary places.)
    """
    fitting = sorted((e for e in evaluated if e.fits), key=lambda e: -e.time.tokens_per_second)
    ranked: list[Evaluated] = []
    start = 0
    while start < len(fitting):
        floor = fitting[start].time.tokens_per_second * (1 - TIE_TOLERANCE)
        end = start + 1
        while end < len(fitting) and fitting[end].time.tokens_per_second >= floor:
            end += 1
        ranked += sorted(fitting[start:end], key=_tie_break)
        start = end
    rest = sorted(
        (e for e in evaluated if not e.fits), key=lambda e: (e.memory.peak, _tie_break(e))
    )
    return ranked + rest


def _check_types(config: Any, accelerator_name: Any, instance_type: Any, limits: Any) -> None:
    """Refuses arguments of ``plan`` of the wrong type, naming them.

    The numbers are checked by ``Cluster``, ``Workload`` and ``accelerator_machine``.

    Raises:
        TypeError: Naming the argument, its value and what to give.
    """
    if not isinstance(config, (str, os.PathLike, ModelSpec)):
        raise TypeError(
            f"config={config!r}: give the path of a Hugging Face config.json (or its "
            "directory), or a ModelSpec."
        )
    if accelerator_name is not None and not isinstance(accelerator_name, (str, Accelerator)):
        raise TypeError(
            f"accelerator_name={accelerator_name!r}: give a preset name "
            f"({', '.join(ACCELERATORS)}) or an Accelerator with your own numbers."
        )
    if instance_type is not None and not isinstance(instance_type, str):
        raise TypeError(
            f"instance_type={instance_type!r}: give an instance preset name "
            f"({', '.join(INSTANCES)})."
        )
    if limits is not None and not isinstance(limits, (Mapping, Limits)):
        raise TypeError(
            f"limits={limits!r}: give a dict of setting -> allowed values, e.g. "
            '{"tensor_parallel_degree": (1, 2)}, or a Limits.'
        )


def plan(
    config: str | os.PathLike[str] | ModelSpec,
    *,
    seq_len: int,
    global_batch_tokens: int,
    hosts: int,
    accelerator_name: str | Accelerator | None = None,
    per_host: int | None = None,
    instance_type: str | None = None,
    nics: int | None = None,
    nic_bits: float | None = None,
    dtype: str = "bfloat16",
    limits: Mapping[str, Any] | Limits | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    usable_memory: float = 0.9,
) -> Plan:
    """Plans SMP configurations for a model on a cluster.

    Args:
        config: A Hugging Face ``config.json`` (or its directory), read locally, or a
            ``ModelSpec`` already loaded.
        seq_len: Tokens per sequence.
        global_batch_tokens: Tokens per optimizer step over the whole job.
        hosts: Hosts of the job.
        accelerator_name: A preset name (``H100``, ``H200``, ``A100-40GB``, ``A100-80GB``) or
            an ``Accelerator`` with your own numbers; default the instance's, else H100.
        per_host: Accelerators per host (default the instance's, else 8).
        instance_type: An instance preset (``p5.48xlarge``, ...) giving the accelerator, the
            count per host and the NICs.
        nics: NICs per host (default the instance's, else 1).
        nic_bits: Each NIC's rate in bits/s (default the instance's, else 100 Gbit/s).
        dtype: ``"bfloat16"`` (mixed precision) or ``"float32"``.
        limits: Allowed values per setting (``inputs.SETTINGS``), e.g.
            ``{"tensor_parallel_degree": (1, 2, 4, 8)}``, or a ``Limits``.
        efficiency: Fraction of the accelerator's peak FLOP/s the compute reaches.
        usable_memory: Fraction of device memory a configuration may plan to use.

    Returns:
        The ``Plan``: valid configurations ranked, invalid ones with their reasons.

    Raises:
        ValueError: For an unreadable config, an unknown preset, or an input out of range.
        TypeError: For an argument of the wrong type, naming it.
    """
    _check_types(config, accelerator_name, instance_type, limits)
    host = instance(instance_type) if instance_type else None
    acc = accelerator_name or (host.accelerator if host else "H100")
    acc = accelerator(acc) if isinstance(acc, str) else acc
    # None means the default; any value given (0 included) is the user's, checked by Cluster.
    cluster = Cluster(
        hosts=hosts,
        per_host=per_host if per_host is not None else (host.per_host if host else 8),
        accelerator=acc,
        nics=nics if nics is not None else (host.nics if host else 1),
        nic_bits=nic_bits if nic_bits is not None else (host.nic_bits if host else 100e9),
        usable_memory=usable_memory,
    )
    workload = Workload(seq_len, global_batch_tokens, dtype)
    spec = config if isinstance(config, ModelSpec) else load_model(config)
    spec = with_activations(spec)  # measured on reduced copies where the policy is silent
    if limits is not None and not isinstance(limits, Limits):
        limits = Limits(allowed=dict(limits))  # Limits checks and normalizes the values
    machine = accelerator_machine(acc, dtype, efficiency)
    return search(spec, cluster, workload, machine, limits)


__all__ = [
    "ADAMW_BYTES",
    "DEFAULT_EFFICIENCY",
    "Evaluated",
    "Plan",
    "accelerator_machine",
    "evaluate",
    "fabric_of",
    "fewest_steps_that_fit",
    "plan",
    "rank",
    "search",
]
