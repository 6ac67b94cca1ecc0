"""The FP8 tools without their long runs: scripts/fp8_loss_curve.py (``make fp8-curve``: its
command lines, the comparison it judges the runs by, the plot), scripts/fp8_diagnostics.py
(the quantization statistics and their table) and ``bench fp8`` on a tiny shape on CPU (the
table ``make gpu-check`` prints on the GPU)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str = "fp8_loss_curve"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
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
    many = {"bf16": bf16, "fp32": bf16, "a": fp8, "b": fp8}  # the legend goes under the plots
    s.plot(many, {n: r for n in ("fp32", "a", "b")}, tmp_path / "m.png", "t")
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_quantization_stats_count_what_the_cast_does(tmp_path):
    import json

    import torch

    d = _script("fp8_diagnostics")
    e4m3 = torch.float8_e4m3fn
    t = torch.tensor([1.0, -0.5, 2.0**-20, 0.0])
    # Scale 112 maps the amax 1 to 112 = 448 / 4: two binades unused; 1 and -0.5 are exact in
    # e4m3 at both scales, 2**-20 flushes to 0 at both (below half the smallest subnormal).
    s = d.quantization_stats(t, torch.tensor(112.0), e4m3)
    assert s["headroom"] == pytest.approx(2.0) and s["amax"] == 1.0 and s["saturated"] == 0
    assert s["flushed"] == pytest.approx(1 / 3) and s["subnormal"] == pytest.approx(1 / 3)
    assert s["flushed_current"] == pytest.approx(1 / 3)
    assert s["rel_err"] == pytest.approx(2.0**-20 / 1.25**0.5)
    # At scale 1, 2**-8 is an e4m3 subnormal (below 2**-6), exact: subnormal, not flushed.
    s = d.quantization_stats(torch.tensor([1.0, 2.0**-8]), torch.tensor(1.0), e4m3)
    assert s["subnormal"] == 0.5 and s["flushed"] == 0 and s["rel_err"] == 0
    # Scale 1000 saturates the 1 (to 448 / 1000) and the -0.5 (to -0.448): 2 of 4 elements.
    s = d.quantization_stats(t, torch.tensor(1000.0), e4m3)
    assert s["saturated"] == 0.5 and s["headroom"] == pytest.approx(math.log2(448 / 1000))
    assert s["rel_err"] > 0.1 and s["rel_err_current"] < 1e-6
    rows = [
        dict(step=k, layer=name, role=role, **s)
        for k in (1, 5)
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj")
        for role in d.ROLE_NAMES
    ]
    table = d.summarize(rows, windows=((1, 1), (2, 10)))
    assert table.count("\n") == 2 + 3 * 2 * 2 - 1
    assert "| dy | mlp | 2-10 | -1.16 | 50.000% |" in table
    assert d._wants("model.layers.1.self_attn.o_proj", "attention")
    assert not d._wants("model.layers.1.mlp.down_proj", "attention")
    assert d._wants("model.layers.1.mlp.down_proj", "mlp")
    for name, losses in (("a", [4.0] * 30), ("b", [4.0] * 25 + [4.4] * 5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"summary": {"losses": losses}}))
    table = d.compare_variants(tmp_path / "a", [f"noisy={tmp_path / 'b'}"], None, (4.0, 3.0))
    # Both runs are at 4.0 from step 1 (shift +0); neither reaches 3.0.
    assert table.splitlines()[-1] == "| noisy | 5.00% | 30 | 2.50% | +0 / - |"
    assert d.first_below([5.0, 3.0, 3.0], 4.0) == 2 and d.first_below([5.0], 4.0) is None


def test_bench_fp8_prints_its_table(capsys):
    from benchmarks import fp8

    argv = ["--shapes", "tiny", "--device", "cpu", "--iters", "1", "--warmup", "0"]
    assert fp8.main([*argv, "--no-compile"]) == 0  # compiling takes 20 s here
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
    # The quantization table: each tensor the layer quantizes once, against its floors.
    bandwidth = float(out.split("copy bandwidth ")[1].split(" GB/s")[0]) * 1e9
    rows = [line for line in out.splitlines() if line.startswith("| tiny | ")][1:]
    tensors = {"x [32 x 64]": 2048, "w tiny": 3072, "dy [32 x 48]": 1536}
    assert [r.split("|")[2].strip() for r in rows] == list(tensors)
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        elements = tensors[cells[1]]
        assert cells[2] == f"{elements:,}" and float(cells[3]) > 0 and cells[6:8] == ["-", "-"]
        floor = fp8.EAGER_BYTES * elements / bandwidth * 1e3
        assert abs(float(cells[4]) - floor) <= 0.0005 + 0.01 * floor, (cells, floor)
