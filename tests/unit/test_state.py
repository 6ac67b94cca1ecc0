"""tsm.state before init: defaults, overrides recorded by assignment, clear errors."""

import pytest
import torch.sagemaker as tsm

from torch_sagemaker.state import State


def test_before_init_reads_defaults_and_records_overrides():
    s = State()
    assert not s.initialized
    assert s.tensor_parallel_degree == 1 and s.activation_loading_horizon == 2
    s.tensor_parallel_degree = 1
    s.cp_size = 1  # SMP alias maps to context_parallel_degree
    s.hybrid_shard_degree = 2
    assert s.overrides == {
        "tensor_parallel_degree": 1,
        "context_parallel_degree": 1,
        "hybrid_shard_degree": 2,
    }
    assert s.hybrid_shard_degree == 2
    s.reset()
    assert s.overrides == {}


def test_unknown_attribute_assignment_is_refused():
    with pytest.raises(AttributeError, match="not a config parameter"):
        State().tensor_paralel_degree = 2


@pytest.mark.parametrize(
    "name",
    [
        "rank",
        "world_size",
        "tp_rank",
        "dp_size",
        "device_mesh",
        "tp_process_group",
        "ranker",
        "fsdp_mesh",
    ],
)
def test_topology_needs_init(name):
    with pytest.raises(RuntimeError, match=rf"tsm.state.{name} is only available after"):
        getattr(State(), name)


def test_public_surface():
    assert tsm.state is __import__("torch_sagemaker").state
    assert not tsm.is_initialized()
    for name in (
        "init",
        "is_initialized",
        "state",
        "transform",
        "offload_wrapper",
        "SMPConfig",
        "__version__",
    ):
        assert hasattr(tsm, name), name


def test_ranker_replication_groups_hold_identical_shards():
    from torch_sagemaker.state import Ranker
    from torch_sagemaker.topology import resolve

    # 8 ranks, tp 2, hybrid_shard_degree 2: replicas (r, r + 4).
    plain = Ranker(resolve(8, hybrid_shard_degree=2, tensor_parallel_degree=2))
    assert plain.get_rep_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [plain.get_rep_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # 8 ranks, ep 2, hybrid_shard_degree 2 (SMP's Mixtral layout scaled down): the four
    # replicas alternate EP ranks, so only every other replica holds the same experts.
    moe = resolve(8, hybrid_shard_degree=2, expert_parallel_degree=2)
    ranker = Ranker(moe)
    assert ranker.get_rep_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [moe.ep_rank(r) for r in (0, 4)] == [0, 0] and moe.ep_rank(2) == 1
    assert [ranker.get_rep_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Every EP rank has action ranks (rep rank 0), so per-EP-rank checkpoints are complete.
    assert {moe.ep_rank(r) for r in range(8) if ranker.get_rep_rank(r) == 0} == {0, 1}
    # ep 2 on 4 ranks with hybrid_shard_degree 2: no two ranks hold the same experts twice.
    small = Ranker(resolve(4, hybrid_shard_degree=2, expert_parallel_degree=2))
    assert small.get_rep_groups() == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "text", ["x", "-1", "1.5", "", "1_000", "+4", "\u0664", "4294967296", "1" * 5000]
)
def test_launcher_variables_that_are_not_integers_are_named(text):
    from torch_sagemaker.state import _launcher_int

    with pytest.raises(ValueError, match=r"LOCAL_RANK=.*non-negative integer"):
        _launcher_int("LOCAL_RANK", text, 0)
    assert _launcher_int("LOCAL_RANK", None, 3) == 3
    assert _launcher_int("LOCAL_RANK", " 2 ", 3) == 2


def test_unknown_log_level_is_named(monkeypatch):
    from torch_sagemaker.logger import _level_from_env

    monkeypatch.setenv("TSM_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="TSM_LOG_LEVEL='LOUD'.*DEBUG, INFO"):
        _level_from_env()
    monkeypatch.setenv("TSM_LOG_LEVEL", "warning")
    assert _level_from_env() == "WARNING"


def test_zero_ranks_per_host_is_refused(monkeypatch):
    # LOCAL_WORLD_SIZE=0 used to pass tsm.init and divide by zero in tsm.state.local_rank.
    from torch_sagemaker.state import ranks_per_host

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='0'.*positive integer"):
        ranks_per_host(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_host(4) == 2
