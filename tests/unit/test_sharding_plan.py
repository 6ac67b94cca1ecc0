"""The sharding plan for every valid layout and host size, without processes.

Each placement names a mesh; ``ShardingPlan.mesh_ranks`` gives its ranks by arithmetic, and
these tests check what FSDP relies on: dense parameters are sharded over exactly the ranks
with this rank's TP coordinate, experts over exactly the ranks holding the same experts,
FSDP1 and FSDP2 agree, and the strategy matches the mesh's shape.
"""

import functools
import itertools

import pytest
from torch.distributed.fsdp import ShardingStrategy

from tests.unit.test_topology import LAYOUTS
from torch_sagemaker._torch_compat.fsdp1 import HYBRID_SHARD_ZERO2
from torch_sagemaker.config import ConfigError, validate
from torch_sagemaker.sharding_plan import MESHES, STRATEGIES, combination_problems, resolve
from torch_sagemaker.state import Ranker
from torch_sagemaker.topology import Layout
from torch_sagemaker.topology import resolve as resolve_layout

HYBRID = (ShardingStrategy.HYBRID_SHARD, HYBRID_SHARD_ZERO2)


def _layout(world, hsd, tp, cp, ep) -> Layout:
    return resolve_layout(
        world,
        hybrid_shard_degree=hsd,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
        expert_parallel_degree=ep,
    )


