"""``make gpu-check`` rehearsed on a machine without CUDA.

The check (scripts/gpu_check.py) is what a session with a GPU runs first, in minutes it cannot
spend on the script itself. Here it must run end to end: versions and the build pass, every
GPU test file is collected and skipped for want of CUDA (a file that fails to import fails
the step), the benchmark is skipped with its reason, the CPU staging tests pass, and the
report is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CUDA_STEPS = (
    "smddp_cuda",
    "offload_cuda",
    "parallel_cuda",
    "example_cuda",
    "te_cuda",
    "fp8_cuda",
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a machine with CUDA runs the check for real"
)


@pytest.mark.slow
def test_gpu_check_rehearses_on_cpu(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    steps = {s["name"]: s for s in json.loads((tmp_path / "report.json").read_text())}
    assert list(steps) == [
        "versions",
        "build",
        *CUDA_STEPS,
        "bench_gpu",
        "gpu_timeline",
        "bench_fp8",
        "fp8_cpu",
        "cpu_staging",
    ]
    assert steps["versions"]["status"] == "passed", steps["versions"]
    assert f"torch {torch.__version__}" in steps["versions"]["detail"]
    assert steps["build"]["status"] == "passed", steps["build"]
    for name in CUDA_STEPS:
        step = steps[name]
        assert step["status"] == "skipped", step
        assert step["tests"], f"{name}: no test was collected"
        for test, outcome in step["tests"].items():
            # Skipped for want of CUDA or of transformer_engine, whichever the test checks
            # first; neither is on this machine.
            assert outcome.startswith("skipped: ") and (
                "CUDA" in outcome or "transformer_engine" in outcome
            ), (test, outcome)
    for name in ("bench_gpu", "gpu_timeline", "bench_fp8", "fp8_cpu"):
        assert steps[name]["status"] == "skipped", steps[name]
        assert "no CUDA here" in steps[name]["detail"], steps[name]
    staging = steps["cpu_staging"]
    assert staging["status"] == "passed", staging
    assert staging["tests"] and all(v == "passed" for v in staging["tests"].values()), staging
    report = (tmp_path / "report.md").read_text()
    assert "CPU rehearsal (no CUDA)" in report and "| cpu_staging |" in report
    assert (tmp_path / "steps.log").stat().st_size > 0
