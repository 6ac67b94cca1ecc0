"""The planner's one door to the collective cost model (``cost_model.py``).

The rest of the planner prices collectives through this module only; the library's core
(``tsm.init``, ``tsm.transform``) never imports the planner. Fitting the model's costs on
``bench multihost`` rows is a benchmark's work (``benchmarks/cost_model_fit.py``).

A collective over a group of ranks is priced by ``cost_model.best``: the group's hosts and
its ranks per host become a ``cost_model.Cluster``. Where the group spans hosts, its share
of each host's NICs is its ranks on the host over the host's ranks (the other groups of the
same kind run their collectives at the same time, e.g. one FSDP group per TP rank). Where it
stays inside one host, accelerators talk over their own links (NVLink), modelled as hosts
of one rank each whose NIC is the link; CPU ranks talk through shared memory, the cost
model's one-host case with the fitted CPU costs, unless the fabric carries a measured
alpha-beta line for that collective and group size (``Fabric.one_host``: the time
validation measures one per backend on this machine, benchmarks/planner/calibration.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torch_sagemaker.planner import cost_model

Costs = cost_model.Costs

#: Collectives the planner prices (nccl-tests' names; ``all_to_all`` is priced as an
#: all-gather of the same per-rank bytes: each rank sends (n-1)/n of its data either way).
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
_MODEL_OP = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
    "all_to_all": "all_gather_into_tensor",
}
_MEASURED_OP = {op: ("all_gather" if op == "all_to_all" else op) for op in OPS}


def accelerator_costs() -> Costs:
    """Costs for accelerator clusters: RDMA NICs, collectives run by the accelerators.

    Not fitted: no accelerator cluster was measured here. CPU costs are zero (the bytes move
    by RDMA and reduce on the accelerators), a call costs 20 us and a ring or tree step 10
    us (NCCL's order of magnitude between hosts), the NICs carry 85% of their rate as
    payload, and flows share a NIC evenly (the ring and tree the model picks have one flow
    per NIC). docs/planner.md lists these assumptions.
    """
    return dataclasses.replace(
        Costs(),
        alpha=20e-6,
        wake=0.0,
        step=10e-6,
        flat_step=10e-6,
        nic_efficiency=0.85,
        net_cpu=0.0,
        message=0.0,
        reduce_cpu=0.0,
        shm_reduce_cpu=0.0,
        half_reduce_cpu=0.0,
        half_shm_reduce_cpu=0.0,
        copy_cpu=0.0,
        flow_skew=0.0,
        flow_latency=0.0,
    )


@dataclass(frozen=True)
class Fabric:
    """How a cluster's ranks reach each other.

    Attributes:
        per_host: Ranks per host.
        nic_rate: Bytes/s of each host's NICs together, one direction.
        link_rate: Bytes/s each accelerator sends to its host's others (0: CPU ranks,
            which use shared memory).
        costs: The cost model's costs.
        cores: CPU cores the ranks of one machine share (CPU ranks), else 0.
        machine_ranks: Ranks sharing those cores (simulated hosts on one machine), else 0.
        one_host: Measured collectives inside one host, ``(op, ranks, seconds per call,
            seconds per byte)`` each (``op`` one of ``OPS``, bytes as nccl-tests' S): they
            price a one-host group of exactly ``ranks`` ranks instead of the cost model.
        shaper: Whether software shapers on these cores pace the NICs (simulated hosts
            whose cables run at a rate): groups across hosts then pay their CPU
            (``cost_model.Cluster.shaper``). False for real NICs.
    """

    per_host: int
    nic_rate: float
    link_rate: float
    costs: Costs
    cores: float = 0.0
    machine_ranks: int = 0
    one_host: tuple[tuple[str, int, float, float], ...] = ()
    shaper: bool = False


def span(ranks: Sequence[int], per_host: int) -> tuple[int, int]:
    """(hosts, most ranks on one host) of a group of global ranks."""
    hosts: dict[int, int] = {}
    for r in ranks:
        hosts[r // per_host] = hosts.get(r // per_host, 0) + 1
    return len(hosts), max(hosts.values())


def seconds(fabric: Fabric, op: str, nbytes: float, ranks: Sequence[int]) -> float:
    """Seconds of one ``op`` on ``nbytes`` (nccl-tests' S) over the group ``ranks``."""
    if len(ranks) < 2 or nbytes <= 0:
        return 0.0
    return _seconds(fabric, op, int(nbytes), span(ranks, fabric.per_host))


@functools.lru_cache(maxsize=65536)
def _seconds(fabric: Fabric, op: str, nbytes: int, where: tuple[int, int]) -> float:
    hosts, local = where
    if hosts == 1:
        for measured_op, ranks, alpha, per_byte in fabric.one_host:
            if measured_op == _MEASURED_OP[op] and ranks == local:
                return alpha + per_byte * nbytes
    cores = fabric.cores or float(fabric.per_host)
    if hosts == 1 and fabric.link_rate > 0:
        cluster = cost_model.Cluster(local, 1, fabric.link_rate, cores=float(local))
    elif hosts == 1:
        cluster = cost_model.Cluster(1, local, 1e18, cores, fabric.machine_ranks)
    else:
        share = fabric.nic_rate * local / fabric.per_host
        cluster = cost_model.Cluster(
            hosts, local, share, cores, fabric.machine_ranks, shaper=fabric.shaper
        )
    return cost_model.best(fabric.costs, cluster, _MODEL_OP[op], nbytes)[1]


__all__ = ["OPS", "Costs", "Fabric", "accelerator_costs", "seconds", "span"]
