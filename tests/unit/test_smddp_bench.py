"""The benchmark dispatcher and the collective benchmark's pure helpers (no processes)."""

import sys

import pytest
import torch

from benchmarks import BENCHMARKS, collectives
from benchmarks import __main__ as bench_main
from benchmarks import collectives_report as report


def test_dispatcher_lists_benchmarks_and_rejects_unknown(capsys):
    assert bench_main.main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHMARKS)
    assert bench_main.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_dispatcher_reports_a_missing_module(monkeypatch, capsys):
    monkeypatch.setitem(BENCHMARKS, "ghost", ("benchmarks.ghost_module", "x"))
    assert bench_main.main(["ghost"]) == 2
    assert "benchmarks.ghost_module is missing" in capsys.readouterr().err


def test_every_benchmark_prints_its_help(capsys):
    """Each registered module imports from the checkout and parses ``--help`` (the planner's
    validation is one: ``python -m benchmarks planner``)."""
    for name in BENCHMARKS:
        with pytest.raises(SystemExit) as e:
            bench_main.main([name, "--help"])
        assert e.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name


@pytest.mark.parametrize(
    "text, value",
    [("8", 8), ("64K", 65536), ("1M", 1 << 20), ("256MB", 256 << 20), ("1g", 1 << 30)],
)
def test_parse_size(text, value):
    assert collectives.parse_size(text) == value


def test_busbw_factors_follow_nccl_tests():
    assert report.busbw_factor("all_reduce", 4) == 1.5
    assert report.busbw_factor("all_gather_into_tensor", 4) == 0.75
    assert report.busbw_factor("reduce_scatter_tensor", 2) == 0.5
    assert report.busbw_factor("broadcast", 8) == 1.0
    assert report.busbw_factor("all_to_all", 2) == 0.5


def test_table_has_ratio_column():
    row = {"op": "all_reduce", "size": 1024}
    for b, t in (("smddp", 10.0), ("gloo", 500.0)):
        row[b] = _result(t)
    table = report.format_table([row], {"cache": 4e10, "dram": 5e9}, ["smddp", "gloo"], 2)
    assert "| all_reduce | 1 KiB | 10.0 |" in table and "50.0x" in table


def _result(t, sweeps=None):
    return {
        "sweeps_us": sweeps or [t],
        "time_us": t,
        "algbw": 1.0,
        "busbw": 1.0,
        "bytes": 1024,
        "copy_pct": 5.0,
    }


def test_speed_ups_pair_the_backends_within_each_sweep():
    # The third sweep was slow for smddp only. The ratio of the medians (10 / 5 = 2.0x)
    # would credit gloo's fast third sweep against smddp's other ones; within each sweep
    # gloo took 2x, 2x and 0.5x smddp's time.
    row = {
        "op": "all_reduce",
        "size": 1024,
        "smddp": _result(10.0, [1.0, 10.0, 10.0]),
        "gloo": _result(5.0, [2.0, 20.0, 5.0]),
    }
    table = report.format_table([row], {"cache": 4e10, "dram": 5e9}, ["smddp", "gloo"], 2)
    assert next(line for line in table.splitlines() if line.startswith("| all_reduce |")).endswith(
        "| 2.00x (0.50x-2.00x) |"
    )
    assert report.format_row(row, ["smddp", "gloo"]).endswith("2.00x (0.50x-2.00x)")


def test_table_has_one_ratio_column_per_extra_backend():
    ar = {
        "op": "all_reduce",
        "size": 1024,
        "smddp": _result(10.0),
        "gloo": _result(500.0),
        "deepspeed": _result(5.0),
    }
    bc = {
        "op": "broadcast",
        "size": 1024,
        "smddp": _result(8.0),
        "gloo": _result(80.0),
        "deepspeed": None,
    }
    table = report.format_table(
        [ar, bc], {"cache": 4e10, "dram": 5e9}, ["smddp", "gloo", "deepspeed"], 2
    )
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    assert header.endswith("| speed-up (smddp vs gloo) | speed-up (smddp vs deepspeed) |")
    ncols = header.count("|")
    ar_line = next(line for line in lines if line.startswith("| all_reduce |"))
    bc_line = next(line for line in lines if line.startswith("| broadcast |"))
    assert ar_line.count("|") == bc_line.count("|") == ncols
    assert ar_line.endswith("| 50.0x | 0.50x |")
    assert "| n/a |  |  |  | 10.0x | n/a |" in bc_line  # deepspeed does not run broadcast
    row = report.format_row(bc, ["smddp", "gloo", "deepspeed"])
    assert "n/a" in row and row.rstrip().endswith("n/a")


