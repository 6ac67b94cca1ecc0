"""``bench gpu``'s arithmetic and tables: the staged all-reduce's bounds, its rows, its timeline.

Pure functions of what the ranks measured (``torch_sagemaker/bench/gpu.py``), so the bound's
arithmetic and the tables are tested without ranks.

Note [Staging bounds]
A staged all_reduce (Note [Device staging] and Note [Staging pipeline] in
csrc/smddp/backend/device_staging.h) passes every chunk of its message through three stages:
the device->host copy, smddp's CPU all_reduce on the host buffer, the host->device copy.
``bench gpu`` times each stage alone, every rank at once as in the collective (so two ranks
sharing a GPU share its copy engines here too): the whole message takes T_k in stage k, one
chunk t_k. Done one after the other the call takes the serial sum T_d2h + T_host + T_h2d.
Overlapped chunk by chunk, the slowest stage s runs back to back over every chunk, and the
first chunk must pass the stages before s, the last chunk the stages after it, so the call
takes at least T_s + sum over k != s of t_k: the pipelined bound (for n equal chunks,
sum t_k + (n - 1) max t_k). With one chunk the two are equal. Measured chunk times could in
principle exceed the whole message's share of a stage; the pipelined bound is capped at the
serial sum so that noise never makes it the larger. What neither counts: issuing the call,
handing it to a thread, waiting on events; which is what the timeline (Note [Staging timeline])
shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch_sagemaker.bench.collectives_report import format_size

STAGES = ("D2H", "host all_reduce", "H2D")
# Phases recorded once per chunk (Note [Staging timeline]); the table numbers them.
PER_CHUNK = ("d2h queue", "d2h wait", "host collective", "h2d queue")


@dataclass(frozen=True)
class Bounds:
    """The staged all-reduce's bounds from its stage times (Note [Staging bounds])."""

    pipelined: float
    serial: float
    slowest: str  # the stage that runs back to back


def staging_bounds(whole: Mapping[str, float], chunk: Mapping[str, float]) -> Bounds:
    """The pipelined bound and the serial sum of a staged call (Note [Staging bounds]).

    Args:
        whole: Each stage's time for the whole message.
        chunk: Each stage's time for one chunk (the same as ``whole`` for a message of one
            chunk). Must name the same stages.

    Returns:
        The bounds, in the unit of the inputs.

    Raises:
        ValueError: The two mappings name different stages, none, or a negative time.
    """
    if set(whole) != set(chunk) or not whole:
        raise ValueError(
            f"staging_bounds needs the same stages for the whole message and for one chunk, "
            f"got {sorted(whole)} and {sorted(chunk)}"
        )
    if any(t < 0 for t in (*whole.values(), *chunk.values())):
        raise ValueError(f"stage times must not be negative, got {dict(whole)} and {dict(chunk)}")
    serial = sum(whole.values())
    slowest = max(whole, key=lambda k: whole[k])
    pipelined = whole[slowest] + sum(chunk[k] for k in whole if k != slowest)
    return Bounds(min(pipelined, serial), serial, slowest)


def _us(t: float) -> str:
    return f"{t:.1f}"


