"""``bench multihost --train``'s table: tokens/s, where the step's time went, and the losses.

Each row is one setup on one layout and backend (``multihost_training`` has the setups
and Note [Exposed communication]). Beside tokens/s: the fraction of the same setup and
backend on one host of as many ranks with the same mesh shape ("of one host's"), the
ratio to gloo in the same layout ("vs gloo"), the step, its compute and its exposed
communication per op in ms, and how far the run's losses are from one host's.

The losses: every layout gives rank r the same batches and the same initial model, and
the one-host run has the same mesh shape, so the two runs compute the same steps and differ
only in the order the backend adds the ranks' gradients. Within a bf16 step that order moves
the reduced gradients by bf16 rounding (the inputs of every reduction are bf16), and the
forward rounds to bf16 again; ``LOSS_TOLERANCE`` bounds the largest difference of any rank's
loss at any step. gloo's collectives do not depend on where the ranks are, so its runs
should agree exactly.
"""

from __future__ import annotations

from typing import Any

from benchmarks.multihost_training import OPS

# The largest |loss - one host's loss| of any rank at any step; the losses start near
# ln(vocab) (9 for the benchmark's model). float32: reduction order alone. bfloat16: that
# order on bf16 partial sums, through a bf16 forward; a third of bf16's spacing at the
# loss's magnitude (1/16 from 8 to 16), and 50x the largest difference seen on 2x2 and 4x1
# after two steps (3.9e-4; smddp's 2-rank groups add in one order and gave 0 exactly).
LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def _key(record: dict) -> tuple:
    return (record["setup"], record["replicas"], record["shard"], record["backend"])


def one_host(per_layout: dict[str, list[dict]], layout: str, record: dict) -> dict | None:
    """The record of ``record``'s run on one host of as many ranks (``1xN``), if it ran."""
    hosts, local = (int(x) for x in layout.split("x"))
    if hosts == 1:
        return None
    for other in per_layout.get(f"1x{hosts * local}", []):
        if _key(other) == _key(record):
            return other
    return None


def loss_gap(record: dict, reference: dict) -> float:
    """The largest |loss - reference loss| over every rank and step."""
    return max(
        abs(a - b)
        for mine, theirs in zip(record["losses"], reference["losses"], strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )


def loss_problems(per_layout: dict[str, list[dict]]) -> list[str]:
    """One line per run whose losses are beyond ``LOSS_TOLERANCE`` of one host's."""
    problems = []
    for layout, records in per_layout.items():
        for r in records:
            ref = one_host(per_layout, layout, r)
            if ref is None:
                continue
            gap, tolerance = loss_gap(r, ref), LOSS_TOLERANCE[r["dtype"]]
            if gap > tolerance:
                problems.append(
                    f"{layout} {r['setup']} {r['backend']} {r['dtype']}: losses differ from "
                    f"one host's by {gap:.2e}, more than {tolerance:.0e}"
                )
    return problems


def tokens_per_second(records: list[dict], setup: str, backend: str) -> float:
    """The tokens/s of ``setup`` on ``backend`` among one job's ``records``."""
    for r in records:
        if r["setup"] == setup and r["backend"] == backend:
            return r["tokens_per_s"]
    raise KeyError(f"no {setup} run on {backend} among {[_key(r) for r in records]}")


def training_table(per_layout: dict[str, list[dict]]) -> str:
    """The records of every layout as a Markdown table (module docstring)."""
    head = [
        "layout",
        "setup",
        "wrapped",
        "backend",
        "tokens/s",
        "of one host's",
        "vs gloo",
        "step ms",
        "compute ms",
        *(f"exposed {op} ms" for op in OPS),
        "exposed of step",
        "loss vs one host",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layout, records in per_layout.items():
        gloo = {
            (r["setup"], r["replicas"], r["shard"]): r for r in records if r["backend"] == "gloo"
        }
        for r in records:
            ref = one_host(per_layout, layout, r)
            base = gloo.get((r["setup"], r["replicas"], r["shard"]))
            exposed = sum(r["exposed_s"].values())
            cells = [
                layout,
                r["setup"],
                r["wrapped"],
                r["backend"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-",
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
                if base and r["backend"] != "gloo"
                else "-",
                f"{r['step_s'] * 1e3:.0f}",
                f"{r['compute_s'] * 1e3:.0f}",
                *(f"{r['exposed_s'][op] * 1e3:.0f}" for op in OPS),
                f"{exposed / r['step_s']:.2f}",
                _loss_cell(r, ref),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _loss_cell(record: dict, reference: dict | None) -> str:
    if reference is None:
        return "-"
    gap = loss_gap(record, reference)
    mark = "" if gap <= LOSS_TOLERANCE[record["dtype"]] else " OVER"
    return f"{gap:.1e}{mark}"


def header(setups: list[str], dtype: str, steps: int, model: dict[str, Any] | None) -> str:
    """The line above the table: what trained, in what type, over how many steps."""
    size = "small Llama" if not model else f"Llama {model}"
    return (
        f"Training ({', '.join(setups)}), {size}, {dtype}, median of {steps} steps after one "
        "untimed; exposed: time the step's thread spent inside collectives, on the rank with "
        "the most compute (Note [Exposed communication] in benchmarks/multihost_training.py)"
    )
