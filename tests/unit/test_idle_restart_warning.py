"""Note [Slow start after idle]: the first group that crosses hosts says once, on the first
rank of each host, when that host's TCP restarts its windows after idle gaps."""

import warnings

import pytest

from torch_sagemaker.smddp import backend


class _Group:
    """What _warn_if_idle_restarts reads of a created backend."""

    def __init__(self, members: list[list[int]], rank: int) -> None:
        self._members = members
        self._rank = rank

    def _layout(self) -> dict:
        host = next(h for h, m in enumerate(self._members) if self._rank in m)
        local_rank = self._members[host].index(self._rank)
        return {"hosts": len(self._members), "host": host, "local_rank": local_rank}


def _warned(group: _Group, path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend._warn_if_idle_restarts(group, str(path))
    return [str(w.message) for w in caught]


@pytest.fixture
def sysctl(tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "_IDLE_WARNED", False)
    path = tmp_path / "tcp_slow_start_after_idle"
    path.write_text("1\n")
    return path


def test_the_first_rank_of_a_host_warns_once_naming_the_setting_and_the_fix(sysctl):
    group = _Group([[0, 1], [2, 3]], 2)
    (message,) = _warned(group, sysctl)
    assert "net.ipv4.tcp_slow_start_after_idle is 1 on this host" in message
    assert "sysctl -w net.ipv4.tcp_slow_start_after_idle=0" in message
    assert _warned(group, sysctl) == []  # once per process


@pytest.mark.parametrize(
    ("members", "rank", "value"),
    [
        ([[0, 1], [2, 3]], 3, "1"),  # not the first rank of its host
        ([[0, 1, 2, 3]], 0, "1"),  # one host: nothing crosses hosts
        ([[0, 1], [2, 3]], 0, "0"),  # the host already keeps its windows
    ],
    ids=["second_rank", "one_host", "set_to_0"],
)
def test_nothing_is_said_where_it_does_not_apply(sysctl, members, rank, value):
    sysctl.write_text(value + "\n")
    assert _warned(_Group(members, rank), sysctl) == []


def test_subgroups_after_the_first_group_across_hosts_add_nothing(sysctl):
    # Rank 1 is not the first of its host in the default group, but is in a data-parallel
    # group of one rank per host created after it: still one warning per host.
    assert _warned(_Group([[0, 1], [2, 3]], 1), sysctl) == []
    assert _warned(_Group([[1], [3]], 1), sysctl) == []


def test_groups_inside_one_host_leave_the_decision_to_one_that_crosses_hosts(sysctl):
    assert _warned(_Group([[0, 1]], 0), sysctl) == []
    assert len(_warned(_Group([[0, 1], [2, 3]], 0), sysctl)) == 1


def test_a_host_without_the_setting_is_not_warned_about(sysctl, tmp_path):
    assert _warned(_Group([[0], [1]], 0), tmp_path / "absent") == []
