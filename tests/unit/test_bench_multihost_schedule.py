"""The order of ``bench multihost``'s steps (Note [Each backend's sweep back to back]).

Each backend runs its whole sweep before the next, and each op's sizes follow untimed calls
at the largest size; a rank runs exactly these steps, so they are what the job measures."""

import pytest

from benchmarks import multihost
from benchmarks.multihost_rank import Step, schedule


def _spec(warmup: int, sizes=(1 << 20, 64 << 20, 16 << 20)) -> dict:
    return {
        "backends": ["smddp", "gloo"],
        "ops": ["all_reduce", "all_gather_into_tensor"],
        "sizes": list(sizes),
        "warmup_largest": warmup,
    }


def test_each_backend_sweeps_every_op_after_calls_at_the_largest_size():
    steps = list(schedule(_spec(5)))
    want = []
    for backend in ("smddp", "gloo"):
        for op in ("all_reduce", "all_gather_into_tensor"):
            want.append(Step(backend, op, 64 << 20, 5))  # the largest, wherever it is listed
            want += [Step(backend, op, size, 0) for size in (1 << 20, 64 << 20, 16 << 20)]
    assert steps == want


def test_no_warm_up_when_asked_for_none_or_when_nothing_is_timed():
    assert all(step.warmup_calls == 0 for step in schedule(_spec(0)))
    assert len(list(schedule(_spec(0)))) == 2 * 2 * 3
    assert list(schedule(_spec(5, sizes=()))) == []  # a job that only trains


def test_each_backend_sweeps_each_dtype_in_turn():
    spec = dict(_spec(2, sizes=(1 << 20,)), dtypes=["float32", "bfloat16"])
    steps = list(schedule(spec))
    assert [(s.backend, s.dtype) for s in steps[:4]] == [("smddp", "float32")] * 4
    assert [(s.backend, s.dtype) for s in steps[4:8]] == [("smddp", "bfloat16")] * 4
    assert {s.dtype for s in steps[8:12]} == {"float32"} and steps[8].backend == "gloo"
    assert all(s.dtype == "float32" for s in schedule(_spec(2)))  # the default


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--warmup-largest", "-1"], "--warmup-largest -1: counts of calls, 0 or more"),
        (["--warmup-largest", "5,x"], "--warmup-largest 5,x: counts of calls, 0 or more"),
        (["--switch-queue", "4K"], "--switch-queue 4K: at least one burst"),
        (["--dtypes", "float64"], "float64"),
    ],
)
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        multihost.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
