"""The order of ``bench multihost``'s steps (Note [Each backend's sweep back to back]).

Each backend runs its whole sweep before the next, and each op's sizes follow untimed calls
at the largest size; a rank runs exactly these steps, so they are what the job measures."""

import pytest

from torch_sagemaker.bench import multihost
from torch_sagemaker.bench.multihost_rank import Step, schedule


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


def test_a_negative_warm_up_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        multihost.main(["--warmup-largest", "-1"])
    assert exit_info.value.code == 2
    assert "--warmup-largest -1: a count of calls, 0 or more" in capsys.readouterr().err
