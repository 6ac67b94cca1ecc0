"""The collective benchmark end to end: spawned ranks, both backends, repeated sweeps."""

import re

import pytest

from benchmarks import collectives
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def test_sweep_prints_one_row_per_op_and_size(capsys):
    assert (
        collectives.main(
            [
                "--nprocs",
                "2",
                "--ops",
                "all_reduce,reduce_scatter_tensor,sendrecv,sparse_all_reduce",
                "--min-bytes",
                "1K",
                "--max-bytes",
                "4K",
                "--factor",
                "4",
                "--iters",
                "5",
                "--repeat",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    rows = [
        line.split("|")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("| all_reduce", "| reduce_scatter", "| sendrecv", "| sparse"))
    ]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("all_reduce", "1 KiB"),
        ("all_reduce", "4 KiB"),
        ("reduce_scatter_tensor", "1 KiB"),
        ("reduce_scatter_tensor", "4 KiB"),
        ("sendrecv", "1 KiB"),
        ("sendrecv", "4 KiB"),
        ("sparse_all_reduce", "1 KiB"),
        ("sparse_all_reduce", "4 KiB"),
    ]
    for r in rows:
        smddp_us, gloo_us = float(r[3]), float(r[7])
        # "median (low-high)" of the two sweeps' own ratios (Note [Paired speed-ups]).
        median, low, high = (float(x) for x in re.findall(r"([\d.]+)x", r[11]))
        assert smddp_us > 0 and gloo_us > 0
        assert low <= median <= high
        # Two sweeps: their mean, each of the three rounded (to 0.01 below 10x, else 0.1).
        assert median == pytest.approx((low + high) / 2, abs=0.11)
        # The ratio of the two medians is a weighted mean of the sweeps' ratios.
        assert low * 0.94 <= gloo_us / smddp_us <= high * 1.06  # from rounded times


def test_pool_operands_are_read_in_place(capfd):
    # --pool: smddp's operands come from its pool, as FSDP2's do, and every all_gather and
    # reduce_scatter reads its peers' inputs in place (the values are still checked).
    args = ["--nprocs", "2", "--ops", "all_gather_into_tensor,reduce_scatter_tensor"]
    args += ["--min-bytes", "256K", "--max-bytes", "256K", "--iters", "3", "--pool", "--quiet"]
    assert collectives.main(args) == 0
    out = capfd.readouterr().out
    calls = int(re.search(r"peers' operands in place in (\d+) calls", out).group(1))
    # Each op: the checked call, 3 warm-up calls and 3 timed ones.
    assert calls == 2 * 7, out