def rows_table(rows: list[dict], staged: list[str], chunk_bytes: int) -> str:
    """The all_reduce table: each size and dtype against its stages and both bounds.

    Args:
        rows: One per (size, dtype): ``size``, ``dtype``, the stage times (``STAGES``), the
            same for one chunk under ``chunk``, and one time per column of ``staged`` and
            per baseline (``copy D2H+H2D``, ``nccl`` where measured), in µs.
        staged: The staged groups' columns, the first one compared to the bounds.
        chunk_bytes: The staging chunk, for the caption.
    """
    first = staged[0]
    others = [c for c in (*staged[1:], "nccl", "copy D2H+H2D") if any(c in r for r in rows)]
    head = ["size", "dtype", *STAGES, "serial", "pipelined", first]
    head += [f"{first} / pipelined", f"{first} / serial", *others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = staging_bounds({k: r[k] for k in STAGES}, r["chunk"])
        cells = [format_size(r["size"]), r["dtype"], *(_us(r[k]) for k in STAGES)]
        cells += [_us(b.serial), _us(b.pipelined), _us(r[first])]
        cells += [f"{r[first] / b.pipelined:.2f}", f"{r[first] / b.serial:.2f}"]
        cells += [_us(r[c]) if c in r else "" for c in others]
        lines.append("| " + " | ".join(cells) + " |")
    chunked = [r for r in rows if r["size"] > chunk_bytes]
    lines += [
        "",
        f"one chunk ({format_size(chunk_bytes)}) alone, µs (the pipelined bound's other stages):",
        "| dtype | " + " | ".join(STAGES) + " |",
        "|" + "---|" * (len(STAGES) + 1),
    ]
    seen = set()
    for r in chunked:
        if r["dtype"] not in seen:
            seen.add(r["dtype"])
            lines.append(
                f"| {r['dtype']} | " + " | ".join(_us(r["chunk"][k]) for k in STAGES) + " |"
            )
    if not chunked:
        lines.append("| (no message above one chunk) |" + " |" * len(STAGES))
    return "\n".join(lines)


def timeline_table(call: dict) -> str:
    """One staged call's phases per rank (Note [Staging timeline]), in µs from its first event.

    Args:
        call: ``size``, ``dtype``, ``median_us`` (the timed loop's median, from before the
            call to the stream's completion) and ``spans``: per rank, rows ``[phase,
            begin_ns, end_ns, bytes]`` of the chosen call, with the benchmark's own
            ``bench: ...`` spans around it.
    """
    t0 = min(b for spans in call["spans"] for _, b, _, _ in spans)
    lines = [
        f"\n{format_size(call['size'])} {call['dtype']} all_reduce, one call (median of its loop: "
        f"{call['median_us']:.1f} µs): phases per rank, µs from the first",
        "| rank | phase | chunk | start | end | µs | bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for rank, spans in enumerate(call["spans"]):
        seen: dict[str, int] = {}
        for phase, begin, end, nbytes in sorted(spans, key=lambda s: (s[1], -s[2])):
            chunk = ""
            if phase in PER_CHUNK:
                chunk = str(seen.get(phase, 0))
                seen[phase] = seen.get(phase, 0) + 1
            lines.append(
                f"| {rank} | {phase} | {chunk} | {(begin - t0) / 1e3:.1f} | {(end - t0) / 1e3:.1f} "
                f"| {(end - begin) / 1e3:.1f} | {format_size(nbytes) if nbytes else ''} |"
            )
    return "\n".join(lines)


def report(r: dict, world: int) -> str:
    """``bench gpu``'s whole output from rank 0's merged result."""
    where = (
        f"{world} ranks on {r['gpus']} GPU(s) ({r['device']})"
        if r["cuda"]
        else f"{world} ranks, CPU rehearsal: 'device' tensors are CPU tensors staged through "
        "the seam (SMDDP_STAGE_CPU), copies are plain copies; no figure here is a GPU's"
    )
    lines = [where]
    if r.get("copies"):
        lines += ["", "copy bandwidth:", "| bytes | host memory | direction | GB/s |"]
        lines.append("|---|---|---|---|")
        for c in r["copies"]:
            lines.append(
                f"| {format_size(c['bytes'])} | {c['host']} | {c['dir']} | {c['GBps']:.1f} |"
            )
    if r.get("rows"):
        lines += [
            "",
            "all_reduce, median µs, each cell the slowest rank's (stages alone, every rank at "
            "once; Note [Staging bounds] in torch_sagemaker/bench/gpu_report.py):",
            rows_table(r["rows"], r["staged"], r["chunk_bytes"]),
            "",
            "D2H, H2D: the whole message copied one way, pinned host memory on a GPU; host "
            "all_reduce: smddp's CPU all_reduce of it on host buffers, same ranks; serial: their "
            "sum; pipelined: the slowest stage plus one chunk through the others; copy D2H+H2D: "
            "each rank's tensor to host and back, no overlap",
        ]
        if r["cuda"] and not any("nccl" in row for row in r["rows"]):
            lines.append("(no NCCL baseline: NCCL needs one GPU per rank)")
    for call in r.get("timeline") or []:
        lines.append(timeline_table(call))
    if r["cuda"]:
        lines += ["", f"kernels besides copies in a staged all_reduce: {r['kernels'] or 'none'}"]
    else:
        lines += ["", "kernels besides copies: not checked (no GPU)"]
    return "\n".join(lines)
