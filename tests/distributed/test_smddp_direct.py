"""all_reduce_direct: the same results, order and errors as dist.all_reduce on smddp, and
dist.all_reduce itself everywhere else."""

import pytest

from tests.distributed import smddp_rank_helpers as rank_helpers
from tests.distributed import smddp_reference as reference
from tests.distributed.launcher import DistributedTestError, run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _every_dtype_and_op():
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.direct import all_reduce_direct

    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = rank_helpers.host_layout()
    checked = 0
    for dtype in reference.ALL_DTYPES:
        for op in reference.ops_for(dtype):
            for n in (0, 1, 7, 17, 1031, 70001):
                salt = reference.salt_for(str(dtype), op, "direct")
                t = reference.make_input(rank, n, dtype, salt, op)
                via_dist = t.clone()
                all_reduce_direct(t, op=reference.redop(op))
                dist.all_reduce(via_dist, op=reference.redop(op))
                want = reference.reference_reduce(
                    [reference.make_input(r, n, dtype, salt, op) for r in range(world)],
                    op,
                    hosts,
                    tree=reference.tree_takes(t),
                    doubling=reference.doubling_takes(t, "all_reduce"),
                )
                assert reference.same(t, want), f"{dtype} {op} n={n}: {t[:8]} != {want[:8]}"
                assert reference.same(t, via_dist), (
                    f"{dtype} {op} n={n}: differs from dist.all_reduce"
                )
                checked += 1
    # Non-contiguous: a column of a matrix.
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
    col = m[:, 1]
    all_reduce_direct(col)
    assert torch.equal(
        m[:, 1],
        sum(torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1] + r for r in range(world)),
    )
    # Complex: reduced as its real view, as dist.all_reduce does; MAX is refused.
    z = torch.full((5,), complex(rank, -rank), dtype=torch.complex64)
    all_reduce_direct(z, op=dist.ReduceOp.AVG)
    mean = sum(range(world)) / world
    assert torch.equal(z, torch.full((5,), complex(mean, -mean), dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        all_reduce_direct(z, op=dist.ReduceOp.MAX)
    # Negated and conjugated views: the values they show are reduced, not their storage
    # (before: MAX of a negated view returned the MIN of the values, PRODUCT a wrong sign).
    base = torch.arange(1.0, 4.0) + rank
    neg = torch._neg_view(base)
    all_reduce_direct(neg, op=dist.ReduceOp.MAX)
    assert neg.is_neg() and torch.equal(neg, torch.tensor([-1.0, -2.0, -3.0]))
    neg = torch._neg_view(torch.arange(1.0, 4.0) + rank)
    all_reduce_direct(neg, op=dist.ReduceOp.PRODUCT)
    want = torch.ones(3)
    for r in range(world):
        want *= -(torch.arange(1.0, 4.0) + r)
    assert torch.equal(neg, want)
    c = torch.full((2,), complex(1, rank + 1), dtype=torch.complex64).conj()
    all_reduce_direct(c)
    assert c.is_conj() and torch.equal(
        c, torch.full((2,), complex(world, -sum(r + 1 for r in range(world))))
    )
    # A bare RedOpType and a ReduceOp object both work.
    x = torch.full((3,), float(rank))
    all_reduce_direct(x, op=dist.ReduceOp(dist.ReduceOp.MAX))
    assert torch.equal(x, torch.full((3,), float(world - 1)))
    return checked


def test_every_dtype_and_op_equals_dist_all_reduce_bit_for_bit():
    counts = run_distributed(_every_dtype_and_op, world_size=3, backend="smddp", timeout=300)
    assert counts[0] == 6 * sum(len(reference.ops_for(d)) for d in reference.ALL_DTYPES)


def _ordered_with_async_collectives():
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.direct import all_reduce_direct

    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(world)), backend="smddp")
    works, pending = [], []
    for i in range(30):
        # Queued on the group's worker thread; the direct call must run after them.
        big = torch.full((200_000 + i,), float(rank + i))
        works.append(dist.all_reduce(big, group=g, async_op=True))
        out = torch.empty(world * (i + 1), dtype=torch.int64)
        works.append(
            dist.all_gather_into_tensor(
                out, torch.full((i + 1,), rank * 10 + i), group=g, async_op=True
            )
        )
        small = torch.full((i + 1,), float(rank * i))
        all_reduce_direct(small, group=g)
        assert torch.equal(small, torch.full((i + 1,), float(sum(r * i for r in range(world))))), i
        pending.append((big, out, i))
    for w in works:
        w.wait()
    for big, out, i in pending:
        assert torch.all(big == sum(r + i for r in range(world))).item(), i
        assert torch.equal(
            out, torch.cat([torch.full((i + 1,), r * 10 + i) for r in range(world)])
        ), i
    dist.destroy_process_group(g)
    return len(works)


