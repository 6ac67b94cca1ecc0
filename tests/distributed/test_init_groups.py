"""tsm.init on 4 ranks: every group and mesh of every layout in the issue, member ranks exact."""

import pytest

from tests.distributed.launcher import run_distributed

# (hybrid_shard_degree, tp, cp) -> expected groups (each rank's group, listed once per group).
# Rank layout: tp innermost, then cp, then dp_shard, then dp_replicate (see topology.py).
S = [[0], [1], [2], [3]]
ALL = [[0, 1, 2, 3]]
EXPECTED = {
    (0, 1, 1): dict(tp=S, cp=S, shard=ALL, replicate=S, replica=ALL, dp=ALL, resolved=4, dp_size=4),
    (1, 1, 1): dict(tp=S, cp=S, shard=S, replicate=ALL, replica=S, dp=ALL, resolved=1, dp_size=4),
    (2, 1, 1): dict(
        tp=S,
        cp=S,
        shard=[[0, 1], [2, 3]],
        replicate=[[0, 2], [1, 3]],
        replica=[[0, 1], [2, 3]],
        dp=ALL,
        resolved=2,
        dp_size=4,
    ),
    (4, 1, 1): dict(tp=S, cp=S, shard=ALL, replicate=S, replica=ALL, dp=ALL, resolved=4, dp_size=4),
    (2, 2, 1): dict(
        tp=[[0, 1], [2, 3]],
        cp=S,
        shard=[[0, 2], [1, 3]],
        replicate=S,
        replica=ALL,
        dp=[[0, 2], [1, 3]],
        resolved=2,
        dp_size=2,
    ),
    (1, 2, 1): dict(
        tp=[[0, 1], [2, 3]],
        cp=S,
        shard=S,
        replicate=[[0, 2], [1, 3]],
        replica=[[0, 1], [2, 3]],
        dp=[[0, 2], [1, 3]],
        resolved=1,
        dp_size=2,
    ),
    (2, 1, 2): dict(
        tp=S,
        cp=[[0, 1], [2, 3]],
        shard=[[0, 1], [2, 3]],
        replicate=[[0, 2], [1, 3]],
        replica=[[0, 1], [2, 3]],
        dp=[[0, 2], [1, 3]],
        resolved=2,
        dp_size=2,
    ),
}


def _groups_for_layouts(layouts):
    import torch.distributed as dist
    import torch.sagemaker as tsm

    out = {}
    for hsd, tp, cp in layouts:
        tsm.state.reset()
        tsm.init(
            {
                "hybrid_shard_degree": hsd,
                "tensor_parallel_degree": tp,
                "context_parallel_degree": cp,
            }
        )
        s = tsm.state
        ranks = dist.get_process_group_ranks
        fsdp_mesh = s.fsdp_mesh
        out[(hsd, tp, cp)] = dict(
            tp=ranks(s.tp_process_group),
            cp=ranks(s.cp_process_group),
            shard=ranks(s.fsdp_shard_process_group),
            replicate=ranks(s.fsdp_replicate_process_group),
            replica=ranks(s.rep_rank_process_group),
            dp=ranks(s.dp_process_group),
            resolved=s.hybrid_shard_degree,
            dp_size=s.dp_size,
            dp_rank=s.dp_rank,
            tp_rank=s.tp_rank,
            cp_rank=s.cp_rank,
            rep_rank=s.ranker.get_rep_rank(s.rank),
            rep_groups=s.ranker.get_rep_groups(),
            mesh_names=s.device_mesh.mesh_dim_names,
            mesh_shape=tuple(s.device_mesh.shape),
            fsdp_mesh_names=fsdp_mesh.mesh_dim_names,
            fsdp_shard_mesh=ranks(fsdp_mesh.get_group("dp_shard_cp")),
            fsdp_replicate_mesh=ranks(fsdp_mesh.get_group("dp_replicate")),
            world=ranks(s.world_process_group),
            tp_size=s.tp_size,
            cp_size=s.cp_size,
            ep_size=s.ep_size,
        )
    return out


