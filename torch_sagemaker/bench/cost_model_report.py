"""What ``bench multihost --model`` and ``--fit`` print and draw.

The cost model's fitted costs, its error on every measured point, its predictions and
their plot (Note [Cost model] in cost_model.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from torch_sagemaker.bench import cost_model, netns


def model_report(runs: list[dict], args: argparse.Namespace) -> int:
    """Fits the cost model on ``runs``, prints its costs, errors and predictions.

    Returns:
        0, or 1 where a measured point is off by more than cost_model.error_bound.
    """
    from torch_sagemaker.bench.collectives import parse_size

    pts = cost_model.points(runs)
    costs = cost_model.fit(pts)
    print(f"\nCost model fitted on {len(runs)} run(s) (the fastest run of each point):")
    print(cost_model.costs_table(costs))
    rows = cost_model.errors(costs, cost_model.fastest(pts))
    print("\nMeasured against the model:")
    print(cost_model.error_table(rows))
    target = costs
    if args.predict_latency is not None:
        target = dataclasses.replace(target, alpha=args.predict_latency, step=args.predict_latency)
    if args.predict_message is not None:
        target = dataclasses.replace(target, message=args.predict_message)
    if args.predict_cpu == "none":
        target = dataclasses.replace(
            target, net_cpu=0.0, reduce_cpu=0.0, shm_reduce_cpu=0.0, copy_cpu=0.0
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
    blind = [n for n in cost_model.unresolved(target) if n != "wake" or cores < args.predict_ranks]
    if blind:
        print(
            f"Not resolved by the runs (below 1 us, as good as 0): {', '.join(blind)}; "
            "--predict-latency sets alpha and step, --predict-message the message cost, and "
            "where they decide, so does that assumption"
        )
    print(cost_model.prediction_table(target, args.predict_ranks, nic_rate, cores, sizes))
    if args.plot:
        plot(target, args.predict_ranks, nic_rate, cores, sizes, args.plot)
        print(f"\nwrote {args.plot}")
    within = all(abs(e) <= cost_model.error_bound(p.algorithm, p.size) for p, _, e in rows)
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
            ax.set_title(f"{op.removesuffix('_into_tensor')} {cost_model._size(s)}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{ranks} ranks per host, NIC {nic_rate * 8 / 1e9:g} Gbit/s per host")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