def test_runs_after_queued_async_collectives_of_its_group():
    assert run_distributed(
        _ordered_with_async_collectives, world_size=2, backend="smddp", timeout=300
    ) == [60, 60]


def _falls_back_where_it_cannot_go_direct():
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import direct

    rank, world = dist.get_rank(), dist.get_world_size()
    total = float(sum(range(world)))
    gloo = dist.new_group(backend="gloo")
    t = torch.full((9,), float(rank))
    direct.all_reduce_direct(t, group=gloo)
    assert torch.equal(t, torch.full((9,), total))
    # Resolved once: not smddp; remembered weakly (Note [Groups the direct path remembers]).
    assert gloo in direct._elsewhere and gloo not in direct._backends
    p = torch.nn.Parameter(torch.full((4,), float(rank)), requires_grad=False)
    direct.all_reduce_direct(p)  # a tensor subclass: through dist.all_reduce
    assert torch.equal(p.data, torch.full((4,), total))
    # A sparse tensor: through dist.all_reduce, which sums it.
    sparse = torch.sparse_coo_tensor([[rank]], [1.0], (world,))
    direct.all_reduce_direct(sparse)
    assert torch.equal(sparse.to_dense(), torch.ones(world))
    # A rank outside the group: dist.all_reduce's rule (nothing happens, with a warning).
    sub = dist.new_group([0, 2])
    s = torch.full((2,), float(rank))
    direct.all_reduce_direct(s, group=sub)
    assert torch.equal(s, torch.full((2,), 2.0 if rank in (0, 2) else 1.0))
    # A destroyed group is refused, and forgotten at the next lookup of a new group.
    again = dist.new_group(backend="smddp")
    direct.all_reduce_direct(torch.ones(1), group=again)
    dist.destroy_process_group(again)
    with pytest.raises(RuntimeError, match="shut down"):
        direct.all_reduce_direct(torch.ones(1), group=again)
    fresh = dist.new_group(backend="smddp")
    direct.all_reduce_direct(torch.ones(1), group=fresh)
    assert again not in direct._backends and fresh in direct._backends
    dist.destroy_process_group(fresh)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group(sub)
    # A destroyed gloo group goes, threads and all, once its caller drops it.
    gloo_ref = weakref.ref(gloo)
    del gloo
    gc.collect()
    assert gloo_ref() is None
    return True


def test_falls_back_to_dist_all_reduce_for_other_backends_subclasses_sparse_and_outsiders():
    assert all(
        run_distributed(
            _falls_back_where_it_cannot_go_direct, world_size=3, backend="smddp", timeout=120
        )
    )


def _mismatched_direct():
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.direct import all_reduce_direct

    rank = dist.get_rank()
    return rank_helpers.runtime_errors(
        [
            lambda: all_reduce_direct(torch.ones(10 + rank)),
            lambda: (
                all_reduce_direct(torch.ones(4)) if rank == 0 else dist.broadcast(torch.ones(4), 0)
            ),
        ]
    )


def test_mismatches_raise_on_every_rank_naming_both_calls():
    results = run_distributed(
        _mismatched_direct, world_size=2, backend="smddp", fresh=True, pg_timeout=30
    )
    for per_rank in results:
        assert all(m is not None and "mismatched collectives" in m for m in per_rank), per_rank
    assert "all_reduce (Float, SUM, 10 elements)" in results[0][0]
    assert "all_reduce (Float, SUM, 11 elements)" in results[0][0]
    assert "broadcast (Float, 4 elements, root 0)" in results[0][1] + results[1][1]


def _peer_never_calls():
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.direct import all_reduce_direct

    if dist.get_rank() == 0:
        all_reduce_direct(torch.ones(8))
    return "returned"


def test_timeout_names_the_missing_rank():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(
            _peer_never_calls, world_size=2, backend="smddp", fresh=True, pg_timeout=3, timeout=60
        )
    section = str(info.value).split("--- rank 0 ---")[1]
    assert "timed out" in section and "all_reduce" in section and "[1]" in section, section
