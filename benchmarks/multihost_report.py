"""``bench multihost``'s tables: each case against the NIC's bound, the CPU per byte, timelines.

The rows come from the ranks (``multihost_rank._row``); ``multihost.main`` prints these
tables of them. The bound and the columns are described in ``multihost``'s docstring.
"""

from __future__ import annotations

import math

from benchmarks.collectives_report import format_size
from benchmarks.multihost_rank import BACKENDS
from tools.bare_tcp import BARE_TCP
from torch_sagemaker.planner.cost_model import nic_factor


def min_bytes(op: str, hosts: int, size: int) -> float:
    """The bytes each host's NIC must send, at least, for one call on ``size`` bytes."""
    return nic_factor(op) * (hosts - 1) / hosts * size


def timeline_table(rows: list[dict]) -> str:
    """Where the time of one call went on each rank: its phases, in ms from the call's start.

    The call is the middle timed call; the start is the earliest rank's. Phases that repeat
    within the call (the reduction of each chunk) are one line: first start, last end, how
    many, and their total time.
    """
    lines = []
    for r in rows:
        if not r.get("timeline"):
            continue
        lines += [
            f"\n{r['layout']} {r['backend']} ({r.get('algorithm', 'mesh')}) {r['op']} "
            f"{format_size(r['bytes'])}: phases per rank, ms",
            "| rank | phase | start | end | count | busy |",
            "|---|---|---|---|---|---|",
        ]
        t0 = min(b for spans in r["timeline"] for _, b, _, _ in spans)
        for rank, spans in enumerate(r["timeline"]):
            merged: dict[str, list[float]] = {}
            for phase, begin, end, _ in spans:
                m = merged.setdefault(phase, [begin, end, 0, 0.0])
                m[0], m[1] = min(m[0], begin), max(m[1], end)
                m[2] += 1
                m[3] += end - begin
            for phase, (begin, end, count, busy) in sorted(merged.items(), key=lambda x: x[1][0]):
                lines.append(
                    f"| {rank} | {phase} | {(begin - t0) / 1e6:.2f} | {(end - t0) / 1e6:.2f} | "
                    f"{count} | {busy / 1e6:.2f} |"
                )
    return "\n".join(lines)


def ran_setting(per_host: list[dict[str, str]], key: str) -> str:
    """A TCP setting as the hosts reported it: one value on every host, or each host's.

    Args:
        per_host: ``tools.bench_host.host_settings`` of each host (``run_layout``'s
            ``hosts``), jobs in turn.
        key: ``congestion`` or ``slow_start_after_idle``.
    """
    values = [h[key] for h in per_host]
    if len(set(values)) == 1:
        return f"{values[0]} on every host"
    return ", ".join(f"host {i}: {value}" for i, value in enumerate(values))


def _ratio(per: dict[str, dict], a: str, b: str) -> str:
    """A's time over b's, or "-" where either did not run."""
    if a not in per or b not in per:
        return "-"
    return f"{per[a]['seconds'] / per[b]['seconds']:.2f}"


