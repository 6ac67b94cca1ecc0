"""hybrid_shard_degree=0 on two simulated hosts of 2 ranks (LOCAL_WORLD_SIZE=2, world 4).

SMP's rule (docs/config.md): with TP 1 the script's strategy decides (FULL_SHARD: every rank;
HYBRID_SHARD: one host, replicas across hosts); with TP > 1 the largest degree, world / tp.
FSDP1's actual shard and replica groups must be what ``tsm.state`` says: its
``hybrid_shard_degree``, the ranker's replication groups, ``rep_rank_process_group`` and the
shard group. SMP's scripts save sharded checkpoints from the ranks with
``ranker.get_rep_rank(rank) == 0`` over the FSDP process group; that must save one whole
checkpoint and load it back.
"""

import pytest

from tests.distributed.launcher import run_distributed

TWO_HOSTS = {"LOCAL_WORLD_SIZE": "2"}


def _groups_after_wrap(tp, strategy_name):
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": 0, "tensor_parallel_degree": tp})
    before = tsm.state.hybrid_shard_degree
    model = FSDP(
        torch.nn.Linear(8, 8),
        sharding_strategy=ShardingStrategy[strategy_name],
        device_id=torch.device("cpu"),
    )
    inter = getattr(model, "_inter_node_pg", None)
    ranks = dist.get_process_group_ranks
    rank = dist.get_rank()
    return dict(
        before=before,
        strategy=model.sharding_strategy.name,
        shard=ranks(model.process_group),
        replicas=ranks(inter) if inter is not None else [rank],
        degree=tsm.state.hybrid_shard_degree,
        state_shard=ranks(tsm.state.fsdp_shard_process_group),
        state_replicate=ranks(tsm.state.fsdp_replicate_process_group),
        rep_rank=tsm.state.ranker.get_rep_rank(rank),
        rep_groups=tsm.state.ranker.get_rep_groups(),
        rep_rank_group=ranks(tsm.state.rep_rank_process_group),
        dp=(tsm.state.dp_rank, tsm.state.dp_size),
    )


def _groups_for_cases(cases):
    return {case: _groups_after_wrap(*case) for case in cases}


def _check_consistent(out, rank, tp):
    """FSDP's groups are the state's, and the ranker's replicas are FSDP's."""
    assert out["shard"] == out["state_shard"], out
    assert len(out["shard"]) * tp == out["degree"] * tp == len(out["rep_rank_group"]), out
    assert out["replicas"] == out["state_replicate"], out
    assert out["replicas"] in out["rep_groups"], out
    assert out["rep_rank"] == out["replicas"].index(rank), out
    assert sorted(r for g in out["rep_groups"] for r in g) == [0, 1, 2, 3]
    assert out["dp"] == (rank // tp, 4 // tp)


@pytest.mark.distributed
def test_fsdp1_groups_match_the_state_with_degree_zero_on_two_hosts():
    """(TP 1) HYBRID_SHARD: one host per shard group, the state follows; FULL_SHARD: all
    ranks. (TP 2) the largest degree, world / tp = 2, not one host's single TP peer."""
    cases = [(1, "HYBRID_SHARD"), (1, "FULL_SHARD"), (2, "HYBRID_SHARD"), (2, "FULL_SHARD")]
    per_rank = run_distributed(_groups_for_cases, cases, world_size=4, timeout=300, env=TWO_HOSTS)
    for rank, outs in enumerate(per_rank):
        for (tp, _), out in outs.items():
            _check_consistent(out, rank, tp)
        hybrid = outs[(1, "HYBRID_SHARD")]
        host = rank - rank % 2
        assert hybrid["before"] == 4  # FULL_SHARD's view until the wrap settles it
        assert hybrid["strategy"] == "HYBRID_SHARD" and hybrid["degree"] == 2
        assert hybrid["shard"] == [host, host + 1]
        assert hybrid["replicas"] == [rank % 2, rank % 2 + 2]
        assert hybrid["rep_groups"] == [[0, 2], [1, 3]] and hybrid["rep_rank"] == rank // 2
        full = outs[(1, "FULL_SHARD")]
        assert full["degree"] == 4 and full["shard"] == [0, 1, 2, 3]
        assert full["rep_groups"] == [[0], [1], [2], [3]]
        for strategy in ("HYBRID_SHARD", "FULL_SHARD"):
            tp2 = outs[(2, strategy)]
            assert tp2["strategy"] == strategy
            assert tp2["degree"] == 2 and tp2["shard"] == [rank % 2, rank % 2 + 2], tp2
            assert tp2["rep_groups"] == [[0], [1], [2], [3]]


def _mixed_roots():
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": 0})
    cpu = torch.device("cpu")
    FSDP(torch.nn.Linear(4, 4), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=cpu)
    FSDP(torch.nn.Linear(4, 4), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=cpu)
    try:
        FSDP(torch.nn.Linear(4, 4), device_id=cpu)  # FULL_SHARD
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_a_second_root_with_the_other_kind_of_strategy_is_refused():
    per_rank = run_distributed(_mixed_roots, world_size=4, timeout=300, env=TWO_HOSTS)
    for message in per_rank:
        assert message is not None and "set hybrid_shard_degree explicitly" in message


def _save_and_load_the_scripts_way(path):
    import os

    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, StateDictType
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import save
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": 0})
    rank = dist.get_rank()

    def wrapped(seed):
        torch.manual_seed(seed)
        return FSDP(
            torch.nn.Linear(8, 8),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_id=torch.device("cpu"),
        )

    model = wrapped(0)
    pg = model.process_group
    coordinator = min(get_global_ranks(pg))
    action = tsm.state.ranker.get_rep_rank(rank) == 0
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        if action:
            save(state_dict, checkpoint_id=path, process_group=pg, coordinator_rank=coordinator)
    dist.barrier()
    files = sorted(os.listdir(path))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    other = wrapped(1)
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": other.state_dict()}
        load(
            state_dict,
            checkpoint_id=path,
            process_group=other.process_group,
            coordinator_rank=coordinator,
        )
        other.load_state_dict(state_dict["model"])
    with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
        got = other.state_dict()
    return dict(
        action=action,
        files=[f for f in files if f.endswith(".distcp")],
        same=all(torch.equal(expected[k], got[k]) for k in expected),
    )


@pytest.mark.distributed
def test_sharded_checkpoint_the_scripts_way_with_degree_zero_hybrid(tmp_path):
    """Action ranks (rep rank 0) are one host: one complete checkpoint, which loads back."""
    path = str(tmp_path / "ckpt")
    per_rank = run_distributed(
        _save_and_load_the_scripts_way, path, world_size=4, timeout=300, env=TWO_HOSTS
    )
    assert [out["action"] for out in per_rank] == [True, True, False, False]
    for out in per_rank:
        assert out["files"] == ["__0_0.distcp", "__1_0.distcp"], out
        assert out["same"], out
