"""DDP and FSDP2 steps over smddp equal the same steps over gloo; sub-groups and DeviceMesh."""

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _batch(rank):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def _train_two_steps(model):
    import torch
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = _batch(dist.get_rank() + 10 * step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _ddp_step(group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(), process_group=group, bucket_cap_mb=0.001)  # several buckets
    _train_two_steps(model)
    return [p.detach().clone() for p in model.parameters()]


def _fsdp2_step(group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_two_steps(model)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _training_parity():
    import torch
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    smddp = dist.group.WORLD
    assert dist.get_backend(smddp) == "smddp"
    out = {}
    for name, fn in (("ddp", _ddp_step), ("fsdp2", _fsdp2_step)):
        a, b = fn(smddp), fn(gloo)
        out[name] = all(torch.equal(x, y) for x, y in zip(a, b))
        out[name + "_max_diff"] = max((x - y).abs().max().item() for x, y in zip(a, b))
        out[name + "_changed"] = any(
            not torch.equal(x, y) for x, y in zip(a, [p.detach() for p in _model().parameters()])
        )
    return out


def test_ddp_and_fsdp2_steps_match_gloo():
    for r in run_distributed(_training_parity, world_size=2, backend="smddp", timeout=300):
        assert r["ddp_changed"] and r["fsdp2_changed"]
        assert r["ddp"], r
        # FSDP2 reduce-scatters with AVG on smddp but SUM + division on gloo: same math, and
        # with two ranks (a sum of two, then an exact halving) the same bits.
        assert r["fsdp2"], r


def _subgroups_and_mesh():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    out = {}
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.full((1001,), float(rank))
    dist.all_reduce(t, group=mine)
    out["pair_sum"] = t[0].item()
    o = torch.empty(2 * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(o, torch.full((3,), rank), group=mine)
    out["pair_gather"] = o.tolist()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, group_src=1, group=mine)
    out["pair_bcast"] = b.item()

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["mesh_backend"] = dist.get_backend(mesh.get_group("tp"))
    for axis in ("dp", "tp"):
        t = torch.full((7,), float(rank + 1))
        dist.all_reduce(t, group=mesh.get_group(axis))
        out[axis] = t[0].item()
    return out


def test_subgroups_and_device_mesh_on_forced_hosts():
    res = run_distributed(
        _subgroups_and_mesh,
        world_size=4,
        backend="smddp",
        env={"SMDDP_FORCE_LOCAL_SIZE": "2"},
        timeout=300,
    )
    for rank, r in enumerate(res):
        partner = rank ^ 2
        assert r["pair_sum"] == rank + partner
        lo, hi = min(rank, partner), max(rank, partner)
        assert r["pair_gather"] == [lo] * 3 + [hi] * 3
        assert r["pair_bcast"] == hi
        assert r["mesh_backend"] == "smddp"
        # mesh [[0, 1], [2, 3]]: tp groups are rows, dp groups are columns.
        row = [rank - rank % 2, rank - rank % 2 + 1]
        col = [rank % 2, rank % 2 + 2]
        assert r["tp"] == sum(x + 1 for x in row) and r["dp"] == sum(x + 1 for x in col)
