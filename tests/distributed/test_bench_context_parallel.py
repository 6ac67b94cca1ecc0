"""The context parallel benchmark end to end on a tiny model (spawned ranks, gloo)."""

import pytest

from benchmarks import context_parallel

pytestmark = pytest.mark.distributed


def test_benchmark_prints_every_configuration(capsys):
    assert (
        context_parallel.main(
            [
                "--seqs",
                "64",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--layers",
                "1",
                "--hidden",
                "32",
                "--heads",
                "4",
                "--vocab",
                "64",
                "--backend",
                "gloo",
                "--attention-reps",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "PyTorch experimental context_parallel:" in out
    rows = [
        line.split("|")
        for line in out.splitlines()
        if line.startswith("| 64 |") and line.split("|")[2].strip() not in ("p2p", "all_gather")
    ]
    assert [r[2].strip() for r in rows] == ["no CP", "cp2 p2p", "cp2 all_gather"]
    for r in rows[1:]:
        # Each rank holds half of a sequence: fewer saved activations than a whole one.
        assert 0.3 < float(r[7]) < 0.9, r
        assert r[9].strip() and r[11].strip().endswith("%"), r
    attention = [
        line.split("|")
        for line in out.splitlines()
        if line.startswith("| 64 | ") and line.split("|")[2].strip() in ("p2p", "all_gather")
    ]
    assert [r[2].strip() for r in attention] == ["p2p", "all_gather"]
    assert all(
        float(r[3]) > 0 and float(r[4]) > 0 and r[7].strip().endswith("%") for r in attention
    )
