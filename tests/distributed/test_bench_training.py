"""The training benchmark end to end on a tiny Llama (spawned ranks, smddp and gloo)."""

import contextlib
import io

import pytest

from benchmarks import training

pytestmark = pytest.mark.distributed

TINY = ["--steps", "1", "--warmup", "0", "--hidden", "32", "--layers", "1", "--vocab", "64"]
TINY += ["--seq", "16"]


@pytest.fixture(scope="module")
def two_passes():
    """One run of ``main`` with two passes over both backends and three modes.

    The first pass spawns its ranks (1 rank, 2 ranks alone, then 2 ranks per backend), so
    one run serves both tests: the printed table is the two passes' (medians and ranges), and
    the first pass, kept as ``main`` handed it to the table, gives the table that a run with
    ``--repeat 1`` prints (``main`` prints ``_table`` of its passes, whatever their number).

    The second pass is the first one's rows with each row's step times scaled by a factor of
    its own (``_second_pass``), not a second real run: a real one runs the same code as the
    first (seven more spawned interpreters, each importing torch and transformers, about
    half of this module's time), and the ranges it gives are the machine's noise, which may
    even be empty. The scaled pass gives every ratio a range of known, non-zero width.
    """
    passes, seen_args = [], []
    real_run = training._run

    def recording_run(args):
        seen_args.append(args)
        passes.append(real_run(args) if not passes else _second_pass(passes[0]))
        return passes[-1]

    out = io.StringIO()
    argv = ["--nprocs", "2", "--backends", "smddp,gloo", "--modes", "fsdp2_plain,ddp,fsdp1"]
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(training, "_run", recording_run)
        training.main([*argv, "--repeat", "2", *TINY])
    assert len(passes) == 2 and seen_args[0] is seen_args[1]
    one_pass, _ = training._table(passes[:1], seen_args[0])
    return one_pass, out.getvalue()


def _second_pass(rows):
    """``rows`` (``training._run``'s) with row i's step times scaled by 1.1 + 0.1 * i."""
    return [
        (backend, mode, [tuple(t * (1.1 + 0.1 * i) for t in step) for step in steps])
        for i, (backend, mode, steps) in enumerate(rows)
    ]


def _rows(text):
    return [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")][1:]


def test_benchmark_prints_every_row_with_its_baselines(two_passes):
    out, _ = two_passes
    rows = _rows(out)
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("none", "1 rank"),
        ("none", "2 ranks alone"),
        ("smddp", "fsdp2_plain"),
        ("smddp", "ddp"),
        ("smddp", "fsdp1"),
        ("gloo", "fsdp2_plain"),
        ("gloo", "ddp"),
        ("gloo", "fsdp1"),
    ]
    assert "passes" not in out  # one pass: plain medians, no ranges
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)  # tokens/s, step ms
    assert rows[1][9].strip() and not rows[1][10].strip()  # alone: scaling, no "vs alone"
    for r in rows[2:]:
        assert float(r[9]) > 0 and float(r[10]) > 0  # vs 2 x 1 rank, vs 2 alone
    assert all(r[8].strip().endswith("x") for r in rows[2:5])  # smddp vs gloo


def test_repeated_passes_print_each_ratio_with_its_range(two_passes):
    _, out = two_passes
    assert "2 passes: medians over the passes" in out
    rows = _rows(out)
    modes = ["fsdp2_plain", "ddp", "fsdp1"]
    assert [r[1].strip() for r in rows] == ["1 rank", "2 ranks alone", *modes, *modes]
    smddp = rows[2]
    for cell in (smddp[8].replace("x", ""), smddp[9], smddp[10]):  # vs gloo, scaling, vs alone
        median, spread = cell.strip().split(" (")
        low, high = (float(v) for v in spread.rstrip(")").split("-"))
        assert low <= float(median) <= high, cell
        # _second_pass moves each of these ratios by at least 1 - 1.2/1.3 (7.7%, "vs alone":
        # rows 1 and 2). Two decimals show that only where it is 0.01 or more, from 0.13 up:
        # a loaded machine printed a scaling of 0.10 and of 0.02 in both passes.
        assert low < high or (1 - 1.2 / 1.3) * high < 0.01, cell
