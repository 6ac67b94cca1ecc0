"""The collective benchmark's report.

What each operation moves, the speed-up cells, the markdown table and the plot: pure
functions of the measured rows (no processes).
"""

from __future__ import annotations

import statistics

# Bytes the user buffers force through memory per rank, in units of S (reads + writes),
# and how smddp moves them; shared-memory staging goes through cache-sized chunks.
PASSES = {
    "all_reduce": (
        lambda n: 2.0,
        "read S + write S; chunks staged in shm, reduced by their "
        "owner rank and gathered while cache-resident (one-shot up to SMDDP_ONESHOT_BYTES)",
    ),
    "all_gather_into_tensor": (
        lambda n: 1 / n + 1,
        "read S/n + write S; one copy in, n-1 copies out per chunk",
    ),
    "reduce_scatter_tensor": (
        lambda n: 1 + 1 / n,
        "read S + write S/n; every rank reduces only its own block (true reduce-scatter)",
    ),
    "broadcast": (lambda n: 1.0, "root reads S, others write S"),
    "all_to_all": (lambda n: 2.0, "read S + write S"),
    "reduce": (
        lambda n: 2.0,
        "every rank reads S, the root writes S; reduce-scatter of "
        "each chunk, then only the root gathers the reduced slices",
    ),
    "gather": (
        lambda n: 1 / n + 1,
        "read S/n + write S on the root; only the root reads the others' chunks",
    ),
    "scatter": (
        lambda n: 1 + 1 / n,
        "the root reads S, every rank writes S/n; each rank reads "
        "only its own chunk from the root's buffer",
    ),
    "sparse_all_reduce": (
        lambda n: 1.0 + n,
        "read S + write n x S; all-gathers every rank's indices and values, then each rank "
        "coalesces the n parts (summing rows that several ranks touched)",
    ),
    "sendrecv": (
        lambda n: 2.0,
        "read S + write S; through the pair's shared-memory ring in "
        "64 KiB pieces while cache-resident (small messages: written by the caller)",
    ),
}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw x this, for `n` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if op in ("broadcast", "sendrecv", "reduce", "sparse_all_reduce") else (n - 1) / n


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it exactly (e.g. "64 KiB")."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


# Note [Paired speed-ups]
# A shared 2-core VM changes speed between phases that last seconds: in one run of 10 the
# 64 KiB all_reduce of one backend took 49 us in the sweep where the others took 17 us.
# The ratio of two cells' medians mixes the backends' luck across sweeps; the ratio within a
# sweep compares measurements taken a fraction of a second apart. So each speed-up is the
# median over sweeps of that sweep's ratio, and the range shows how much they disagreed.
def _sweep_ratios(row: dict, first: str, other: str) -> list[float] | None:
    """`other`'s time / `first`'s in each sweep, None if either is missing."""
    if row.get(first) is None or row.get(other) is None:
        return None
    return [o / f for f, o in zip(row[first]["sweeps_us"], row[other]["sweeps_us"])]


def _times(ratio: float) -> str:
    """2.35x below 10 (whether 64 KiB is 0.96x or 1.04x is the question there), 50.3x above."""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x"


def _ratio_cell(row: dict, first: str, other: str) -> str:
    """The speed-up cell: 1.31x, or 1.31x (1.22x-1.40x) over several sweeps; n/a if not measured."""
    ratios = _sweep_ratios(row, first, other)
    if ratios is None:
        return "n/a"
    cell = _times(statistics.median(ratios))
    if len(ratios) > 1:
        cell += f" ({_times(min(ratios))}-{_times(max(ratios))})"
    return cell


def format_row(row: dict, backends: list[str], base: str | None = None) -> str:
    """One row as the progress line printed while the sweep runs (not markdown)."""
    base = base or backends[0]
    cells = [f"{row['op']:<22}", f"{format_size(row['size']):>9}"]
    for b in backends:
        r = row[b]
        cells.append(
            "n/a".center(33)
            if r is None
            else (
                f"{r['time_us']:>10.1f} {r['algbw']:>7.3f} {r['busbw']:>7.3f} "
                f"{r['copy_pct']:>5.0f}%"
            )
        )
    for b in backends:
        if b == base:
            continue
        cells.append(f"{_ratio_cell(row, base, b):>8}")
    return " | ".join(cells)


def format_table(
    rows: list[dict], copy: dict, backends: list[str], world: int, base: str | None = None
) -> str:
    """Markdown table of the results, one line per (op, size).

    Args:
        rows: one dict per (op, size): "op", "size", and per backend a dict of "time_us",
            "sweeps_us" (one median per sweep), "algbw", "busbw", "copy_pct", or None where
            that backend did not run the op.
        copy: memcpy bandwidth in bytes/s, "cache" (1 MiB) and "dram" (64 MiB).
        backends: backend names in column order; every one but ``base`` gets a speed-up
            column "(base vs it)": the median over sweeps of its time / base's, with the
            range when there are several sweeps (Note [Paired speed-ups]).
        world: number of ranks.
        base: the column the speed-ups are relative to (default: the first backend).

    Returns:
        The table with a header line and the memory-pass notes, as one string.
    """
    base = base or backends[0]
    others = [b for b in backends if b != base]
    head = ["op", "size"]
    for b in backends:
        head += [f"{b} time (us)", f"{b} algbw (GB/s)", f"{b} busbw (GB/s)", f"{b} copy%"]
    head += [f"speed-up ({base} vs {b})" for b in others]
    lines = [
        f"{world} ranks; memcpy with all ranks copying: {copy['cache'] / 1e9:.1f} GB/s per rank "
        f"at 1 MiB (cache), {copy['dram'] / 1e9:.1f} GB/s per rank at 64 MiB (DRAM)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in rows:
        cells = [row["op"], format_size(row["size"])]
        for b in backends:
            r = row[b]
            cells += (
                ["n/a", "", "", ""]
                if r is None
                else [
                    f"{r['time_us']:.1f}",
                    f"{r['algbw']:.3f}",
                    f"{r['busbw']:.3f}",
                    f"{r['copy_pct']:.0f}%",
                ]
            )
        cells += [_ratio_cell(row, base, b) for b in others]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Memory passes per rank over the user buffers (S = size above):"]
    lines += [f"- {op}: {PASSES[op][1]}" for op in dict.fromkeys(r["op"] for r in rows)]
    return "\n".join(lines)


def plot(rows: list[dict], backends: list[str], world: int, path: str) -> None:
    """Writes busbw against size, one panel per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op]
        for b in backends:
            have = [r for r in mine if r[b] is not None]
            if have:
                ax.plot(
                    [r["size"] for r in have],
                    [r[b]["busbw"] for r in have],
                    marker="o",
                    ms=3,
                    label=b,
                )
        ax.set(xscale="log", yscale="log", title=op, xlabel="bytes", ylabel="busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{world} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
