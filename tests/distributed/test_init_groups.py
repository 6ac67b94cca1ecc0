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
