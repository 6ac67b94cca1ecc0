"""``bench gpu`` end to end without a GPU: ``--device cpu``, through the staging seam.

The ranks are spawned as the command spawns them, the staged groups stage CPU tensors
(``stage_cpu``), and the table, the bounds and the timeline come out as on a GPU; the figures
say nothing about one (docs/gpu.md). The bound's arithmetic on known stage times is in
tests/unit/test_gpu_bench_report.py; here the printed bounds must follow from the printed
stage times, and every phase of one call must be in the timeline of each rank.
"""

import pytest

from benchmarks import gpu
from benchmarks.gpu_report import STAGES, staging_bounds
from tests.distributed.test_smddp_staging_timeline import RUN
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

PHASES = {
    "bench: call and wait",
    "bench: stream done",
    "call",
    "issue",
    "queued",
    "host buffers",
    "d2h queue",
    "issue event wait",
    "d2h wait",
    "host collective",
    "h2d queue",
    "copies wait",
    "complete",
    "wait",
}


def _table(lines: list[str], first: str) -> list[dict[str, str]]:
    """The markdown table whose header starts with ``| first |``, as one dict per row."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first} |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True)))
    return rows


def test_cpu_rehearsal_prints_the_table_its_bounds_and_a_timeline(capsys):
    args = ["--device", "cpu", "--nprocs", "2", "--sizes", "16K,64K", "--chunk-bytes", "16K"]
    args += ["--iters", "3", "--warmup", "1", "--timeline", "--timeline-sizes", "64K"]
    assert gpu.main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("2 ranks, CPU rehearsal")
    rows = _table(lines, "size")
    assert [(r["size"], r["dtype"]) for r in rows] == [
        ("16 KiB", "float32"),
        ("16 KiB", "bfloat16"),
        ("64 KiB", "float32"),
        ("64 KiB", "bfloat16"),
    ]
    chunk = {r["dtype"]: {k: float(r[k]) for k in STAGES} for r in _table(lines, "dtype")}
    assert set(chunk) == {"float32", "bfloat16"}
    for r in rows:
        whole = {k: float(r[k]) for k in STAGES}
        assert all(t > 0 for t in whole.values()), r
        # One chunk at 16 KiB; four at 64 KiB, whose other stages come from the chunk table.
        b = staging_bounds(whole, whole if r["size"] == "16 KiB" else chunk[r["dtype"]])
        assert float(r["serial"]) == pytest.approx(b.serial, abs=0.2)
        assert float(r["pipelined"]) == pytest.approx(b.pipelined, abs=0.2)
        staged = float(r["smddp staged"])
        assert staged > 0 and float(r["copy D2H+H2D"]) > 0
        assert float(r["smddp staged / pipelined"]) == pytest.approx(
            staged / float(r["pipelined"]), rel=0.02, abs=0.01
        )
    assert float(rows[0]["serial"]) == float(rows[0]["pipelined"])  # one chunk
    assert "kernels besides copies: not checked (no GPU)" in out
    # One call's phases on each rank.
    timeline = _table(lines, "rank")
    for rank in ("0", "1"):
        phases = [t["phase"] for t in timeline if t["rank"] == rank]
        assert set(phases) - set(RUN) == PHASES, phases
        assert sum(p in RUN for p in phases) == 1
        for per_chunk in ("d2h queue", "d2h wait", "host collective", "h2d queue"):
            chunks = [t["chunk"] for t in timeline if t["rank"] == rank and t["phase"] == per_chunk]
            assert chunks == ["0", "1", "2", "3"], (per_chunk, chunks)
