"""``bench training --accumulation``: replicas reduce on a step's last micro-batch only."""

from __future__ import annotations

import contextlib

import pytest

from benchmarks import training
from benchmarks.planner import validation


class _Fsdp2Like:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def set_requires_all_reduce(self, value: bool) -> None:
        self.calls.append(value)


class _DdpLike:
    def __init__(self) -> None:
        self.skipped = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.skipped += 1
        yield


def test_fsdp2_all_reduces_and_ddp_syncs_on_the_last_micro_batch_only():
    fsdp2, ddp = _Fsdp2Like(), _DdpLike()
    for last in (False, False, True):
        with training._replicas_reduced(fsdp2, last), training._replicas_reduced(ddp, last):
            pass
    assert fsdp2.calls == [False, False, True]
    assert ddp.skipped == 2


def test_an_accumulation_that_does_not_divide_the_batch_is_refused(capsys):
    with pytest.raises(SystemExit, match="--accumulation 3 does not divide --batch 4"):
        training.main(["--batch", "4", "--accumulation", "3"])
    args = validation.build_parser().parse_args(["time", "--batch", "4", "--accumulation", "3"])
    assert validation.validate_time(args) == 2
    assert "--accumulation 3 does not divide --batch 4" in capsys.readouterr().err
