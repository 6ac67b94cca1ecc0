"""The training benchmark end to end on a tiny Llama (spawned ranks, smddp and gloo)."""

import pytest

from torch_sagemaker.bench import training

pytestmark = pytest.mark.distributed


def test_benchmark_prints_every_row_with_its_baselines(capsys):
    training.main(
        [
            "--nprocs",
            "2",
            "--backends",
            "smddp,gloo",
            "--modes",
            "fsdp2_plain,ddp",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--vocab",
            "64",
            "--seq",
            "16",
        ]
    )
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("none", "1 rank"),
        ("none", "2 ranks alone"),
        ("smddp", "fsdp2_plain"),
        ("smddp", "ddp"),
        ("gloo", "fsdp2_plain"),
        ("gloo", "ddp"),
    ]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)  # tokens/s, step ms
    assert rows[1][9].strip() and not rows[1][10].strip()  # alone: scaling, no "vs alone"
    for r in rows[2:]:
        assert float(r[9]) > 0 and float(r[10]) > 0  # vs 2 x 1 rank, vs 2 alone
    assert all(r[8].strip().endswith("x") for r in rows[2:4])  # smddp vs gloo


def test_repeated_passes_print_each_ratio_with_its_range(capsys):
    tiny = ["--steps", "1", "--warmup", "0", "--hidden", "32", "--layers", "1"]
    training.main(
        ["--nprocs", "2", "--modes", "fsdp2_plain", "--repeat", "2", "--vocab", "64"]
        + ["--seq", "16", *tiny]
    )
    out = capsys.readouterr().out
    assert "2 passes: medians over the passes" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    assert [r[1].strip() for r in rows] == ["1 rank", "2 ranks alone"] + ["fsdp2_plain"] * 2
    smddp = rows[2]
    for cell in (smddp[8].replace("x", ""), smddp[9], smddp[10]):  # vs gloo, scaling, vs alone
        median, spread = cell.strip().split(" (")
        low, high = (float(v) for v in spread.rstrip(")").split("-"))
        assert low <= float(median) <= high, cell