def test_ratio_base_puts_every_other_column_against_it():
    row = {
        "op": "all_reduce",
        "size": 1024,
        "smddp": _result(8.0),
        "smddp-direct": _result(2.0),
        "deepspeed": _result(4.0),
    }
    backends = ["smddp", "smddp-direct", "deepspeed"]
    table = report.format_table(
        [row], {"cache": 4e10, "dram": 5e9}, backends, 2, base="smddp-direct"
    )
    header = next(line for line in table.splitlines() if line.startswith("| op |"))
    assert header.endswith(
        "| speed-up (smddp-direct vs smddp) | speed-up (smddp-direct vs deepspeed) |"
    )
    assert next(line for line in table.splitlines() if line.startswith("| all_reduce |")).endswith(
        "| 4.00x | 2.00x |"
    )
    assert report.format_row(row, backends, "smddp-direct").split("|")[-2:] == [
        "    4.00x ",
        "    2.00x",
    ]


def test_two_backend_table_keeps_its_single_ratio_column():
    row = {"op": "all_reduce", "size": 1024, "smddp": _result(10.0), "gloo": _result(500.0)}
    table = report.format_table([row], {"cache": 4e10, "dram": 5e9}, ["smddp", "gloo"], 2)
    assert table.count("speed-up") == 1 and "| speed-up (smddp vs gloo) |" in table


def test_all_reduce_case_uses_a_peer_reduction():
    calls = []
    run, check, nbytes = collectives.make_case(
        "all_reduce", 1024, 1, 0, None, all_reduce=calls.append
    )
    assert check() and nbytes == 1024 and len(calls) == 1
    run()
    assert len(calls) == 2 and calls[0] is calls[1] and calls[0].numel() == 256


@pytest.mark.parametrize("op", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_cases_take_their_operands_from_the_given_allocator(op):
    made = []

    def empty(n):
        made.append(torch.empty(n))
        return made[-1]

    collectives.make_case(op, 4096, 2, 0, None, empty=empty)
    # Input and output, of the sizes nccl-tests means: S/n and S, or S and S/n.
    assert sorted(t.numel() for t in made) == [512, 1024]


def test_missing_deepspeed_names_the_install_command(monkeypatch):
    from tools import deepspeed_peer

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(ImportError, match="DS_ACCELERATOR=cpu pip install deepspeed"):
        deepspeed_peer.require()
    with pytest.raises(ImportError, match="DS_ACCELERATOR=cpu pip install deepspeed"):
        deepspeed_peer.ShmAllReduce(2, 0, lambda: None)
    # The benchmark stops before starting any process.
    monkeypatch.setattr(collectives, "_run", lambda args: pytest.fail("ranks were started"))
    with pytest.raises(SystemExit, match="DS_ACCELERATOR=cpu pip install deepspeed"):
        collectives.main(["--ops", "all_reduce", "--backends", "smddp,gloo,deepspeed"])


def test_deepspeed_cannot_be_the_first_backend(monkeypatch):
    monkeypatch.setattr(collectives, "_run", lambda args: pytest.fail("ranks were started"))
    with pytest.raises(SystemExit, match="cannot be first"):
        collectives.main(["--backends", "deepspeed,smddp"])


def test_unknown_ops_are_refused_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit):
        collectives.main(["--ops", "all_reduce,foo"])
    assert "unknown ['foo']; choose from all_reduce" in capsys.readouterr().err