def table(rows: list[dict], rate_bits: int | None) -> str:
    """The rows as a markdown table, every backend side by side.

    Two backends get a ratio column; with the bare-TCP ceiling, each other backend gets a
    column of the ceiling's time over its own.
    """
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["layout"], r.get("dtype", "float32"), r.get("warmup"), r["op"], r["bytes"])
        by_key.setdefault(key, {})[r["backend"]] = r
    backends = sorted({r["backend"] for r in rows}, key=lambda b: BACKENDS.index(b))
    head = ["layout", "dtype", "warm-up", "op", "size", "bound ms"]
    for b in backends:
        head += [f"{b} ms", f"{b} of bound", f"{b} wire", f"{b} drops"]
    compared = [b for b in backends if b != BARE_TCP]
    ceiling = BARE_TCP in backends
    if len(compared) == 2:
        head.append(f"{compared[1]} / {compared[0]}")
    if ceiling:
        head += [f"{b} of {BARE_TCP}" for b in compared]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (layout, dtype, warmup, op, size), per in by_key.items():
        hosts = int(layout.split("x")[0])
        # Unshaped NICs (--rate unlimited) have no bound: the bare-TCP ceiling is the scale.
        bound = min_bytes(op, hosts, size) * 8 / rate_bits if rate_bits else math.nan
        warm = "-" if warmup is None else str(warmup)
        cells = [layout, dtype, warm, op, format_size(size), _cell(bound * 1e3, ".1f")]
        for b in backends:
            if b not in per:
                cells += ["-"] * 4
                continue
            r = per[b]
            mark = "" if r["ok"] else " WRONG"
            cells += [
                f"{r['seconds'] * 1e3:.1f}{mark}",
                _cell(bound / r["seconds"], ".2f"),
                f"{r['tx_per_call'] / min_bytes(op, hosts, size):.2f}",
                str(r["drops"]),
            ]
        if len(compared) == 2:
            cells.append(_ratio(per, compared[1], compared[0]))
        if ceiling:
            cells += [_ratio(per, BARE_TCP, b) for b in compared]
        lines.append("| " + " | ".join(cells) + " |")
    # Each backend's algorithms in the order its rows ran them (auto: the tree for small
    # all_reduces, Note [Auto by size and host count]).
    crossing: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r["backend"] not in ("gloo", BARE_TCP) and "algorithm" in r:
            ran = crossing.setdefault((r["layout"], r["backend"]), [])
            if r["algorithm"] not in ran:
                ran.append(r["algorithm"])
    if crossing:
        lines.append("")
        lines.append(
            "Between hosts: "
            + ", ".join(f"{layout} {b} {'+'.join(a)}" for (layout, b), a in crossing.items())
        )
    return "\n".join(lines)


def queue_text(queue: int | None, rate: int | None) -> str:
    """The switch ports' queue as the header says it (unshaped: no queue to speak of)."""
    if rate is None:
        return "unshaped"
    return f"queue {'50 ms' if queue is None else format_size(queue)}"


def _cell(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def cpu_table(rows: list[dict]) -> str:
    """What each case cost the CPU per GB the op must move between hosts (Note [CPU per byte]).

    Columns: the bytes moved per second (all hosts' minimum, by the op), the CPU-seconds per
    GB of those bytes summed over the ranks and on the busiest rank, the machine's softirq
    seconds per GB, and for smddp its messages per second (all ranks' sends) with the
    system calls per message and the share of the bytes it received that were copied twice
    (read before their receive was posted: stashed).
    """
    head = "| layout | dtype | op | size | backend | GB/s | CPU s/GB | busiest rank | softirq s/GB"
    lines = [head + " | msgs/s | calls/msg | stashed |", "|" + "---|" * 12]
    for r in rows:
        if "cpu_per_call" not in r:
            continue
        hosts = int(r["layout"].split("x")[0])
        gb = min_bytes(r["op"], hosts, r["bytes"]) * hosts / 1e9  # per call
        cells = [r["layout"], r.get("dtype", "float32"), r["op"], format_size(r["bytes"])]
        cells += [r["backend"], f"{gb / r['seconds']:.2f}"]
        cells += [f"{sum(r['cpu_per_call']) / gb:.2f}", f"{max(r['cpu_per_call']) / gb:.2f}"]
        cells.append(f"{r['softirq_per_call'] / gb:.2f}")
        t = r.get("transport_per_call")
        if t and t["messages_sent"]:
            calls = t["send_calls"] + t["recv_calls"] + t["polls"]
            cells += [
                f"{t['messages_sent'] / r['seconds']:.0f}",
                f"{calls / (t['messages_sent'] + t['messages_received']):.1f}",
                f"{t['stashed_bytes'] / max(t['bytes_received'], 1):.2f}",
            ]
        else:
            cells += ["-"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
