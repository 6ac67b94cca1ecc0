"""Sparse COO all_reduce on smddp (Note [Sparse all-reduce] in backend_sparse.cpp): the
same results as gloo and as a dense sum, gloo's errors, and DDP with sparse embedding
gradients against one process."""

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _inputs(rank, world):
    """Each case: name -> this rank's sparse tensor (integer-valued, so sums are exact)."""
    import torch

    g = torch.Generator().manual_seed(17 + rank)

    def coo(indices, values, size):
        return torch.sparse_coo_tensor(torch.tensor(indices), values, size)

    nnz = 5 + 3 * rank
    return {
        # Duplicate indices: the input is not coalesced.
        "duplicates": coo(
            [[0, 2, 0, rank % 3], [1, 0, 1, 2]],
            torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1),
            (3, 3),
        ),
        # A sparse dimension and a dense one (embedding-gradient layout).
        "hybrid": coo(
            [torch.randint(0, 10, (nnz,), generator=g).tolist()],
            torch.randint(-4, 5, (nnz, 4), generator=g).double(),
            (10, 4),
        ),
        # Rank 1 has no entries.
        "one_empty": coo([[rank], [rank]], torch.tensor([float(rank + 1)]), (world, world))
        if rank != 1
        else torch.sparse_coo_tensor(
            torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (world, world)
        ),
        "all_empty": torch.sparse_coo_tensor(
            torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 2), (4, 2)
        ),
        "int64": coo([[rank, 0]], torch.tensor([7, rank], dtype=torch.int64), (world,)),
        # No sparse dimension: one dense block per rank, summed.
        "sparse_dim_0": torch.sparse_coo_tensor(
            torch.zeros(0, 1, dtype=torch.long), torch.full((1, 3), float(rank)), (3,)
        ),
    }


def _sums():
    """For smddp and gloo: each case's result (indices, values, coalesced, as dense), and
    the dense sum of every rank's input. The async call's result is the tensor passed in."""
    import torch.distributed as dist

    me, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        for case, t in _inputs(me, world).items():
            work = dist.all_reduce(t, group=group, async_op=case == "hybrid")
            if work is not None:
                work.wait()
                assert work.result()[0] is t
            out[(name, case)] = (
                t._indices().tolist(),
                t._values().tolist(),
                t.is_coalesced(),
                t.to_dense().tolist(),
            )
    for case in _inputs(me, world):
        dense = sum(_inputs(r, world)[case].to_dense() for r in range(world))
        out[("dense", case)] = dense.tolist()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sparse_all_reduce_matches_gloo_and_the_dense_sum(transport):
    env = {"SMDDP_FORCE_LOCAL_SIZE": "1"} if transport == "tcp" else {}
    results = run_distributed(_sums, world_size=3, backend="smddp", env=env)
    for out in results:
        for case in ("duplicates", "hybrid", "one_empty", "all_empty", "int64", "sparse_dim_0"):
            assert out[("smddp", case)] == out[("gloo", case)], case
            _, _, coalesced, dense = out[("smddp", case)]
            assert coalesced and dense == out[("dense", case)], case
    assert (
        results[0][("smddp", "hybrid")]
        == results[1][("smddp", "hybrid")]
        == results[2][("smddp", "hybrid")]
    )


def _large_unequal_parts():
    """Parts of 0, 17 and 5001 rows of 64 values (the largest 1.3 MB, many times the 64 KiB
    buffer): the all-to-all of unequal parts over several rounds. smddp's and gloo's sums."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    rows = (0, 17, 5001)[me]
    g = torch.Generator().manual_seed(me)
    t = torch.sparse_coo_tensor(
        torch.randint(0, 8000, (1, rows), generator=g),
        torch.randint(-8, 9, (rows, 64), generator=g).float(),
        (8000, 64),
    )
    gloo = dist.new_group(backend="gloo")
    out = []
    for group in (None, gloo):
        x = t.clone()
        dist.all_reduce(x, group=group)
        out.append((x._indices(), x._values()))
    return all(torch.equal(a, b) for a, b in zip(*out, strict=True)), out[0][0].shape[1]


def test_sparse_all_reduce_of_large_unequal_parts_matches_gloo():
    results = run_distributed(
        _large_unequal_parts, world_size=3, backend="smddp", env={"SMDDP_BUFFER_BYTES": "65536"}
    )
    for same, nnz in results:
        assert same and nnz > 5001 * 0.5, nnz


def _errors():
    """gloo's rules, one error on every rank (no hang), and the group still works."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3 + me,))
    errors = {}
    for case, call in (
        ("max", lambda: dist.all_reduce(t.clone(), op=dist.ReduceOp.MAX)),
        ("sizes", lambda: dist.all_reduce(t.clone())),
    ):
        try:
            call()
            errors[case] = "no error"
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[case] = f"{type(e).__name__}: {e}"
    after = torch.ones(2)
    dist.all_reduce(after)
    # A sparse all_reduce against a dense one is a mismatch, named at once (gloo times out).
    group = dist.new_group([0, 1])
    try:
        if me == 0:
            dist.all_reduce(t.clone(), group=group)
        else:
            dist.all_reduce(torch.ones(69, dtype=torch.int64), group=group)
        errors["dense"] = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors["dense"] = f"{type(e).__name__}: {e}"
    return errors, after.tolist()


def test_sparse_all_reduce_refuses_what_gloo_refuses_on_every_rank():
    for errors, after in run_distributed(_errors, world_size=2, backend="smddp"):
        assert errors["max"].startswith("ValueError") and "ReduceOp.SUM only" in errors["max"]
        assert "rank 1's tensor has sizes [4]" in errors["sizes"], errors["sizes"]
        assert "but rank 0's has [3]" in errors["sizes"], errors["sizes"]
        assert "must have the same sizes" in errors["sizes"], errors["sizes"]
        assert after == [2.0, 2.0]
        assert "mismatched collectives" in errors["dense"], errors["dense"]
        assert "all_reduce (sparse)" in errors["dense"], errors["dense"]


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(24, 1)
    )


def _ddp_sparse_embedding(steps):
    """DDP over a model whose embedding has sparse gradients: every rank's parameters after
    `steps` SGD steps, and those of one process trained on the whole batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    me, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, 50, (4 * world, 3), generator=g), torch.randn(4 * world, 1, generator=g))
        for _ in range(steps)
    ]

    def train(model, rows):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    ddp = DDP(_model())
    mine = train(ddp, slice(4 * me, 4 * me + 4))
    assert ddp.module[0].weight.grad.is_sparse
    reference = train(_model(), slice(None))
    return [p.tolist() for p in mine], [p.tolist() for p in reference]


def test_ddp_with_sparse_embedding_gradients_matches_one_process():
    import torch

    results = run_distributed(_ddp_sparse_embedding, 3, world_size=2, backend="smddp")
    for mine, reference in results:
        for p, q in zip(mine, reference, strict=True):
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)
    assert results[0][0] == results[1][0]  # bit for bit the same on every rank
