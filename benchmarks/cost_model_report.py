"""What ``bench multihost --model`` and ``--fit`` print and draw.

The cost model's fitted costs, its error on every measured point, its predictions and
their plot (Note [Cost model] in torch_sagemaker/planner/cost_model.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics

from benchmarks import cost_model_fit
from tools import netns
from torch_sagemaker.planner import auto_rule as auto_rule_model
from torch_sagemaker.planner import cost_model


def model_report(runs: list[dict], args: argparse.Namespace) -> int:
    """Fits the cost model on ``runs``, prints its costs, errors and predictions.

    Returns:
        0, or 1 where a measured point is off by more than cost_model_fit.error_bound.
    """
    from benchmarks.collectives import parse_size

    pts = cost_model_fit.points(runs)
    costs = cost_model_fit.fit(pts)
    print(f"\nCost model fitted on {len(runs)} run(s) (the fastest run of each point):")
    print(costs_table(costs))
    rows = cost_model_fit.errors(costs, cost_model_fit.fastest(pts))
    print("\nMeasured against the model:")
    print(error_table(rows))
    print("\nBy dtype and layout:")
    print(summary_table(rows))
    pairs = cost_model_fit.half_pairs(pts)
    if pairs:
        print("\nbf16/fp16 against float32 in the same jobs (what the half-precision costs fit):")
        print(pair_table(costs, pairs))
    target = costs
    if args.predict_latency is not None:
        latency = args.predict_latency
        target = dataclasses.replace(target, alpha=latency, step=latency, flow_latency=latency)
    if args.predict_message is not None:
        target = dataclasses.replace(target, message=args.predict_message)
    if args.predict_cpu == "none":
        target = dataclasses.replace(
            target,
            net_cpu=0.0,
            reduce_cpu=0.0,
            shm_reduce_cpu=0.0,
            half_reduce_cpu=0.0,
            half_shm_reduce_cpu=0.0,
            copy_cpu=0.0,
        )
    nic_rate = args.predict_nics * netns.parse_rate(args.predict_rate) / 8
    cores = args.predict_cores or args.predict_ranks
    sizes = [parse_size(s) for s in args.predict_sizes]
    print(
        f"\nPredicted: {args.predict_nics} x {args.predict_rate} per host, "
        f"{args.predict_ranks} ranks and {cores:g} cores per host, CPU costs {args.predict_cpu}"
        + (f", latency {args.predict_latency:g} s" if args.predict_latency is not None else "")
        + (f", message {args.predict_message:g} s" if args.predict_message is not None else "")
    )
    # wake only costs where ranks outnumber cores.
    blind = [
        n for n in cost_model_fit.unresolved(target) if n != "wake" or cores < args.predict_ranks
    ]
    if blind:
        print(
            f"Not resolved by the runs (below 1 us, as good as 0): {', '.join(blind)}; "
            "--predict-latency sets alpha, step and flow latency, --predict-message the message "
            "cost, and "
            "where they decide, so does that assumption"
        )
    print(prediction_table(target, args.predict_ranks, nic_rate, cores, sizes))
    if args.predict_dtypes != ["float32"]:
        for s in sizes:
            print(f"\nS = {_size(s)} in each dtype: algorithm, ms, of NIC, what bounds it")
            print(
                dtype_table(
                    target,
                    args.predict_ranks,
                    nic_rate,
                    cores,
                    s,
                    args.predict_dtypes,
                    [int(h) for h in args.predict_hosts],
                )
            )
    print(
        f"\nUnshaped, {_size(64 << 20)} calls: CPU ms per rank by what it does, and the most of "
        "bare TCP's throughput smddp can reach where the cores bound it (TCP's share):"
    )
    print(cpu_split_table(costs))
    print(
        f"\nauto's choice by size (Note [The auto rule from the model]), on {RULE_CLUSTER}, "
        "at the fitted costs; kAutoRule in csrc/smddp/algorithms/net_algorithm.cpp "
        "(hosts, the group's algorithm, the tree's largest all_reduce, halving-doubling's "
        "largest all_reduce, reduce_scatter, all_gather):"
    )
    print(auto_rule_table(costs))
    if args.plot:
        plot(target, args.predict_ranks, nic_rate, cores, sizes, args.plot)
        print(f"\nwrote {args.plot}")
    within = all(abs(e) <= _bound(p) for p, _, e in rows)
    return 0 if within else 1


def plot(
    costs: cost_model.Costs, ranks: int, nic_rate: float, cores: float, sizes: list[int], path: str
):
    """Each algorithm's fraction of the NIC bound against hosts, one panel per op and size.

    The fraction (the NIC bound k (H-1)/H S at the NIC's rate over the time) compares
    across host counts where busbw does not: nccl-tests' busbw counts the bytes that stay
    inside a host too.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = [2**i for i in range(1, 11)]
    ops = ("all_reduce", "all_gather_into_tensor")
    fig, axes = plt.subplots(
        len(ops), len(sizes), figsize=(4.5 * len(sizes), 3.4 * len(ops)), squeeze=False
    )
    for row, op in zip(axes, ops):
        for ax, s in zip(row, sizes):
            for algorithm in cost_model.algorithms_for(op):
                frac = []
                for h in hosts:
                    t = cost_model.predict(
                        costs, cost_model.Cluster(h, ranks, nic_rate, cores), op, s, algorithm
                    )
                    frac.append(cost_model.nic_bytes("mesh", op, h, ranks, s) / nic_rate / t)
                ax.plot(hosts, frac, marker="o", ms=3, label=algorithm)
            ax.axhline(costs.nic_efficiency, color="gray", ls=":", label="NIC efficiency")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1)
            ax.set_xlabel("hosts")
            ax.set_ylabel("of NIC bound")
            ax.set_title(f"{op.removesuffix('_into_tensor')} {_size(s)}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{ranks} ranks per host, NIC {nic_rate * 8 / 1e9:g} Gbit/s per host")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --- tables --------------------------------------------------------------------------------


