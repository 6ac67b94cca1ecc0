"""What the planner prints and writes: the ranked table, JSON, the SMP config, a plot."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

from torch_sagemaker.planner.search import Evaluated, Plan

GIB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def describe_inputs(plan: Plan) -> str:
    """One paragraph: the model, cluster, workload and compute rates the plan assumed."""
    c, w, m = plan.cluster, plan.workload, plan.model
    acc = c.accelerator
    return (
        f"{m.name} ({m.num_params / 1e9:.2f}B parameters, {m.num_layers} layers) from "
        f"{m.source}; {c.hosts} hosts x {c.per_host} {acc.name} ({_gib(acc.memory_bytes)} GiB, "
        f"{c.usable_memory:.0%} usable), {c.nics} x {c.nic_bits / 1e9:g} Gbit/s NICs per host; "
        f"sequence {w.seq_len}, global batch {w.global_batch_tokens} tokens "
        f"({w.sequences} sequences), {w.dtype}; matmuls at "
        f"{plan.machine.matmul_flops / 1e12:.1f} TFLOP/s per rank."
    )


def table(plan: Plan, top: int = 10) -> str:
    """The ``top`` ranked configurations as a Markdown table (memory in GiB per rank)."""
    lines = [
        "| # | configuration | micro-batch | params | grads | optim | activations | buffers | "
        "peak | fits | step s | tokens/s | exposed comm s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(plan.ranked[:top], 1):
        m, t = e.memory, e.time
        lines.append(
            f"| {i} | {e.candidate.label()} | {e.checked.micro_batch} | {_gib(m.parameters)} | "
            f"{_gib(m.gradients)} | {_gib(m.optimizer)} | {_gib(m.activations)} | "
            f"{_gib(m.buffers)} | {_gib(m.peak)} | {'yes' if e.fits else 'no'} | "
            f"{t.step:.2f} | {t.tokens_per_second:,.0f} | {t.exposed:.2f} |"
        )
    return "\n".join(lines)


def rejected_summary(plan: Plan) -> str:
    """How many configurations were invalid, by stage, and one example of every rule verbatim.

    A rule is a reason with its numbers blanked out; the rules are listed most frequent first,
    every one of them (``to_json`` lists every invalid configuration).
    """
    if not plan.rejected:
        return "No configuration was invalid."
    counts = Counter(r.stage for r in plan.rejected)
    head = ", ".join(f"{n} at {stage}" for stage, n in counts.most_common())
    # One line per rule: the reasons with their numbers blanked out are the rule.
    rules: dict[str, list] = {}
    for r in plan.rejected:
        rules.setdefault(re.sub(r"\d+", "#", r.reason), []).append(r)
    lines = [f"{len(plan.rejected)} invalid ({head}); one example of each rule:"]
    for same in sorted(rules.values(), key=len, reverse=True):
        r = same[0]
        lines.append(f"- {len(same)} like {r.candidate.label()} ({r.stage}): {r.reason}")
    return "\n".join(lines)


def evaluated_json(e: Evaluated) -> dict[str, Any]:
    """One valid configuration as a JSON-able dict."""
    return {
        "label": e.candidate.label(),
        "smp_config": e.candidate.smp_config(),
        "script": e.candidate.script(),
        "micro_batch": e.checked.micro_batch,
        "memory_bytes": e.memory.as_dict(),
        "fits": e.fits,
        "time": {
            "step_seconds": e.time.step,
            "compute_seconds": e.time.compute,
            "optimizer_seconds": e.time.optimizer,
            "exposed_comm_seconds": e.time.exposed,
            "comm_seconds": e.time.comm,
            "flops": e.time.flops,
            "tokens_per_second": e.time.tokens_per_second,
        },
    }


def to_json(plan: Plan, top: int | None = None) -> dict[str, Any]:
    """The plan as a JSON-able dict: inputs, ranked configurations, invalid ones."""
    c, w = plan.cluster, plan.workload
    return {
        "model": {
            "name": plan.model.name,
            "source": plan.model.source,
            "parameters": plan.model.num_params,
        },
        "cluster": {
            "hosts": c.hosts,
            "per_host": c.per_host,
            "accelerator": c.accelerator.name,
            "memory_bytes": c.accelerator.memory_bytes,
            "usable_memory": c.usable_memory,
            "nics": c.nics,
            "nic_bits": c.nic_bits,
        },
        "workload": {
            "seq_len": w.seq_len,
            "global_batch_tokens": w.global_batch_tokens,
            "dtype": w.dtype,
        },
        "matmul_flops": plan.machine.matmul_flops,
        "ranked": [evaluated_json(e) for e in plan.ranked[:top]],
        "invalid": [
            {
                "label": r.candidate.label(),
                "smp_config": r.candidate.smp_config(),
                "script": r.candidate.script(),
                "stage": r.stage,
                "reason": r.reason,
            }
            for r in plan.rejected
        ],
    }


def write_smp_config(e: Evaluated, path: str | os.PathLike[str]) -> None:
    """Writes ``e``'s SMP config as the JSON file ``tsm.init(path)`` reads."""
    with open(path, "w") as f:
        json.dump(e.candidate.smp_config(), f, indent=2)
        f.write("\n")


def plot(plan: Plan, path: str | os.PathLike[str], top: int = 5) -> None:
    """A stacked bar per top configuration: its per-rank memory when backward starts.

    Parameters, optimizer state, FSDP's buffers, saved activations and the transient; no
    gradients yet (they fill in as backward frees the activations) but with gradient
    accumulation, whose later micro-batches start backward with them. A dot marks the
    predicted peak, a dashed line the usable memory.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.ranked[:top]
    parts = ("parameters", "optimizer", "gradients", "buffers", "activations", "transient")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 2), 4.5))
    labels = [e.candidate.label().replace(" ", "\n") for e in rows]
    bottom = [0.0] * len(rows)
    for part in parts:
        values = [
            0.0
            if part == "gradients" and e.candidate.accumulation_steps == 1
            else getattr(e.memory, part) / GIB
            for e in rows
        ]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(labels, [e.memory.peak / GIB for e in rows], "ko", label="predicted peak")
    ax.axhline(plan.cluster.memory_budget / GIB, color="black", ls="--", label="usable memory")
    ax.set(
        ylabel="GiB per rank",
        title=f"{plan.model.name}: memory when backward starts, top configurations",
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


__all__ = [
    "describe_inputs",
    "evaluated_json",
    "plot",
    "rejected_summary",
    "table",
    "to_json",
    "write_smp_config",
]
