"""One rank of a ``bench multihost`` job (multihost.py starts it on a simulated host).

It creates the groups the job compares (smddp's default group, smddp groups forced to the
mesh or the ring, gloo), optionally checks bit-identical results and times training
(``multihost_training``), then
runs and times every op and size, reads its host's NIC counters and the CPU its calls took,
and gathers the rows.

Note [CPU per byte]
Where the NIC is fast, the CPU bounds a collective, and the figure that says how well a
backend does is the CPU it spends per byte, next to the bare-TCP streams' (Note [The
bare-TCP ceiling]). Each rank reads getrusage(RUSAGE_SELF) (user and system time of all its
threads, smddp's pool and send lanes included) around the timed calls, and rank 0 reads the
machine's softirq time from /proc/stat: the kernel's receive path, which Linux charges to no
process. /proc/stat is not per namespace, so it is the whole machine's, other work included;
on a quiet machine that is the simulated hosts' network. smddp groups also report their
transport's counts (TransportStats in csrc/smddp/transport/transport.h): messages, send,
recv and poll calls, and bytes read before their receive was posted (copied a second time).
The report divides by the bytes the op must move between hosts at least (min_bytes, all
hosts together), so backends that move the same collective compare on one scale. The timed
loop's barriers (one before each call) are counted with the calls; at the sizes where the
CPU is the limit they are a small part.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NamedTuple

from tools import netns
from tools.bare_tcp import BARE_TCP, BareRing

# smddp groups that force how collectives cross hosts (SMDDPOptions.net_algo), and
# "smddp-auto", auto's choice in a group of its own: the default group ("smddp") also
# carries the benchmark's own messages between cases.
FORCED_NET_ALGO = {
    "smddp-auto": "auto",
    "smddp-mesh": "mesh",
    "smddp-ring": "ring",
    "smddp-hd": "halving_doubling",
    "smddp-tree": "tree",
}
# An auto group whose operands come from its tensor pool, as FSDP2's all-gather and
# reduce-scatter buffers do (the all-gather's input in place in its output): a host's ranks
# then read each other's parts where they lie (Note [Read from the pool] in
# csrc/smddp/algorithms/shm_algos.h).
SMDDP_POOL = "smddp-pool"
# What a job can time: the ops, their element types, and the backends (``rank_main`` makes
# their groups), in the order the tables list them.
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("smddp", *FORCED_NET_ALGO, SMDDP_POOL, "gloo", BARE_TCP)


class Step(NamedTuple):
    """One step of a job's sweep: untimed warm-up calls, or a case that is measured."""

    backend: str
    op: str
    size: int
    warmup_calls: int  # > 0: only that many untimed calls; 0: a measured case
    dtype: str = "float32"  # the operands' element type (torch's name, without "torch.")


def schedule(spec: dict[str, Any]) -> Iterator[Step]:
    """The steps a job runs, in order (Note [Each backend's sweep back to back] in multihost.py).

    Every rank runs the same steps in the same order: each is collective.

    Args:
        spec: The job's spec: ``backends``, ``ops``, ``sizes``, ``warmup_largest`` and
            ``dtypes`` (default float32).

    Yields:
        For each backend, for each dtype, for each op: the warm-up at the largest size (where
        ``warmup_largest`` is above 0), then a measured case per size, in the order given.
    """
    for backend in spec["backends"]:
        for dtype in spec.get("dtypes", ["float32"]):
            for op in spec["ops"]:
                if spec["sizes"] and spec.get("warmup_largest", 0) > 0:
                    yield Step(backend, op, max(spec["sizes"]), spec["warmup_largest"], dtype)
                for size in spec["sizes"]:
                    yield Step(backend, op, size, 0, dtype)