def _op(op: str) -> str:
    """nccl-tests' name: all_gather_into_tensor -> all_gather, reduce_scatter_tensor -> ..."""
    return op.removesuffix("_into_tensor").removesuffix("_tensor")


def _size(n: float) -> str:
    from benchmarks.collectives_report import format_size

    return format_size(int(n))


def costs_table(costs: cost_model.Costs) -> str:
    """The costs in readable units, one line each."""
    per_core = "GB/s per core"
    blind = cost_model_fit.unresolved(costs)

    def ms(name: str) -> str:
        value = getattr(costs, name)
        return "not resolved" if name in blind else f"{value * 1e3:.3f} ms"

    lines = [
        "| cost | value |",
        "|---|---|",
        f"| alpha (per call) | {ms('alpha')} |",
        f"| wake (per wait, per rank per core beyond one) | {ms('wake')} |",
        f"| step (ring/tree latency) | {ms('step')} |",
        f"| gloo's flat ring step | {ms('flat_step')} |",
        f"| NIC efficiency | {costs.nic_efficiency:.3f} |",
        f"| TCP bytes sent or received | {1e-9 / costs.net_cpu:.2f} {per_core} |",
        f"| TCP bytes through a shaped simulated cable | "
        f"{1e-9 / (costs.net_cpu + costs.shaper_cpu):.2f} {per_core} "
        f"({1 + costs.shaper_cpu / costs.net_cpu:.2f} x unshaped) |"
        if costs.shaper_cpu > 0
        else "| TCP bytes through a shaped simulated cable | as unshaped |",
        f"| message | {costs.message * 1e6:.0f} us of CPU |"
        if "message" not in blind
        else "| message | not resolved |",
        f"| reduction (fp32 bytes read) | {1e-9 / costs.reduce_cpu:.2f} {per_core} |",
        f"| reduction (bf16/fp16 bytes read) | {1e-9 / costs.half_reduce_cpu:.2f} {per_core} "
        f"({costs.half_reduce_cpu / costs.reduce_cpu:.2f} x fp32's per byte) |",
        f"| shared-memory reduce-scatter (fp32 input) | {1e-9 / costs.shm_reduce_cpu:.2f} "
        f"{per_core} |",
        f"| shared-memory reduce-scatter (bf16/fp16 input) | "
        f"{1e-9 / costs.half_shm_reduce_cpu:.2f} {per_core} "
        f"({costs.half_shm_reduce_cpu / costs.shm_reduce_cpu:.2f} x fp32's per byte) |",
        f"| copies | {1e-9 / costs.copy_cpu:.2f} {per_core} |",
        f"| flow skew (NIC time per flow beyond one) | {costs.flow_skew:.3f} |",
        f"| flow latency (per call, per flow beyond one) | {ms('flow_latency')} |",
        f"| staged rounds: NIC and CPU time not overlapped | {costs.stage_serial:.2f} of the "
        "smaller |",
        f"| staged rounds: wait for a core (per round, per squared rank per core beyond one) | "
        f"{costs.stage_wake * 1e3:.3f} ms |",
    ]
    return "\n".join(lines)


def _bound(p: cost_model_fit.Point) -> float:
    return cost_model_fit.error_bound(p.algorithm, p.size, p.shaped)


