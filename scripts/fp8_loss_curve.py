"""FP8 against bf16 training of the example model: the loss curves of two runs, and a plot.

    python scripts/fp8_loss_curve.py [--steps 200] [--nproc 2] [--out outputs/fp8-curve]
        [--plot docs/fp8_loss_200steps.png] [-- extra examples/train.py flags]

Runs ``examples/train.py`` under torchrun with the same seed, data and flags: with bf16
compute (FSDP2 mixed precision, fp32 master weights) as is, the same with ``--fp8 1`` (SMP's
recipe: ``DelayedScaling(fp8_format=HYBRID, amax_history_len=1024, amax_compute_algo=
"max")``, ``fp8_group`` = every rank) and, as the same-run yardstick of how far another
precision alone moves this training (``--control fp32``, the default), in fp32. Then it
compares each run's per-step losses with the bf16 run's: the relative difference of their
10-step moving averages at every step, and of the means over the last 20 steps; the FP8 run
passes when both stay within ``--tolerance`` (default 2%; exit status 1 beyond it). It
prints a markdown summary and writes the plot. Each run is started with ``nice -n 10`` (the
machines are shared). ``make fp8-curve`` runs it with the defaults of docs/fp8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINDOW, TAIL = 10, 20


def train_command(
    nproc: int, steps: int, out: Path, fp8: bool, extra: list[str], bf16: bool = True
) -> list[str]:
    """The torchrun command line of one run."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        "nice",
        "-n",
        "10",
        torchrun,
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(ROOT / "examples" / "train.py"),
        "--bf16",
        "1" if bf16 else "0",
        "--fp8",
        "1" if fp8 else "0",
        "--max-steps",
        str(steps),
        "--validation-freq",
        "0",
        "--progress",
        "0",
        "--logging-freq",
        "20",
        "--output-dir",
        str(out),
        *extra,
    ]


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare(bf16: list[float], fp8: list[float]) -> dict:
    """Relative differences of the FP8 run's losses from the bf16 run's.

    Returns:
        ``max_smoothed``: largest |fp8 - bf16| / bf16 of the 10-step moving averages, and the
        step where it is; ``tail``: the same for the means of the last 20 steps; the two tail
        means; ``smoothed``: the per-step relative differences.
    """
    if len(bf16) != len(fp8) or not bf16:
        raise ValueError(f"runs of different lengths: bf16 {len(bf16)}, fp8 {len(fp8)} steps")
    a, b = moving_average(bf16), moving_average(fp8)
    rel = [abs(y - x) / x for x, y in zip(a, b)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    tail_bf16 = sum(bf16[-TAIL:]) / len(bf16[-TAIL:])
    tail_fp8 = sum(fp8[-TAIL:]) / len(fp8[-TAIL:])
    return dict(
        max_smoothed=rel[worst],
        max_smoothed_step=worst + 1,
        tail=abs(tail_fp8 - tail_bf16) / tail_bf16,
        tail_bf16=tail_bf16,
        tail_fp8=tail_fp8,
        smoothed=rel,
    )


COLORS = {"bf16": "tab:blue", "bf16 + FP8": "tab:red", "fp32": "tab:gray"}


def plot(runs: dict[str, list[float]], results: dict[str, dict], path: Path, title: str) -> None:
    """Loss curves (raw and smoothed) and each run's relative difference from bf16, in one PNG.

    Args:
        runs: Per-step losses by run name (``"bf16"`` first).
        results: ``compare`` of each other run against bf16, by run name.
        path: Where the PNG goes.
        title: Its title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(runs["bf16"]) + 1))
    many = len(runs) > 3  # more runs (scripts/fp8_diagnostics.py): one legend under the plots
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 5.5 if many else 4))
    spare = iter(f"C{i}" for i in (2, 4, 1, 5, 6, 8, 9) * 3)  # not the named runs' colours
    colors = {name: COLORS.get(name) or next(spare) for name in runs}
    for name, losses in runs.items():
        color = colors[name]
        ax1.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
        ax1.plot(steps, moving_average(losses), color=color, label=f"{name} (10-step mean)")
    ax1.set(xlabel="step", ylabel="training loss (nats/byte)", title="Loss")
    for name, result in results.items():
        label = f"{name} vs bf16"
        ax2.plot(steps, [100 * r for r in result["smoothed"]], color=colors[name], label=label)
    ax2.axhline(2.0, color="gray", linestyle="--", linewidth=0.8, label="2%")
    ax2.set(
        xlabel="step", ylabel="|run - bf16| / bf16, %", title="Relative difference (10-step means)"
    )
    if many:
        handles, labels = ax1.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0.17, 1, 1))
    else:
        ax1.legend()
        ax2.legend()
        fig.suptitle(title)
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary(results: dict[str, dict], runs: dict) -> str:
    """Markdown lines for docs/fp8.md."""
    lines = [
        "| run | first loss | last loss | mean of last 20 | median step s |",
        "|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        tail = sum(s["losses"][-TAIL:]) / len(s["losses"][-TAIL:])
        lines.append(
            f"| {name} | {s['first_loss']:.4f} | {s['last_loss']:.4f} | {tail:.4f} | "
            f"{s['median_step_s']:.3f} |"
        )
    lines += [
        "",
        "| against bf16 | largest difference of 10-step means | at step | last 20 steps |",
    ]
    lines.append("|---|---|---|---|")
    for name, r in results.items():
        lines.append(
            f"| {name} | {100 * r['max_smoothed']:.2f}% | {r['max_smoothed_step']} | "
            f"{100 * r['tail']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs both trainings (unless ``--reuse``), compares, plots; 1 if beyond tolerance."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "fp8-curve")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "fp8_loss_200steps.png")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--reuse", action="store_true", help="compare the runs already in --out")
    p.add_argument(
        "--control",
        choices=("fp32", "none"),
        default="fp32",
        help="a third run in fp32: how far another precision alone moves the curve",
    )
    args = p.parse_args(argv)
    plan = [("bf16", "bf16", True, False), ("bf16 + FP8", "fp8", True, True)]
    if args.control == "fp32":
        plan.append(("fp32", "fp32", False, False))
    runs = {}
    for name, folder, bf16, fp8 in plan:
        out = args.out / folder
        if not args.reuse:
            cmd = train_command(args.nproc, args.steps, out, fp8, extra, bf16=bf16)
            print("$", " ".join(cmd), flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        with open(out / "metrics.json") as f:
            runs[name] = json.load(f)["summary"]
    losses = {name: run["losses"] for name, run in runs.items()}
    results = {n: compare(losses["bf16"], v) for n, v in losses.items() if n != "bf16"}
    title = (
        f"examples/train.py, {args.nproc} ranks, {args.steps} steps: bf16 vs bf16 + FP8 "
        "(DelayedScaling HYBRID)"
    )
    plot(losses, results, args.plot, title)
    print(summary(results, runs))
    print(f"plot: {args.plot}")
    result = results["bf16 + FP8"]
    within = result["tail"] <= args.tolerance and result["max_smoothed"] <= args.tolerance
    print(f"within {100 * args.tolerance:.0f}%: {'yes' if within else 'NO'}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