def _hosts(world):
    """Ranks per host: one host, two hosts, and one rank per host."""
    return sorted({world, max(1, world // 2), 1})


PLANS = [
    (*case, per_host)
    for case in LAYOUTS
    if not (case[3] > 1 and case[4] > 1)  # EP x CP is refused (test below)
    for per_host in _hosts(case[0])
]


@functools.cache
def _plan(world, hsd, tp, cp, ep, per_host):
    return resolve(_layout(world, hsd, tp, cp, ep), per_host)


@functools.cache
def _covered(plan_key, mesh, rank):
    """Every rank of ``rank``'s part of ``mesh``: the product of its dimensions."""
    plan = _plan(*plan_key)
    dims = plan.mesh_ranks(mesh, rank)
    if len(dims) == 1:
        return set(dims[0])
    replicas, shard = dims
    covered = {r for outer in replicas for r in plan.mesh_ranks(mesh, outer)[1]}
    assert shard == plan.mesh_ranks(mesh, rank)[1] and len(covered) == len(replicas) * len(shard)
    return covered


def _shard_group(plan, strategy, mesh, rank):
    """The ranks FSDP splits each parameter over (one rank under NO_SHARD)."""
    if strategy is ShardingStrategy.NO_SHARD:
        return [rank]
    return plan.mesh_ranks(mesh, rank)[-1]


def test_many_plans_are_covered():
    assert len(PLANS) > 200


@pytest.mark.parametrize("world,hsd,tp,cp,ep,per_host", PLANS)
def test_plan_invariants(world, hsd, tp, cp, ep, per_host):
    key = (world, hsd, tp, cp, ep, per_host)
    plan = _plan(*key)
    layout = plan.layout
    assert set(plan.meshes) <= set(MESHES)
    _check_host_plan(plan)
    same_experts = {r: g for g in layout.expert_dp_groups() for r in g}
    for mesh in plan.meshes:
        for dim in MESHES[mesh]:
            groups = {tuple(plan.dim_ranks(dim, r)) for r in range(world)}
            assert sorted(r for g in groups for r in g) == list(range(world)), (mesh, dim)
    for rank in range(world):
        tp_rank = layout.coordinates(rank)["tp"]
        same_tp = {r for r in range(world) if layout.coordinates(r)["tp"] == tp_rank}
        for asked in STRATEGIES:
            dense = plan.fsdp1(asked)
            experts = plan.fsdp1(asked, experts=True)
            for placement in (dense, experts):
                # HYBRID strategies take (replicate, shard) meshes; the others one dimension.
                assert (placement.strategy in HYBRID) == (len(MESHES[placement.mesh]) == 2)
            # Dense parameters: every rank with this TP coordinate, never two TP ranks.
            assert _covered(key, dense.mesh, rank) == same_tp, asked
            # Experts: exactly the ranks that hold the same experts.
            assert _covered(key, experts.mesh, rank) == set(same_experts[rank]), asked
            # Auto-wrapped children ask for the root's resolved strategy and must get the same.
            assert plan.fsdp1(dense.strategy) == dense
            assert plan.fsdp1(dense.strategy, experts=True) == experts
        # FSDP2 shards like FSDP1's default (FULL_SHARD), over the same ranks.
        default, default_experts = plan.fsdp1(None), plan.fsdp1(None, experts=True)
        assert default == plan.fsdp1(ShardingStrategy.FULL_SHARD)
        assert _covered(key, plan.fsdp2_dense, rank) == same_tp
        assert plan.mesh_ranks(plan.fsdp2_dense, rank)[-1] == _shard_group(
            plan, default.strategy, default.mesh, rank
        )
        assert _covered(key, plan.fsdp2_experts, rank) == set(same_experts[rank])
        assert plan.mesh_ranks(plan.fsdp2_experts, rank)[-1] == _shard_group(
            plan, default_experts.strategy, default_experts.mesh, rank
        )


def test_degree_one_replicates_and_degree_k_shards_over_k():
    plan = resolve(_layout(8, 1, 2, 1, 1), 8)
    assert plan.fsdp1(ShardingStrategy.FULL_SHARD).strategy is ShardingStrategy.NO_SHARD
    assert plan.mesh_ranks("replicate_mesh", 0) == [[0, 2, 4, 6]]
    plan = resolve(_layout(8, 2, 2, 1, 1), 8)
    for asked in (None, ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        placement = plan.fsdp1(asked)
        assert (placement.strategy, placement.mesh) == (ShardingStrategy.HYBRID_SHARD, "fsdp_mesh")
    assert plan.fsdp1(HYBRID_SHARD_ZERO2).strategy is HYBRID_SHARD_ZERO2
    assert plan.mesh_ranks("fsdp_mesh", 1) == [[1, 5], [1, 3]]  # (replicate, shard)
    assert plan.fsdp2_dense == "fsdp_mesh"


def _check_host_plan(plan):
    """The one-host plan of degree 0 (Note [Degree 0 with a hybrid strategy]), where there is one.

    It exists with degree 0, TP 1, no EP, on several hosts whose ranks hold whole CP groups;
    its hybrid placement shards over exactly one host's ranks and replicates across hosts, and
    its ranker says so; the data-parallel and context parallel ranks stay those of ``plan``.
    """
    layout, host = plan.layout, plan.host_plan
    per_host = plan.ranks_per_host
    world = layout.world_size
    applies = (
        layout.requested_hybrid_shard_degree == 0
        and layout.tp == 1
        and layout.ep == 1
        and per_host < world
        and world % per_host == 0
        and per_host % layout.cp == 0
    )
    assert (host is not None) == applies
    if host is None:
        return
    assert host.host_plan is None
    assert host.layout.hybrid_shard_degree == per_host
    assert host.layout.groups(("dp_shard", "cp")) == [
        list(range(first, first + per_host)) for first in range(0, world, per_host)
    ]
    assert host.layout.groups("cp") == layout.groups("cp")
    ranker = Ranker(host.layout)
    for rank in range(world):
        assert host.layout.dp_rank(rank) == layout.dp_rank(rank)
        for asked in HYBRID:
            placement = host.fsdp1(asked)
            assert (placement.strategy, placement.mesh) == (asked, "fsdp_mesh")
            replicas, shard = host.mesh_ranks("fsdp_mesh", rank)
            assert shard == [r for r in range(world) if r // per_host == rank // per_host]
            assert replicas == [r for r in range(world) if r % per_host == rank % per_host]
            assert ranker.get_rep_rank(rank) == rank // per_host
            assert replicas in ranker.get_rep_groups()


def test_degree_zero_with_tp_shards_hybrid_over_the_largest_degree():
    # Two hosts of 4 ranks, tp 2: SMP uses the largest degree, world / tp = 4, whatever the
    # strategy; HYBRID_SHARD gets the FSDP mesh (one replica), not one host's 2 ranks.
    plan = resolve(_layout(8, 0, 2, 1, 1), 4)
    assert plan.layout.hybrid_shard_degree == 4 and plan.host_plan is None
    assert plan.fsdp1(ShardingStrategy.SHARD_GRAD_OP).strategy is ShardingStrategy.SHARD_GRAD_OP
    assert plan.fsdp1(None).mesh == "fsdp_shard_mesh" == plan.fsdp2_dense
    hybrid = plan.fsdp1(ShardingStrategy.HYBRID_SHARD)
    assert (hybrid.strategy, hybrid.mesh) == (ShardingStrategy.HYBRID_SHARD, "fsdp_mesh")
    assert plan.mesh_ranks("fsdp_mesh", 1) == [[1], [1, 3, 5, 7]]
    # Two hosts of 2 ranks, tp 2 (the 2 x 2 case): a shard group of 2, not 1 (NO_SHARD).
    plan = resolve(_layout(4, 0, 2, 1, 1), 2)
    assert plan.host_plan is None
    assert plan.mesh_ranks("fsdp_mesh", 2) == [[2], [0, 2]]


def test_degree_zero_with_tp_1_shards_hybrid_within_a_host():
    # Two hosts of 2 ranks: FULL_SHARD over all 4, HYBRID_SHARD over one host (host_plan).
    plan = resolve(_layout(4, 0, 1, 1, 1), 2)
    assert plan.fsdp1(ShardingStrategy.FULL_SHARD).mesh == "fsdp_shard_mesh"
    assert plan.mesh_ranks("fsdp_shard_mesh", 2) == [[0, 1, 2, 3]]
    assert Ranker(plan.layout).get_rep_groups() == [[0], [1], [2], [3]]
    host = plan.host_plan
    assert host is not None and host.layout.hybrid_shard_degree == 2
    assert host.mesh_ranks("fsdp_mesh", 2) == [[0, 2], [2, 3]]
    assert Ranker(host.layout).get_rep_groups() == [[0, 2], [1, 3]]
    assert Ranker(host.layout).get_rep_rank(2) == 1
    # On one host the plan is the only one.
    assert resolve(_layout(8, 0, 1, 1, 1), 8).host_plan is None
    # With expert parallelism the largest degree, world / ep, for every strategy.
    ep_plan = resolve(_layout(8, 0, 1, 1, 2), 2)
    assert ep_plan.host_plan is None
    assert ep_plan.fsdp1(ShardingStrategy.HYBRID_SHARD).mesh == "fsdp_mesh"


def test_host_plan_keeps_context_parallel_groups_whole():
    # 4 ranks per host, cp 2: a host holds 2 whole CP groups.
    plan = resolve(_layout(8, 0, 1, 2, 1), 4)
    assert plan.host_plan is not None and plan.host_plan.layout.hybrid_shard_degree == 4
    assert plan.host_plan.mesh_ranks("fsdp_mesh", 5) == [[1, 5], [4, 5, 6, 7]]
    # A host smaller than a CP group cannot hold one: shard over every rank.
    assert resolve(_layout(8, 0, 1, 2, 1), 1).host_plan is None


def test_expert_parallel_placements():
    # SMP's Mixtral notebook: ep 2, hybrid_shard_degree 4 on 8 ranks.
    plan = resolve(_layout(8, 4, 1, 1, 2), 8)
    assert plan.fsdp1(None, experts=True).mesh == "fsdp_shard_mesh" == plan.fsdp2_experts
    assert plan.fsdp1(None, experts=True).strategy is ShardingStrategy.FULL_SHARD
    assert plan.fsdp1(ShardingStrategy.SHARD_GRAD_OP, experts=True).strategy is (
        ShardingStrategy.FULL_SHARD  # the dense units are HYBRID_SHARD, not ZeRO-2
    )
    assert plan.expert_group_size == 4
    # Same-expert replicas: ep 2 over 4 replicas of 2 ranks.
    plan = resolve(_layout(8, 2, 1, 1, 2), 8)
    experts = plan.fsdp1(None, experts=True)
    assert (experts.strategy, experts.mesh) == (ShardingStrategy.HYBRID_SHARD, "expert_fsdp_mesh")
    assert plan.mesh_ranks("expert_fsdp_mesh", 0) == [[0, 4], [0, 1]]
    assert plan.fsdp2_experts == "expert_fsdp_mesh"
    # hybrid_shard_degree=0 with EP: dense parameters over every data-parallel rank.
    plan = resolve(_layout(8, 0, 1, 1, 2), 8)
    assert plan.fsdp1(None).mesh == "dp_mesh" == plan.fsdp2_dense


def test_fsdp1_expert_problem_only_for_no_shard_with_expert_replicas():
    plan = resolve(_layout(8, 1, 1, 1, 2), 8)  # 4 same-expert replicas of one rank
    assert "use_orig_params=True" in plan.fsdp1_expert_problem(True)
    assert plan.fsdp1_expert_problem(False) is None
    assert resolve(_layout(2, 1, 1, 1, 2), 2).fsdp1_expert_problem(True) is None  # one rank


@pytest.mark.parametrize("world,ep,cp,hsd", [(8, 2, 2, 0), (8, 2, 2, 4), (4, 2, 2, 2)])
def test_expert_with_context_parallel_is_a_config_problem(world, ep, cp, hsd):
    raw = dict(expert_parallel_degree=ep, context_parallel_degree=cp, hybrid_shard_degree=hsd)
    with pytest.raises(ConfigError) as info:
        validate(raw, world)
    assert any(
        f"expert_parallel_degree={ep} with context_parallel_degree={cp}" in p
        and "Set one of them to 1" in p
        for p in info.value.problems
    )
    layout = Layout(world, 1, cp, ep, hsd or world // ep, hsd)
    with pytest.raises(ValueError, match="expert parallelism with context parallelism"):
        resolve(layout, world)


def test_combination_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        validate(
            dict(expert_parallel_degree=2, context_parallel_degree=2, tensor_parallel_degree=2),
            8,
        )
    text = "\n".join(info.value.problems)
    assert "with tensor_parallel_degree=2" in text and "with context_parallel_degree=2" in text
    assert combination_problems(1, 1, 8) == []
    assert [
        len(combination_problems(tp, cp, 2)) for tp, cp in itertools.product((1, 2), (1, 2))
    ] == [
        0,
        1,
        1,
        2,
    ]


def test_unknown_mesh_dimension():
    with pytest.raises(ValueError, match="unknown mesh dimension 'pp'"):
        resolve(_layout(2, 0, 1, 1, 1), 2).dim_ranks("pp", 0)
