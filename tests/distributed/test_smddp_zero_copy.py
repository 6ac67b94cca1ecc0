"""Zero-copy operands: tensors from smddp's shared-memory pool are read in place by peers.

FSDP2 allocates its all-gather output and reduce-scatter input through
``backend.allocate_tensor`` after ``set_allocate_memory_from_process_group_for_comm(True)``
(``shard_model`` turns it on for smddp). These tests check the pool itself (allocation,
release, disabled and full pools), that collectives over pool tensors are exact and really
take the zero-copy path, that a rank whose operand is not in the pool makes every rank fall
back to staging, and that FSDP2 training with pool buffers equals training without them.
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.smddp_rank_helpers import cpu_backend as _cpu_backend
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _alloc(n, dtype):
    import torch

    return _cpu_backend().allocate_tensor(n, dtype=dtype, device=torch.device("cpu"))


def _in_pool_collectives():
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.backend import pool_stats

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"supports": _cpu_backend().supports_tensor_alloc(torch.device("cpu")), "cases": []}
    before = pool_stats()["zero_copy_ops"]
    expected_zero_copy = 0
    # Sizes per rank: below the zero-copy threshold, odd, and a few MiB; every dtype class.
    for n, dtype in [
        (7, torch.float32),
        (40_009, torch.float32),
        (65_537, torch.bfloat16),
        (1 << 20, torch.float32),
        (50_000, torch.int64),
        (30_011, torch.float16),
    ]:
        for mixed in (False, True):
            # mixed: rank 1's operands are ordinary memory, so nobody may go zero-copy.
            pooled = not (mixed and rank == 1)
            esz = torch.empty(0, dtype=dtype).element_size()
            big = n * world * esz >= 64 << 10
            expected_zero_copy += 2 * (big and not mixed)

            gathered = _alloc(n * world, dtype) if pooled else torch.empty(n * world, dtype=dtype)
            shard = gathered[rank * n : (rank + 1) * n]  # FSDP2 passes a view of the output
            shard.copy_(torch.arange(n).to(dtype) + 100 * rank)
            dist.all_gather_into_tensor(gathered, shard)
            want = torch.cat([torch.arange(n).to(dtype) + 100 * r for r in range(world)])
            ag_ok = torch.equal(gathered, want)

            inputs = [(torch.arange(n * world) % 97 + r).to(dtype) for r in range(world)]
            src = _alloc(n * world, dtype) if pooled else torch.empty(n * world, dtype=dtype)
            src.copy_(inputs[rank])
            got = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(got, src, op=dist.ReduceOp.SUM)
            ref = sum(t.double() for t in inputs)[rank * n : (rank + 1) * n].to(dtype)
            rs_ok = torch.equal(got, ref)
            out["cases"].append((n, str(dtype), mixed, ag_ok, rs_ok))
            del gathered, shard, src
    stats = pool_stats()
    out["zero_copy_ops"] = stats["zero_copy_ops"] - before
    out["expected_zero_copy"] = expected_zero_copy
    out["in_use_after"] = stats["in_use"]
    out["pool_bytes"] = stats["pool_bytes"]
    return out


def test_pool_tensors_are_gathered_and_reduced_in_place():
    for r in run_distributed(_in_pool_collectives, world_size=2, backend="smddp", timeout=300):
        assert r["supports"]
        assert r["pool_bytes"] == 1 << 30
        for n, dtype, mixed, ag_ok, rs_ok in r["cases"]:
            assert ag_ok and rs_ok, (n, dtype, mixed)
        # Every large case without a stranger operand ran zero-copy, and no other did.
        assert r["zero_copy_ops"] == r["expected_zero_copy"] > 0
        assert r["in_use_after"] == 0  # freed tensors went back to the pool


def _small_or_no_pool():
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.backend import pool_stats

    rank, world = dist.get_rank(), dist.get_world_size()
    be = _cpu_backend()
    out = {"supports": be.supports_tensor_alloc(torch.device("cpu")), "pool": pool_stats()}
    if out["supports"]:
        t = _alloc(4 << 20, torch.float32)  # 16 MiB: more than the 1 MiB pool holds
        out["in_use_with_big_tensor"] = pool_stats()["in_use"]
        t.fill_(rank + 1)
        got = torch.empty(t.numel() // world)
        dist.reduce_scatter_tensor(got, t)
        out["rs_ok"] = bool((got == sum(range(1, world + 1))).all())
    return out


def test_disabled_pool_and_full_pool_fall_back_to_ordinary_memory():
    for r in run_distributed(
        _small_or_no_pool, world_size=2, backend="smddp", env={"SMDDP_POOL_BYTES": "0"}, timeout=300
    ):
        assert not r["supports"] and r["pool"]["pool_bytes"] == 0
    for r in run_distributed(
        _small_or_no_pool,
        world_size=2,
        backend="smddp",
        env={"SMDDP_POOL_BYTES": str(1 << 20)},
        timeout=300,
    ):
        assert r["supports"] and r["pool"]["pool_bytes"] == 1 << 20
        assert r["in_use_with_big_tensor"] == 0  # served from ordinary memory instead
        assert r["rs_ok"]


def _fsdp2_with_and_without_pool():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.sharding.fsdp2 import shard_model
    from torch_sagemaker.smddp.backend import pool_stats

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(128, 128)

        def forward(self, x):
            return torch.relu(self.fc(x)) + x

    def train(group, pool, plain=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(128, 8))
        mesh = DeviceMesh.from_group(group, "cpu")
        if plain:  # the torchtitan way: fully_shard called by the script itself
            for block in model[:2]:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            comms.append(type(model[0]._get_fsdp_state()._fsdp_param_group._all_gather_comm))
        else:
            shard_model(model, mesh=mesh, layer_classes=(Block,), comm_buffers_from_backend=pool)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            x, y = torch.randn(4, 128, generator=g), torch.randn(4, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.full_tensor().detach().clone() for p in model.parameters()]

    smddp, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
    comms = []
    before = pool_stats()["zero_copy_ops"]
    zc_losses, zc_params = train(smddp, None)  # default: on for smddp
    zero_copy_ops = pool_stats()["zero_copy_ops"] - before
    staged_losses, staged_params = train(smddp, False)
    gloo_losses, gloo_params = train(gloo, None)  # default: off for gloo
    before = pool_stats()["zero_copy_ops"]
    plain_losses, plain_params = train(smddp, None, plain=True)
    plain_zero_copy_ops = pool_stats()["zero_copy_ops"] - before
    train(gloo, None, plain=True)
    return {
        "zero_copy_ops": zero_copy_ops,
        "plain_zero_copy_ops": plain_zero_copy_ops,
        "plain_comms": [c.__name__ for c in comms],
        "plain_same": plain_losses == zc_losses
        and all(torch.equal(a, b) for a, b in zip(plain_params, zc_params)),
        "same_as_staged": zc_losses == staged_losses
        and all(torch.equal(a, b) for a, b in zip(zc_params, staged_params)),
        "gloo_max_diff": max((a - b).abs().max().item() for a, b in zip(zc_params, gloo_params)),
        "gloo_losses": gloo_losses,
        "losses": zc_losses,
    }


def test_fsdp2_with_pool_buffers_equals_staged_and_gloo_also_for_plain_fully_shard():
    for r in run_distributed(
        _fsdp2_with_and_without_pool, world_size=2, backend="smddp", timeout=300
    ):
        # Per step, each of the 2 blocks (66 KiB of parameters): an all-gather in forward,
        # another in backward, a reduce-scatter. The root's (the 4 KiB head) stay below the
        # zero-copy threshold.
        assert r["zero_copy_ops"] == 3 * 2 * 3, r
        # A script's own fully_shard gets the pool too (Note [Pool buffers for every FSDP2
        # user]), on smddp only, with the same values.
        assert r["plain_zero_copy_ops"] == 3 * 2 * 3, r
        assert r["plain_comms"] == ["ProcessGroupAllocAllGather", "DefaultAllGather"], r
        assert r["plain_same"], r
        assert r["same_as_staged"], r
        assert r["gloo_max_diff"] < 1e-6, r
        assert r["losses"] == pytest.approx(r["gloo_losses"], rel=1e-6)


def _pool_operands_against_plain(sizes):
    """Each collective on pool operands, on some ranks' only (mixed), and on plain ones."""
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.backend import group_layout, pool_stats

    rank, world = dist.get_rank(), dist.get_world_size()
    kinds = ("pool_reduce_reads", "pool_gather_reads")
    before = {k: pool_stats()[k] for k in kinds}
    differ = []
    for n, dtype in sizes:
        dtype = getattr(torch, dtype)
        x = torch.randn(n * world, generator=torch.Generator().manual_seed(rank * 7 + n)).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            results = {}
            for mode in ("plain", "pool", "mixed"):
                pooled = mode == "pool" or (mode == "mixed" and rank % 2 == 1)

                def new(pooled=pooled, count=n * world, dtype=dtype):
                    if pooled:
                        return _alloc(count, dtype)
                    return torch.empty(count, dtype=dtype)

                src, data, gathered = new().copy_(x), new().copy_(x), new()
                got = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(got, src, op=op)
                dist.all_reduce(data, op=op)
                shard = gathered[rank * n : (rank + 1) * n].copy_(x[:n])  # as FSDP2 passes it
                dist.all_gather_into_tensor(gathered, shard)
                results[mode] = (got, data, gathered)
            differ += [
                (n, str(dtype), str(op), mode, what)
                for mode in ("pool", "mixed")
                for what, a, b in zip(("rs", "ar", "ag"), results[mode], results["plain"])
                if not torch.equal(a, b)
            ]
            del results, src, data, gathered, shard  # back to the pool before its stats
    # A rank that returns may change its operands at once: a peer must have read them by
    # then (the wait in Note [Read from the pool]). Each rank scribbles over what its peers
    # read from it the moment its call returns, and checks what it got after that.
    n = 1 << 16
    x = torch.arange(n * world, dtype=torch.float32) + rank
    for _ in range(20):
        gathered = _alloc(n * world, torch.float32)
        gathered[rank * n : (rank + 1) * n] = x[:n]
        dist.all_gather_into_tensor(gathered, gathered[rank * n : (rank + 1) * n])
        gathered[rank * n : (rank + 1) * n] = -1.0
        want = torch.cat([torch.arange(n, dtype=torch.float32) + r for r in range(world)])
        late = [
            r
            for r in range(world)
            if r != rank
            and not torch.equal(gathered[r * n : (r + 1) * n], want[r * n : (r + 1) * n])
        ]
        src = _alloc(n * world, torch.float32).copy_(x)
        got = torch.empty(n)
        dist.reduce_scatter_tensor(got, src)
        src.fill_(-1.0)
        ref = sum(torch.arange(n * world, dtype=torch.float32) + r for r in range(world))
        if late or not torch.equal(got, ref[rank * n : (rank + 1) * n]):
            differ.append(("read after return", late))
        del gathered, src
    return {
        "differ": differ,
        "reads": {k: pool_stats()[k] - before[k] for k in kinds},
        "net_ops": group_layout()["net_ops"],
        "in_use": pool_stats()["in_use"],
        "pool_bytes": pool_stats()["pool_bytes"],
    }