def _identical_results(group) -> dict[str, Any]:
    """Reduces and gathers random data in float32 and bfloat16 on ``group``.

    Returns what every rank must agree on bit for bit (the all_reduce and all_gather
    results' digests), and how far this rank's all_reduce result and reduce_scatter part
    are from a float64 reference.
    """
    import hashlib

    import torch
    import torch.distributed as dist

    from torch_sagemaker._torch_compat import c10d as c10d_compat

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = 3 * world * 4099  # not a multiple of any chunk size
        inputs = [
            torch.randn(n, generator=torch.Generator().manual_seed(1000 + r)).to(dtype)
            for r in range(world)
        ]
        reference = torch.stack([x.double() for x in inputs]).sum(0)
        t = inputs[rank].clone()
        dist.all_reduce(t, group=group)
        gathered = torch.empty(n * world, dtype=dtype)
        c10d_compat.all_gather_single(gathered, inputs[rank], group=group)
        part = torch.empty(n // world, dtype=dtype)
        c10d_compat.reduce_scatter_single(part, inputs[rank].clone(), group=group)
        mine = reference[rank * (n // world) : (rank + 1) * (n // world)]
        name = str(dtype).removeprefix("torch.")
        out[name] = {
            "all_reduce": hashlib.sha256(
                t.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy().tobytes()
            ).hexdigest(),
            "all_reduce_error": float((t.double() - reference).abs().max()),
            "all_gather": hashlib.sha256(gathered.float().numpy().tobytes()).hexdigest(),
            "all_gather_exact": bool(torch.equal(gathered, torch.cat(inputs))),
            "reduce_scatter_error": float((part.double() - mine).abs().max()),
        }
    return out


def rank_main(spec: dict[str, Any]) -> None:
    """One rank of a layout's job: runs every case of ``spec`` and, on rank 0, writes the rows."""
    import torch
    import torch.distributed as dist

    import torch_sagemaker  # noqa: F401  (registers smddp)
    from benchmarks import end_rank
    from benchmarks.multihost_training import train_all
    from torch_sagemaker.smddp.backend import group_layout
    from torch_sagemaker.smddp.options import SMDDPOptions

    torch.set_num_threads(1)
    dist.init_process_group("smddp", timeout=timedelta(seconds=spec["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"smddp": dist.group.WORLD}
    # How to make more groups of each backend (the training meshes' groups).
    group_kwargs: dict[str, dict[str, Any]] = {"smddp": {"backend": "smddp"}}
    bare = None
    for name in spec["backends"]:  # in the same order on every rank: new_group is collective
        if name == BARE_TCP:
            bare = BareRing(rank, spec["hosts"], spec["local"], _gather_objects)
        elif name == "gloo":
            group_kwargs[name] = {"backend": "gloo"}
            groups[name] = dist.new_group(**group_kwargs[name])
        elif name in FORCED_NET_ALGO or name == SMDDP_POOL:
            options = SMDDPOptions(net_algo=FORCED_NET_ALGO.get(name, "auto"))
            group_kwargs[name] = {"backend": "smddp", "pg_options": options}
            groups[name] = dist.new_group(**group_kwargs[name])
    # What each backend's collectives do between hosts (the cost model's `algorithm`).
    algorithms = {
        name: "flat_ring" if name == "gloo" else group_layout(group)["net_algorithm"]
        for name, group in groups.items()
    }
    algorithms[BARE_TCP] = "bare_ring"
    identical: list[Any] = [None] * world
    if spec.get("identical"):
        dist.all_gather_object(identical, _identical_results(dist.group.WORLD))
    training = train_all(spec, groups, group_kwargs)
    rows = []
    for step in schedule(spec):
        if step.warmup_calls:
            run = _case(step, rank, world, groups, bare)[0]
            for _ in range(step.warmup_calls):
                run()
            del run  # its operands, before the cases allocate theirs
            continue
        before = _net_ops(groups.get(step.backend))
        mine, actual = _measure(step, rank, world, groups, bare, spec)
        ran = _ran(before, _net_ops(groups.get(step.backend))) or algorithms[step.backend]
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            row = _row(spec, step.op, actual, step.backend, ran, every)
            rows.append(dict(row, dtype=step.dtype, warmup=spec.get("warmup_largest", 0)))
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "identical": identical if spec.get("identical") else None,
                    "training": training,
                },
                f,
            )
    if bare is not None:
        bare.close()
    dist.barrier()
    end_rank()


def _net_ops(group) -> dict[str, int]:
    """An smddp group's collectives across hosts so far, per algorithm (empty for others)."""
    from torch_sagemaker.smddp.backend import group_layout

    try:
        return group_layout(group)["net_ops"] if group is not None else {}
    except ValueError:  # not smddp (gloo)
        return {}


def _ran(before: dict[str, int], after: dict[str, int]) -> str:
    """The algorithm a case's calls crossed hosts by; "" when none did (one host, not smddp).

    A small collective may take the tree or halving-doubling where the group's algorithm
    takes the rest (Note [Auto by size and host count] in
    csrc/smddp/algorithms/net_algorithm.cpp).
    """
    grown = {a: after[a] - before.get(a, 0) for a in after if after[a] > before.get(a, 0)}
    return max(grown, key=lambda a: grown[a]) if grown else ""


def _case(
    step: Step, rank: int, world: int, groups: dict, bare: BareRing | None
) -> tuple[Any, Any, int]:
    """One case's calls on this rank.

    Args:
        step: The backend (a key of ``groups``, or the bare-TCP ceiling), the op, and about
            how many bytes (nccl-tests' S; the case rounds it to the ranks).
        rank: This rank.
        world: The job's ranks.
        groups: The process groups by backend.
        bare: The bare streams, where the job runs the ceiling.

    Returns:
        ``(run, check, actual bytes)``: ``run()`` makes one call, ``check()`` one call whose
        result it checks (True where right).
    """
    import torch
    import torch.distributed as dist

    from benchmarks.collectives import make_case, pool_empty

    dtype = getattr(torch, step.dtype)
    if step.backend == BARE_TCP:
        assert bare is not None
        # make_case only for the size it rounds to: the bare streams move bytes.
        _, _, actual = make_case(step.op, step.size, world, rank, dist.group.WORLD, dtype=dtype)
        run, check = bare.case(step.op, actual)
        return run, check, actual
    if step.backend == SMDDP_POOL:
        group = groups[step.backend]
        empty = pool_empty(group, dtype)
        return make_case(
            step.op, step.size, world, rank, group, empty=empty, dtype=dtype, gather_in_place=True
        )
    return make_case(step.op, step.size, world, rank, groups[step.backend], dtype=dtype)


def _measure(
    step: Step, rank: int, world: int, groups: dict, bare: BareRing | None, spec: dict
) -> tuple[dict[str, Any], int]:
    """One case on this rank: a checked call, a warm-up call, then ``iters`` timed calls.

    Args:
        step: The backend, the op and about how many bytes.
        rank: This rank.
        world: The job's ranks.
        groups: The process groups by backend.
        bare: The bare streams, where the job runs the ceiling.
        spec: The job's spec (``iters``, ``local``, ``timeline``).

    Returns:
        This rank's part of the row (the result check, the call times, and on one rank per
        host its NIC's counters; with ``timeline``, the middle call's phases) and the size the
        case ran.
    """
    import torch.distributed as dist

    run, check, actual = _case(step, rank, world, groups, bare)
    counts_nic = rank % spec["local"] == 0  # one rank per host reads its NIC
    group = groups.get(step.backend)
    timeline = spec.get("timeline") and group is not None and step.backend != "gloo"
    ok = check()
    run()  # warm-up
    dist.barrier()
    before = netns.own_counters() if counts_nic else None
    ports = netns.port_counters() if rank == 0 else None
    if timeline:  # drop what the checked and warm-up calls left
        _middle_call(group, step.op, 0)
    counted = group is not None and step.backend != "gloo"  # smddp: its transport's counts
    stats = _transport_stats(group) if counted else None
    pooled = _pool_reads(group) if step.backend == SMDDP_POOL else None
    softirq = machine_softirq_seconds() if rank == 0 else 0.0
    cpu = _cpu_seconds()
    times = []
    for _ in range(spec["iters"]):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    cpu = _cpu_seconds() - cpu  # before the barrier: its wait is not the calls' work
    dist.barrier()
    softirq = machine_softirq_seconds() - softirq if rank == 0 else 0.0
    after = netns.own_counters() if counts_nic else None
    ports_after = netns.port_counters() if rank == 0 else None
    mine: dict[str, Any] = {"ok": ok, "times": times, "cpu": cpu, "softirq": softirq}
    if stats is not None:
        now = _transport_stats(group)
        mine["transport"] = {k: now[k] - stats[k] for k in now}
    if pooled is not None:  # that the operands really were read in the pools
        mine["pool_reads"] = _pool_reads(group) - pooled
    if before is not None and after is not None:
        mine["tx"] = after["tx_bytes"] - before["tx_bytes"]
        mine["drops"] = after["drops"] - before["drops"]
    if ports is not None and ports_after is not None:
        mine["port_drops"] = sum(ports_after[p]["drops"] - ports[p]["drops"] for p in ports_after)
    if timeline:
        mine["timeline"] = _middle_call(group, step.op, spec["iters"])
    return mine, actual


def _pool_reads(group) -> int:
    """Reads of local peers' pooled operands so far (Note [Read from the pool])."""
    from torch_sagemaker.smddp.backend import pool_stats

    stats = pool_stats(group)
    return stats["pool_reduce_reads"] + stats["pool_gather_reads"]


def _cpu_seconds() -> float:
    """User and system CPU time of this process, all its threads (Note [CPU per byte])."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_softirq_seconds() -> float:
    """The machine's softirq time so far, all cores: /proc/stat's ``cpu`` line (field 7)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[7]) / os.sysconf("SC_CLK_TCK")


def _transport_stats(group) -> dict[str, int]:
    """The transport counts of smddp group ``group`` (Note [CPU per byte])."""
    import torch

    from torch_sagemaker._torch_compat import c10d as c10d_compat

    return dict(c10d_compat.backend_of(group, torch.device("cpu"))._transport_stats())


def _gather_objects(obj: object) -> list:
    import torch.distributed as dist

    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def _middle_call(group, op: str, calls: int) -> list[list]:
    """The phases of the middle one of the last ``calls`` calls of ``op`` on this rank.

    Rows ``[phase, begin_ns, end_ns, bytes]`` from smddp's timeline (Note [Timeline] in
    csrc/smddp/common/timeline.h), which this call empties.
    """
    import torch

    from torch_sagemaker._torch_compat import c10d as c10d_compat

    spans = c10d_compat.backend_of(group, torch.device("cpu"))._timeline()
    seqs = [seq for seq, phase, *_ in spans if phase == op]
    if not calls or not seqs:
        return []
    middle = seqs[-calls:][calls // 2]
    return [[phase, begin, end, n] for seq, phase, begin, end, n in spans if seq == middle]


def _row(
    spec: dict[str, Any], op: str, size: int, backend: str, algorithm: str, every: list[dict]
) -> dict:
    calls = len(every[0]["times"])
    slowest = [max(r["times"][i] for r in every) for i in range(calls)]
    nics = [r for r in every if "tx" in r]
    return {
        "layout": f"{spec['hosts']}x{spec['local']}",
        "op": op,
        "bytes": size,
        "backend": backend,
        "algorithm": algorithm,
        "ok": all(r["ok"] for r in every),
        "seconds": statistics.median(slowest),
        "calls": slowest,  # each timed call's slowest rank, in order (to see a trend)
        "tx_per_call": max(r["tx"] for r in nics) / calls,
        "drops": sum(r["drops"] for r in nics) + every[0]["port_drops"],
        "timeline": [r["timeline"] for r in every] if "timeline" in every[0] else None,
        # Note [CPU per byte]: per timed call; each rank's CPU, the machine's softirq, and
        # for smddp its transport's counts summed over the ranks.
        "cpu_per_call": [r["cpu"] / calls for r in every],
        "softirq_per_call": every[0]["softirq"] / calls,
        "transport_per_call": (
            {k: sum(r["transport"][k] for r in every) / calls for k in every[0]["transport"]}
            if "transport" in every[0]
            else None
        ),
        # smddp-pool: reads of local peers' pooled operands in the timed calls, all ranks
        # (0 where no host has two ranks, or the pool could not hold the operands).
        "pool_reads": sum(r["pool_reads"] for r in every) if "pool_reads" in every[0] else None,
    }
