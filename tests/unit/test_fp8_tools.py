"""The FP8 tools without their long runs: scripts/fp8_loss_curve.py (``make fp8-curve``: its
command lines, the comparison it judges the runs by, the plot) and ``bench fp8`` on a tiny
shape on CPU (the table ``make gpu-check`` prints on the GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "fp8_curve", ROOT / "scripts" / "fp8_loss_curve.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_two_runs_differ_only_in_fp8(tmp_path):
    s = _script()
    bf16 = s.train_command(2, 200, tmp_path / "a", False, ["--seed", "3"])
    fp8 = s.train_command(2, 200, tmp_path / "b", True, ["--seed", "3"])
    assert bf16[:3] == ["nice", "-n", "10"] and "--bf16" in bf16
    assert [a for a, b in zip(bf16, fp8) if a != b] == ["0", str(tmp_path / "a")]
    fp32 = s.train_command(2, 200, tmp_path / "a", False, [], bf16=False)
    assert fp32[fp32.index("--bf16") + 1] == "0"
    assert fp8[fp8.index("--fp8") + 1] == "1" and fp8[-2:] == ["--seed", "3"]


def test_compare_and_plot(tmp_path):
    s = _script()
    assert s.moving_average([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]
    bf16 = [4.0 - 0.01 * i for i in range(60)]
    fp8 = [x * 1.01 for x in bf16[:30]] + [x * 1.03 for x in bf16[30:]]
    r = s.compare(bf16, fp8)
    assert r["tail"] == pytest.approx(0.03) and r["max_smoothed"] == pytest.approx(0.03)
    assert r["max_smoothed_step"] >= 40 and len(r["smoothed"]) == 60
    with pytest.raises(ValueError, match="different lengths"):
        s.compare(bf16, fp8[:-1])
    pytest.importorskip("matplotlib")
    s.plot({"bf16": bf16, "bf16 + FP8": fp8}, {"bf16 + FP8": r}, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_fp8_prints_its_table(capsys):
    from benchmarks import fp8

    assert fp8.main(["--shapes", "tiny", "--device", "cpu", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "plumbing only" in out  # a CPU run says its times mean nothing
    row = next(line for line in out.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "32 x 64 x 48" and len(cells) == 12
    times = [float(c) for c in cells[3:]]
    assert all(t > 0 for t in times)
    for i in (3, 6, 9):  # each ratio is the bf16 time over the FP8 time of its row
        # The times print to 3 decimals (ms), the ratio to 2, of the unrounded times: the
        # ratio must lie within what the printed times allow.
        base, fp8_ms, ratio = times[i - 3], times[i - 2], times[i - 1]
        low = (base - 0.0005) / (fp8_ms + 0.0005) - 0.005
        high = (base + 0.0005) / max(fp8_ms - 0.0005, 1e-9) + 0.005
        assert low <= ratio <= high, (base, fp8_ms, ratio)
    assert fp8.SHAPES["4096"][2] == ("gate/up_proj", 8192, 4096, 14336)
