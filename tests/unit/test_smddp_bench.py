"""The benchmark dispatcher and the collective benchmark's pure helpers (no processes)."""

import pytest

from torch_sagemaker.bench import BENCHMARKS, collectives
from torch_sagemaker.bench import __main__ as bench_main


def test_dispatcher_lists_benchmarks_and_rejects_unknown(capsys):
    assert bench_main.main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHMARKS)
    assert bench_main.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_dispatcher_reports_a_missing_module(monkeypatch, capsys):
    monkeypatch.setitem(BENCHMARKS, "ghost", ("torch_sagemaker.bench.ghost_module", "x"))
    assert bench_main.main(["ghost"]) == 2
    assert "torch_sagemaker.bench.ghost_module is missing" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("8", 8), ("64K", 65536), ("1M", 1 << 20), ("256MB", 256 << 20),
                                         ("1g", 1 << 30)])
def test_parse_size(text, value):
    assert collectives.parse_size(text) == value


def test_busbw_factors_follow_nccl_tests():
    assert collectives._busbw_factor("all_reduce", 4) == 1.5
    assert collectives._busbw_factor("all_gather_into_tensor", 4) == 0.75
    assert collectives._busbw_factor("reduce_scatter_tensor", 2) == 0.5
    assert collectives._busbw_factor("broadcast", 8) == 1.0
    assert collectives._busbw_factor("all_to_all", 2) == 0.5


def test_table_has_ratio_column():
    row = {"op": "all_reduce", "size": 1024}
    for b, t in (("smddp", 10.0), ("gloo", 500.0)):
        row[b] = {"time_us": t, "algbw": 1.0, "busbw": 1.0, "bytes": 1024, "copy_pct": 5.0}
    table = collectives.format_table([row], {"cache": 4e10, "dram": 5e9}, ["smddp", "gloo"], 2)
    assert "| all_reduce | 1 KiB | 10.0 |" in table and "50.0x" in table
