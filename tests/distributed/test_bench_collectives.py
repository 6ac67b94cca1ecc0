"""The collective benchmark end to end: spawned ranks, both backends, repeated sweeps."""

import pytest

from torch_sagemaker.bench import collectives
from torch_sagemaker.distributed import backend

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
                "all_reduce,reduce_scatter_tensor,sendrecv",
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
        if line.startswith(("| all_reduce", "| reduce_scatter", "| sendrecv"))
    ]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("all_reduce", "1 KiB"),
        ("all_reduce", "4 KiB"),
        ("reduce_scatter_tensor", "1 KiB"),
        ("reduce_scatter_tensor", "4 KiB"),
        ("sendrecv", "1 KiB"),
        ("sendrecv", "4 KiB"),
    ]
    for r in rows:
        smddp_us, gloo_us, ratio = float(r[3]), float(r[7]), float(r[11].strip().rstrip("x"))
        assert smddp_us > 0 and gloo_us > 0
        assert ratio == pytest.approx(gloo_us / smddp_us, rel=0.06)  # from rounded times
