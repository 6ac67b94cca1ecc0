"""``bench gpu``'s arithmetic and tables without ranks (torch_sagemaker/bench/gpu_report.py).

The bound a staged all-reduce is judged against (Note [Staging bounds]) is checked on known
stage times, against a step-by-step schedule of the chunk pipeline; the table and the timeline
are checked on made-up results shaped as the ranks return them (the command itself runs in
tests/distributed/test_bench_gpu.py).
"""

from __future__ import annotations

import pytest

from torch_sagemaker.bench import gpu
from torch_sagemaker.bench.gpu_report import (
    STAGES,
    rows_table,
    staging_bounds,
    timeline_table,
)


def _schedule(chunk: dict[str, float], n: int) -> float:
    """When the last chunk leaves the last stage: each stage takes one chunk at a time, in order."""
    free = dict.fromkeys(STAGES, 0.0)  # when each stage is free again
    end = 0.0
    for _ in range(n):
        ready = 0.0
        for stage in STAGES:
            start = max(ready, free[stage])
            ready = free[stage] = start + chunk[stage]
        end = ready
    return end


@pytest.mark.parametrize(
    "chunk, n",
    [
        ({"D2H": 25.0, "host all_reduce": 75.0, "H2D": 22.5}, 4),  # the CPU is the slowest
        ({"D2H": 40.0, "host all_reduce": 10.0, "H2D": 30.0}, 16),  # a copy is
        ({"D2H": 5.0, "host all_reduce": 5.0, "H2D": 5.0}, 3),  # a tie
    ],
)
def test_pipelined_bound_is_the_schedule_of_equal_chunks(chunk, n):
    whole = {k: v * n for k, v in chunk.items()}
    b = staging_bounds(whole, chunk)
    assert b.serial == pytest.approx(sum(whole.values()))
    assert b.pipelined == pytest.approx(_schedule(chunk, n))
    assert b.pipelined == pytest.approx(sum(chunk.values()) + (n - 1) * max(chunk.values()))
    assert b.slowest == max(chunk, key=lambda k: chunk[k])


def test_bounds_on_known_stage_times():
    whole = {"D2H": 100.0, "host all_reduce": 300.0, "H2D": 90.0}
    chunk = {"D2H": 25.0, "host all_reduce": 75.0, "H2D": 22.5}
    b = staging_bounds(whole, chunk)
    assert (b.pipelined, b.serial, b.slowest) == (347.5, 490.0, "host all_reduce")
    # One chunk: nothing overlaps, the two bounds are the serial sum.
    one = staging_bounds(whole, whole)
    assert one.pipelined == one.serial == 490.0
    # A chunk measured slower than its share cannot lift the bound above the serial sum.
    assert staging_bounds(whole, {k: v * 2 for k, v in whole.items()}).pipelined == 490.0


def test_bounds_refuse_mismatched_or_negative_stages():
    with pytest.raises(ValueError, match="same stages"):
        staging_bounds({"D2H": 1.0}, {"H2D": 1.0})
    with pytest.raises(ValueError, match="same stages"):
        staging_bounds({}, {})
    with pytest.raises(ValueError, match="must not be negative"):
        staging_bounds({"D2H": -1.0}, {"D2H": 1.0})


def _row(size, dtype, d2h, host, h2d, staged, chunk=None):
    stages = {"D2H": d2h, "host all_reduce": host, "H2D": h2d}
    return {
        "size": size,
        "dtype": dtype,
        **stages,
        "chunk": chunk or stages,
        "smddp pinned": staged,
    }


def test_table_gives_each_size_against_both_bounds():
    chunk = {"D2H": 25.0, "host all_reduce": 75.0, "H2D": 22.5}
    rows = [
        _row(64 << 10, "float32", 8.0, 20.0, 7.0, 344.0),
        _row(16 << 20, "bfloat16", 100.0, 300.0, 90.0, 695.0, chunk),
    ]
    rows[0]["copy D2H+H2D"] = 16.0
    text = rows_table(rows, ["smddp pinned"], 4 << 20)
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:10] == [
        "size",
        "dtype",
        *STAGES,
        "serial",
        "pipelined",
        "smddp pinned",
        "smddp pinned / pipelined",
        "smddp pinned / serial",
    ]
    first = dict(zip(head, (c.strip() for c in lines[1].strip("|").split("|")), strict=True))
    assert first["serial"] == first["pipelined"] == "35.0"
    assert first["smddp pinned / pipelined"] == f"{344 / 35:.2f}"
    assert first["copy D2H+H2D"] == "16.0"
    second = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|")), strict=True))
    assert (second["dtype"], second["serial"], second["pipelined"]) == (
        "bfloat16",
        "490.0",
        "347.5",
    )
    assert second["smddp pinned / pipelined"] == "2.00"
    assert second["copy D2H+H2D"] == ""
    assert "| bfloat16 | 25.0 | 75.0 | 22.5 |" in text  # the chunk's stages, for the bound


def test_timeline_table_numbers_the_chunks_per_rank():
    spans = [
        ["call", 1000, 9000, 0],
        ["d2h queue", 2000, 2100, 4096],
        ["d2h queue", 2100, 2200, 4096],
        ["d2h wait", 2300, 2400, 4096],
        ["d2h wait", 2600, 2700, 4096],
    ]
    text = timeline_table(
        {"size": 8192, "dtype": "float32", "median_us": 8.0, "spans": [spans, spans[:3]]}
    )
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")][1:]  # under the header
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert [r[:3] for r in rows] == [
        ["0", "call", ""],
        ["0", "d2h queue", "0"],
        ["0", "d2h queue", "1"],
        ["0", "d2h wait", "0"],
        ["0", "d2h wait", "1"],
        ["1", "call", ""],
        ["1", "d2h queue", "0"],
        ["1", "d2h queue", "1"],
    ]
    assert rows[0][3:6] == ["0.0", "8.0", "8.0"]  # µs from the first span of any rank
    assert rows[1][6] == "4 KiB"


def test_merge_keeps_the_slowest_rank_of_each_cell():
    def result(rank, t):
        return {
            "rank": rank,
            "rows": [_row(1024, "float32", t, 2 * t, 3 * t, 10 * t)],
            "timeline": [
                {"size": 1024, "dtype": "float32", "spans": [["call", 0, 1, 0]], "median_us": t}
            ],
        }

    merged = gpu.merge([result(1, 5.0), result(0, 1.0)])
    assert merged["rank"] == 0
    (row,) = merged["rows"]
    assert (row["D2H"], row["H2D"], row["smddp pinned"], row["size"]) == (5.0, 15.0, 50.0, 1024)
    assert row["chunk"] == {"D2H": 5.0, "host all_reduce": 10.0, "H2D": 15.0}
    (call,) = merged["timeline"]
    assert call["median_us"] == 5.0 and len(call["spans"]) == 2


def test_unknown_dtype_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        gpu._parse(["--dtypes", "float32,float8"])
    assert "--dtypes float8: not one of float32, bfloat16" in capsys.readouterr().err
