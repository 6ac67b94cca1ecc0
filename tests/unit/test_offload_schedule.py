"""The pure prefetch policy, driven with plain integers (no tensors)."""

from __future__ import annotations

import pytest

from torch_sagemaker.offload.schedule import PrefetchSchedule, UnitState


def make(num_units: int, horizon: int, end_signal: bool = True) -> PrefetchSchedule:
    schedule = PrefetchSchedule(horizon)
    for expected in range(num_units):
        assert schedule.add_unit(has_end_signal=end_signal) == expected
    return schedule


def resident(schedule: PrefetchSchedule) -> set[int]:
    return {
        u
        for u in range(schedule.num_units)
        if schedule.state(u) in (UnitState.REQUESTED, UnitState.ACTIVE)
    }


def run_backward(schedule: PrefetchSchedule, order: list[int]) -> list[tuple]:
    """Replays a backward pass in ``order``; returns the event log and checks residency."""
    events: list[tuple] = []
    requested: set[int] = set(schedule.on_forward_end())
    events += [("fetch", u) for u in sorted(requested, reverse=True)]
    for unit in order:
        decision = schedule.on_backward_start(unit)
        events.append(("start", unit, decision.demand))
        events += [("release", u) for u in decision.release]
        events += [("fetch", u) for u in decision.fetch]
        assert len(resident(schedule)) <= schedule.horizon + 1, resident(schedule)
        events += [("release", u) for u in schedule.on_backward_end(unit)]
    events += [("release", u) for u in schedule.on_backward_finished()]
    return events


@pytest.mark.parametrize("horizon", [1, 2, 3, 6])
def test_every_unit_is_requested_before_its_backward_and_residency_is_bounded(horizon):
    n = 6
    schedule = make(n, horizon)
    events = run_backward(schedule, list(reversed(range(n))))
    for unit in range(n):
        fetched = events.index(("fetch", unit))
        started = events.index(("start", unit, False))  # False: not a demand fetch
        released = events.index(("release", unit))
        assert fetched < started < released, (unit, events)
    assert resident(schedule) == set()
    assert all(schedule.state(u) is UnitState.IDLE for u in range(n))


def test_forward_end_requests_the_last_horizon_units():
    assert make(5, 2).on_forward_end() == (4, 3)
    assert make(3, 8).on_forward_end() == (2, 1, 0)


def test_start_tops_up_the_window_and_reports_lead():
    schedule = make(5, 2)
    schedule.on_forward_end()
    decision = schedule.on_backward_start(4)
    assert decision.fetch == (2,) and not decision.demand and decision.lead == 2
    schedule.on_backward_end(4)
    decision = schedule.on_backward_start(3)
    assert decision.fetch == (1,) and decision.lead == 2
    schedule.on_backward_end(3)
    schedule.on_backward_start(2)
    schedule.on_backward_end(2)
    assert schedule.on_backward_start(1).lead == 1  # only unit 0 is left ahead


def test_horizon_zero_fetches_on_demand():
    schedule = make(3, 0)
    assert schedule.on_forward_end() == ()
    decision = schedule.on_backward_start(2)
    assert decision.demand and decision.fetch == (2,) and decision.lead == 0


def test_out_of_order_start_is_a_demand_fetch():
    schedule = make(6, 1)
    schedule.on_forward_end()  # requests 5
    decision = schedule.on_backward_start(2)
    assert decision.demand and decision.fetch == (2, 1)
    assert schedule.state(5) is UnitState.REQUESTED


def test_repeated_unpack_of_an_active_unit_is_not_a_new_start():
    schedule = make(3, 1)
    schedule.on_forward_end()
    assert schedule.on_backward_start(2).new_start
    assert schedule.on_backward_start(2) == type(schedule.on_backward_start(2))()


def test_units_without_end_signal_are_released_by_the_next_start_or_the_finish():
    schedule = make(3, 1, end_signal=False)
    schedule.on_forward_end()
    schedule.on_backward_start(2)
    assert schedule.on_backward_end(2) == (2,)  # an explicit end still works
    schedule = make(3, 1, end_signal=False)
    schedule.on_forward_end()
    schedule.on_backward_start(2)
    assert schedule.on_backward_start(1).release == (2,)
    assert schedule.on_backward_finished() == (1,)


def test_new_forward_evicts_requested_units():
    schedule = make(4, 2)
    schedule.on_forward_end()
    assert schedule.on_new_forward() == (2, 3)
    assert resident(schedule) == set()
    assert schedule.on_backward_start(3).demand


def test_retained_graph_second_backward_fetches_again():
    schedule = make(3, 1)
    first = run_backward(schedule, [2, 1, 0])
    assert ("start", 2, False) in first
    decision = schedule.on_backward_start(2)  # second backward over the same pass
    assert decision.demand and decision.fetch == (2, 1)


def test_negative_horizon_is_rejected_with_the_rule():
    with pytest.raises(ValueError, match="horizon=-1.*>= 0"):
        PrefetchSchedule(-1)