def error_table(rows: list[tuple[cost_model_fit.Point, float, float]]) -> str:
    """Measured and predicted times of every modelled point, with their ratio."""
    lines = [
        "| layout | op | size | algorithm | dtype | cables | measured ms | model ms "
        "| model / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p, t, err in rows:
        lines.append(
            f"| {p.hosts}x{p.ranks} | {p.op} | {_size(p.size)} | {p.algorithm} | {p.dtype} | "
            f"{p.cables} | {p.seconds * 1e3:.1f} | {t * 1e3:.1f} | {1 + err:.2f} |"
        )
    lines.append("")
    smddp = [r for r in rows if r[0].algorithm != "flat_ring"]
    for label, group in (
        (
            f"smddp from {_size(cost_model_fit.SMALL)}",
            [r for r in smddp if r[0].size >= cost_model_fit.SMALL],
        ),
        (
            f"smddp below {_size(cost_model_fit.SMALL)}",
            [r for r in smddp if r[0].size < cost_model_fit.SMALL],
        ),
        ("gloo", [r for r in rows if r[0].algorithm == "flat_ring"]),
    ):
        if not group:
            continue
        p, _, err = max(group, key=lambda r: abs(r[2]))
        median = statistics.median(abs(r[2]) for r in group)
        within = sum(abs(r[2]) <= cost_model_fit.TARGET for r in group)
        lines.append(
            f"{label}: {within} of {len(group)} within {cost_model_fit.TARGET:.0%}, "
            f"median {median:.0%}, "
            f"largest {abs(err):.0%} ({p.hosts}x{p.ranks} {p.op} {_size(p.size)} "
            f"{p.algorithm} {p.dtype}, {p.cables}; claimed bound {_bound(p):.0%})"
        )
    return "\n".join(lines)


def summary_table(rows: list[tuple[cost_model_fit.Point, float, float]]) -> str:
    """The error of smddp's points by dtype, layout and cables: count, median, largest."""
    groups: dict[tuple, list[tuple[cost_model_fit.Point, float]]] = {}
    for p, _, err in rows:
        if p.algorithm != "flat_ring":
            groups.setdefault((p.dtype, p.hosts, p.ranks, p.cables), []).append((p, err))
    lines = [
        "| dtype | layout | cables | points | within 15% | median error | largest (op, size, "
        "algorithm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (dtype, hosts, ranks, cables), group in sorted(groups.items()):
        p, err = max(group, key=lambda r: abs(r[1]))
        median = statistics.median(abs(e) for _, e in group)
        within = sum(abs(e) <= cost_model_fit.TARGET for _, e in group)
        lines.append(
            f"| {dtype} | {hosts}x{ranks} | {cables} | {len(group)} | {within} | {median:.0%} | "
            f"{err:+.0%} ({_op(p.op)}, {_size(p.size)}, {p.algorithm}) |"
        )
    return "\n".join(lines)


def pair_table(
    costs: cost_model.Costs, pairs: list[tuple[cost_model_fit.Point, cost_model_fit.Point]]
) -> str:
    """Each half-precision point's time over its float32 twin's, measured and predicted."""
    lines = [
        "| layout | cables | op | size | dtype | measured / float32 | model / float32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for half, full in sorted(
        pairs, key=lambda x: (x[0].cables, x[0].hosts, x[0].ranks, x[0].op, x[0].size)
    ):
        model = cost_model.seconds(costs, half.work()) / cost_model.seconds(costs, full.work())
        lines.append(
            f"| {half.hosts}x{half.ranks} | {half.cables} | {half.op} | {_size(half.size)} | "
            f"{half.dtype} | {half.seconds / full.seconds:.2f} | {model:.2f} |"
        )
    return "\n".join(lines)


HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)


def dtype_table(
    costs: cost_model.Costs,
    ranks: int,
    nic_rate: float,
    cores: float,
    size: int,
    dtypes: list[str],
    hosts: list[int],
) -> str:
    """Per op and host count, each dtype's best algorithm, time, share of the NIC bound.

    The NIC bound is in the dtype's bytes (S is bytes); the last word is what bounds the
    time (cost_model.bound).
    """
    head = ["op", "hosts"] + dtypes
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in cost_model.OPS:
        for h in hosts:
            cluster = cost_model.Cluster(h, ranks, nic_rate, cores)
            cells = [_op(op), str(h)]
            for dtype in dtypes:
                algorithm, t = cost_model.best(costs, cluster, op, size, dtype)
                w = cost_model.work(cluster, op, size, algorithm, dtype)
                frac = cost_model.nic_bytes("mesh", op, h, ranks, size) / nic_rate / t
                cells.append(
                    f"{algorithm} {t * 1e3:.3g} ms {frac:.2f} {cost_model.bound(costs, w)}"
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prediction_table(
    costs: cost_model.Costs, ranks: int, nic_rate: float, cores: float, sizes: list[int]
) -> str:
    """Per op: for each host count and size, the algorithm picked, its time and busbw.

    "of NIC" is the NIC bound k (H-1)/H S at the NIC's rate over the time.
    """
    lines = []
    for op in cost_model.OPS:
        head = ["hosts"] + [_size(s) for s in sizes]
        lines += [
            f"\n{op}: algorithm, ms, busbw GB/s, of NIC",
            "| " + " | ".join(head) + " |",
        ]
        lines.append("|" + "---|" * len(head))
        for h in HOSTS:
            cluster = cost_model.Cluster(h, ranks, nic_rate, cores)
            cells = [str(h)]
            for s in sizes:
                algorithm, t = cost_model.best(costs, cluster, op, s)
                bound = cost_model.nic_bytes("mesh", op, h, ranks, s) / nic_rate
                cells.append(
                    f"{algorithm} {t * 1e3:.3g} {cost_model.busbw(op, h * ranks, s, t) / 1e9:.1f} "
                    f"{bound / t:.2f}"
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_split_table(costs: cost_model.Costs, size: int = 64 << 20) -> str:
    """Each unshaped 2x1 and 2x2 call's CPU by what it does, and bare TCP's ceiling.

    Where the cores bound a call, bare TCP's streams spend only the "TCP bytes" part, so the
    TCP bytes' share of smddp's CPU is the most of bare TCP's throughput smddp can reach
    (docs/log/multi_node.md, "What bounds smddp against bare TCP"). Ms per call per rank, the
    mesh (which 2 hosts take), every rank on this machine's 2 cores.
    """
    lines = [
        "| layout | dtype | op | TCP bytes | reduction | shared-memory reduce-scatter | "
        "copies | TCP's share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for hosts, ranks in ((2, 1), (2, 2)):
        cluster = cost_model.Cluster(hosts, ranks, math.inf, cores=2, machine_ranks=hosts * ranks)
        for dtype in ("float32", "bfloat16"):
            for op in cost_model.OPS:
                p = cost_model.parts(costs, cost_model.work(cluster, op, size, "mesh", dtype))
                copies = p.cpu["copies"] + p.serial
                total = sum(p.cpu.values()) + p.serial
                cells = [
                    p.cpu["TCP bytes"],
                    p.cpu["reduction"],
                    p.cpu["shared-memory reduce-scatter"],
                    copies,
                ]
                ms = " | ".join(f"{c * 1e3:.1f}" if c else "-" for c in cells)
                lines.append(
                    f"| {hosts}x{ranks} | {dtype} | {_op(op)} | {ms} | "
                    f"{p.cpu['TCP bytes'] / total:.2f} |"
                )
    return "\n".join(lines)


# --- auto's choice by size ------------------------------------------------------------------

RULE_RATE = 1e9 / 8  # bytes/s: 1 Gbit/s, the rate of the 16 and 32 host runs
# The most simulated hosts measured: beyond them the rule keeps their crowding of the cores.
RULE_MOST_RANKS = 32
RULE_CLUSTER = (
    "simulated hosts of one rank at 1 Gbit/s, every rank on the machine's 2 cores (beyond 32 "
    "hosts, as crowded as 32 were), the cables' burst"
)


def rule_cluster(hosts: int) -> cost_model.Cluster:
    """The hosts auto's choice by size is derived on.

    ``bench multihost``'s simulated hosts, where the model was fitted and where the tree and
    halving-doubling are measured (Note [Auto by size and host count] in
    csrc/smddp/algorithms/net_algorithm.cpp). Beyond the 32 hosts measured, the ranks'
    crowding of the 2 cores stays at 32's: the rule extrapolates what grows with the hosts
    (steps, bytes, flows), not a simulator of 1024 ranks on 2 cores. Their shapers' CPU
    (Note [Shaped cables cost CPU]) is left out, as a real NIC does not ask it: with it the
    CPU bounds every large call on 23 to 148 hosts, and there the model prefers the mesh (no
    steps to wait for a core), where on 32 and 48 such hosts the ring took 0.64-0.92 of the
    mesh's time from 4 MiB; the mesh's incast, which costs it that, is not in the model.
    """
    machine = min(hosts, RULE_MOST_RANKS)
    return cost_model.Cluster(
        hosts, 1, RULE_RATE, cores=2, machine_ranks=machine, burst=netns.BURST_BYTES
    )


def auto_rule(costs: cost_model.Costs) -> list[tuple[int, auto_rule_model.AutoBySize]]:
    """The auto rule (planner.auto_rule) on rule_cluster, 2-1024 hosts."""
    return auto_rule_model.auto_rule(costs, rule_cluster)


def auto_rule_table(costs: cost_model.Costs) -> str:
    """The auto rule as the lines of kAutoRule (net_algorithm.cpp)."""
    lines = []
    for hosts, r in auto_rule(costs):
        doubling = ", ".join(str(d) for d in r.doubling_max_bytes)
        group = f"NetAlgo::{r.main.upper()}"
        lines.append(f"    {{{hosts}, {group}, {r.tree_max_bytes}, {{{doubling}}}}},")
    return "\n".join(lines)