@pytest.mark.parametrize(
    "world,env,sizes",
    [
        # 2 hosts of 2 (the mesh): sizes below the threshold, odd, bf16 and fp16.
        (
            4,
            {"SMDDP_FORCE_LOCAL_SIZE": "2"},
            [(7, "float32"), (40_009, "float32"), (65_537, "bfloat16"), (300_001, "float16")],
        ),
        # 4 hosts of 2 under auto: 96 KiB takes halving-doubling, 1.3 MB the ring's phases.
        (8, {"SMDDP_FORCE_LOCAL_SIZE": "2"}, [(3001, "float32"), (40_009, "float32")]),
        # The tree takes the all_reduces (the rest as auto).
        (8, {"SMDDP_FORCE_LOCAL_SIZE": "2", "SMDDP_NET_ALGO": "tree"}, [(40_009, "float32")]),
        # Unequal hosts {0, 1} and {2}: rank 2 has no local peer and no pool.
        (3, {"SMDDP_FORCE_LOCAL_SIZE": "2"}, [(40_009, "float32"), (65_537, "bfloat16")]),
    ],
    ids=["2x2", "4x2", "4x2-tree", "2+1"],
)
def test_pool_operands_across_forced_hosts_are_read_where_they_lie(world, env, sizes):
    # Note [Read from the pool]: across hosts a host's ranks read each other's pool operands
    # in place; results equal those of plain operands bit for bit, also where only some ranks'
    # operands are in their pools.
    results = run_distributed(
        _pool_operands_against_plain,
        sizes,
        world_size=world,
        backend="smddp",
        env=env,
        timeout=300,
    )
    for rank, r in enumerate(results):
        assert r["differ"] == [], r
        assert r["in_use"] == 0  # every pool tensor went back
        # A rank with a local peer has a pool and read its peers' pools in both kinds of
        # step (in "pool" mode every peer's operands are there); one alone on its host
        # (rank 2 of 2+1) has neither.
        if env.get("SMDDP_NET_ALGO") == "tree":
            assert r["net_ops"].get("tree", 0) > 0, r["net_ops"]
        alone = world == 3 and rank == 2
        assert (r["pool_bytes"] > 0) != alone, (rank, r)
        assert (min(r["reads"].values()) > 0) != alone, (rank, r["reads"])
