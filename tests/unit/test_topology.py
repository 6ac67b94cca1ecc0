"""Rank-layout arithmetic for many (world, degrees) combinations, without processes."""

import itertools

import pytest

from torch_sagemaker.config import ConfigError, validate
from torch_sagemaker.topology import AXES, resolve


def _valid_layouts(max_world=16):
    for world in (1, 2, 4, 6, 8, 12, 16):
        if world > max_world:
            continue
        for hsd, tp, cp, ep in itertools.product(range(0, world + 1), (1, 2, 4), (1, 2), (1, 2)):
            raw = dict(
                hybrid_shard_degree=hsd,
                tensor_parallel_degree=tp,
                context_parallel_degree=cp,
                expert_parallel_degree=ep,
            )
            try:
                validate(raw, world)
            except ConfigError:
                continue
            yield world, hsd, tp, cp, ep


LAYOUTS = list(_valid_layouts())


def test_many_layouts_are_covered():
    assert len(LAYOUTS) > 100


@pytest.mark.parametrize("world,hsd,tp,cp,ep", LAYOUTS)
def test_layout_invariants(world, hsd, tp, cp, ep):
    layout = resolve(
        world,
        hybrid_shard_degree=hsd,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
        expert_parallel_degree=ep,
    )
    sizes = layout.axis_sizes
    assert tuple(sizes) == AXES
    assert sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"] == world
    assert layout.hybrid_shard_degree == (hsd or world // (tp * ep))
    assert layout.dp_size == world // (tp * cp)
    for rank in range(world):
        coords = layout.coordinates(rank)
        assert layout.rank_at(coords) == rank
        assert coords["tp"] == rank % tp  # tp innermost and contiguous
        assert coords["cp"] == (rank // tp) % cp
        assert layout.dp_rank(rank) == rank // (tp * cp)
        assert 0 <= layout.ep_rank(rank) < ep
    for axes in (
        ("tp",),
        ("cp",),
        ("dp_shard", "cp"),
        ("dp_replicate",),
        ("dp_replicate", "dp_shard"),
    ):
        groups = layout.groups(axes)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), axes  # a partition of the ranks
        size = 1
        for a in axes:
            size *= sizes[a]
        assert all(len(g) == size for g in groups)
    for group in layout.groups("tp"):
        assert group == list(range(group[0], group[0] + tp))
    assert all(len(g) == layout.hybrid_shard_degree for g in layout.groups(("dp_shard", "cp")))
    ep_groups = layout.ep_groups()
    assert sorted(r for g in ep_groups for r in g) == list(range(world))
    assert all(len(g) == ep for g in ep_groups)


def test_concrete_eight_rank_layout():
    layout = resolve(8, hybrid_shard_degree=2, tensor_parallel_degree=2)
    assert layout.axis_sizes == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(("dp_shard", "cp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.rep_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_context_parallel_inside_shard_group():
    layout = resolve(8, hybrid_shard_degree=4, context_parallel_degree=2, tensor_parallel_degree=2)
    assert layout.axis_sizes == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups(("dp_shard", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_parallel_splits_replicas():
    layout = resolve(8, hybrid_shard_degree=2, expert_parallel_degree=2)
    assert layout.dp_replicate == 4
    assert layout.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_invalid_layout_is_a_programming_error():
    with pytest.raises(ValueError, match="validate the config"):
        resolve(8, hybrid_shard_degree=3)
    with pytest.raises(ValueError, match="outside"):
        resolve(4).coordinates(4)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        resolve(4).groups("pp")


@pytest.mark.parametrize("world,hsd,tp,cp,ep", [c for c in LAYOUTS if c[4] > 1])
def test_expert_data_parallel_groups(world, hsd, tp, cp, ep):
    """The ranks holding the same experts: a partition into shard group x same-EP-rank replicas."""
    layout = resolve(
        world,
        hybrid_shard_degree=hsd,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
        expert_parallel_degree=ep,
    )
    groups = layout.expert_dp_groups()
    assert sorted(r for g in groups for r in g) == list(range(world))
    assert all(len(g) == layout.edp_replicate * layout.hybrid_shard_degree for g in groups)
    for group in groups:
        # One EP rank and one TP rank per group; every EP group meets it exactly once per
        # (shard, cp, replica pair).
        assert len({layout.ep_rank(r) for r in group}) == 1
        assert len({layout.coordinates(r)["tp"] for r in group}) == 1
        for shard_group in layout.groups(("dp_shard", "cp")):
            assert set(shard_group) <= set(group) or not set(shard_group) & set(group)
    for ep_group in layout.ep_groups():
        assert sorted(layout.ep_rank(r) for r in ep_group) == list(range(ep))
        assert len({layout.dp_rank(r) for r in ep_group}) == ep  # EP ranks are data-parallel ranks


@pytest.mark.parametrize("world,hsd", [(8, 4), (64, 32)])
def test_smp_mixtral_notebook_layouts(world, hsd):
    """ep 2 with hybrid_shard_degree 4 on 8 ranks and 32 on 64 (SMP's Mixtral notebooks)."""
    validate(dict(hybrid_shard_degree=hsd, expert_parallel_degree=2), world)
    layout = resolve(world, hybrid_shard_degree=hsd, expert_parallel_degree=2)
    assert (layout.dp_replicate, layout.edp_replicate, layout.dp_size) == (2, 1, world)
    half = world // 2
    assert layout.ep_groups() == [[r, r + half] for r in range(half)]
    # Each half of the world is one shard group and holds one half of the experts.
    assert layout.expert_dp_groups() == [list(range(half)), list(range(half, world))]
    assert layout.groups(("dp_shard", "cp")) == layout.expert_dp_groups()


def test_default_shard_degree_with_expert_parallelism():
    """hybrid_shard_degree 0 shards experts over every rank that holds them."""
    layout = resolve(8, expert_parallel_degree=4)
    assert (layout.hybrid_shard_degree, layout.dp_replicate, layout.edp_replicate) == (2, 4, 1)
    assert layout.ep_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.expert_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