@pytest.mark.distributed
def test_groups_on_four_ranks():
    per_rank = run_distributed(_groups_for_layouts, list(EXPECTED), world_size=4, timeout=300)
    for layout, expected in EXPECTED.items():
        hsd, tp, cp = layout
        results = [r[layout] for r in per_rank]
        for name in ("tp", "cp", "shard", "replicate", "replica", "dp"):
            seen = sorted({tuple(r[name]) for r in results})
            assert [list(g) for g in seen] == expected[name], (layout, name, seen)
            for rank, r in enumerate(results):
                assert rank in r[name], (layout, name, rank)
        for rank, r in enumerate(results):
            assert r["resolved"] == expected["resolved"]
            assert r["dp_size"] == expected["dp_size"]
            assert r["dp_rank"] == rank // (tp * cp)
            assert r["tp_rank"] == rank % tp
            assert r["cp_rank"] == (rank // tp) % cp
            assert r["rep_groups"] == expected["replicate"]
            assert r["rep_rank"] == [g for g in expected["replicate"] if rank in g][0].index(rank)
            assert r["mesh_names"] == ("dp_replicate", "dp_shard", "cp", "tp")
            assert r["fsdp_mesh_names"] == ("dp_replicate", "dp_shard_cp")
            assert r["fsdp_shard_mesh"] == r["shard"] and r["fsdp_replicate_mesh"] == r["replicate"]
            assert r["world"] == [0, 1, 2, 3]
            assert (r["tp_size"], r["cp_size"], r["ep_size"]) == (tp, cp, 1)


# (hybrid_shard_degree, tp, ep) on 4 ranks in two "hosts" of 2 (LOCAL_WORLD_SIZE=2): with
# degree 0 and tp 1 the one-host plan differs from the layout's, so tsm.init builds its groups
# too (Note [Degree 0 with a hybrid strategy] in sharding_plan.py).
PLAN_LAYOUTS = [(0, 1, 1), (0, 2, 1), (2, 1, 1), (1, 1, 1), (0, 1, 2), (1, 1, 2), (2, 1, 2)]


def _plan_meshes(layouts):
    import torch.distributed as dist
    import torch.sagemaker as tsm

    out = {}
    for hsd, tp, ep in layouts:
        tsm.state.reset()
        tsm.init(
            {"hybrid_shard_degree": hsd, "tensor_parallel_degree": tp, "expert_parallel_degree": ep}
        )
        plan, rank = tsm.state.sharding_plan, dist.get_rank()
        built = {}
        for name in plan.meshes:
            mesh = tsm.state.mesh(name)
            got = [dist.get_process_group_ranks(mesh.get_group(i)) for i in range(mesh.ndim)]
            built[name] = (got, plan.mesh_ranks(name, rank))
        out[(hsd, tp, ep)] = (plan.host_plan is not None, tsm.state.local_world_size, built)
    tsm.state.reset()
    return out


@pytest.mark.distributed
def test_plan_meshes_are_the_groups_built():
    """Every mesh the sharding plan names exists, with the ranks the plan computes."""
    per_rank = run_distributed(
        _plan_meshes, PLAN_LAYOUTS, world_size=4, timeout=300, env={"LOCAL_WORLD_SIZE": "2"}
    )
    for out in per_rank:
        # Degree 0: with tp 1 a hybrid strategy shards within a host of 2; with tp 2 (and
        # with ep 2) the largest degree is used for every strategy, no second plan.
        assert out[(0, 1, 1)][0] and not out[(0, 2, 1)][0] and not out[(0, 1, 2)][0]
        assert not out[(2, 1, 1)][0]
        for layout, (_, local_world_size, built) in out.items():
            assert local_world_size == 2
            for name, (got, planned) in built.items():
                assert got == planned, (layout, name)


def _live_groups_around_init_and_reset(path):
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from torch_sagemaker._torch_compat import c10d as c10d_compat
    from torch_sagemaker.checkpoint.async_utils import maybe_finalize_async_calls
    from torch_sagemaker.checkpoint.state_dict_saver import async_save

    tsm.state.reset()
    before = len(c10d_compat.live_groups())
    tsm.init({"hybrid_shard_degree": 0})
    after_init = len(c10d_compat.live_groups())
    # HYBRID_SHARD with degree 0 on two hosts: one host per shard group (its groups built by
    # tsm.init, not here).
    model = FSDP(
        torch.nn.Linear(4, 4),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_id=torch.device("cpu"),
    )
    host_shard = dist.get_process_group_ranks(model.process_group)
    after_fsdp = len(c10d_compat.live_groups())
    # A background save over the shard group (one directory each) makes a private gloo group.
    async_save(
        {"w": torch.ones(2)},
        checkpoint_id=f"{path}/{host_shard[0]}",
        process_group=model.process_group,
    )
    maybe_finalize_async_calls(blocking=True, process_group=model.process_group)
    after_save = len(c10d_compat.live_groups())
    del model
    tsm.state.reset()
    after_reset = len(c10d_compat.live_groups())
    return dict(
        before=before,
        after_init=after_init,
        after_fsdp=after_fsdp,
        after_save=after_save,
        after_reset=after_reset,
        host_shard=host_shard,
    )


@pytest.mark.distributed
def test_reset_destroys_every_group_the_library_created(tmp_path):
    """The live groups c10d knows: init adds some, FSDP adds none, reset removes all it added."""
    per_rank = run_distributed(
        _live_groups_around_init_and_reset,
        str(tmp_path / "ckpt"),
        world_size=4,
        timeout=300,
        env={"LOCAL_WORLD_SIZE": "2"},
    )
    for rank, out in enumerate(per_rank):
        assert out["host_shard"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["after_init"] > out["before"]
        assert out["after_fsdp"] == out["after_init"]  # the one-host groups exist up front
        assert out["after_save"] == out["after_fsdp"] + 1  # the async save's gloo group
        assert out["after_reset"] == out["before"], out


def _init_expert_and_context_parallel():
    import torch.sagemaker as tsm

    from torch_sagemaker._torch_compat import c10d as c10d_compat

    tsm.state.reset()
    before = len(c10d_compat.live_groups())
    try:
        tsm.init({"expert_parallel_degree": 2, "context_parallel_degree": 2})
        error = None
    except tsm.ConfigError as e:
        error = e.problems
    out = dict(error=error, new_groups=len(c10d_compat.live_groups()) - before)
    tsm.state.reset()
    return out


@pytest.mark.distributed
def test_init_refuses_expert_with_context_parallel_before_building_groups():
    for out in run_distributed(_init_expert_and_context_parallel, world_size=4):
        assert out["error"] is not None and out["new_groups"] == 0, out
        assert any(
            "expert_parallel_degree=2 with context_parallel_degree=2" in p for p in out["error"]
        ), out


def _group_timeouts(layout):
    import torch.sagemaker as tsm

    from torch_sagemaker._torch_compat import c10d as c10d_compat

    tsm.state.reset()
    hsd, tp = layout
    tsm.init({"hybrid_shard_degree": hsd, "tensor_parallel_degree": tp})
    s = tsm.state
    groups = {
        "world": s.world_process_group,
        "tp": s.tp_process_group,
        "cp": s.cp_process_group,
        "ep": s.ep_process_group,
        "shard": s.fsdp_shard_process_group,
        "replicate": s.fsdp_replicate_process_group,
        "replica": s.rep_rank_process_group,
        "dp": s.dp_process_group,
    }
    out = {name: c10d_compat.group_timeout(g).total_seconds() for name, g in groups.items()}
    tsm.state.reset()
    return out


@pytest.mark.parametrize("backend", ["gloo", "smddp"])
def test_every_group_waits_as_long_as_the_default_group(backend):
    # new_group gives a group torch's default for its backend (30 minutes), not the job's: a
    # dead rank failed a TP or replica collective only after it (mesh.py).
    for out in run_distributed(_group_timeouts, (2, 2), world_size=4, backend=backend):
        assert set(out.values()) == {120.0}, out
