"""Synchronous smddp collectives complete in the caller's thread and return no Work (Note
[Synchronous calls return no Work] in csrc/smddp/backend/backend.cpp); everything that needs a
Work still gets one, and the results and their order are those of the asynchronous calls."""

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _calls():
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        BroadcastOptions,
        ReduceScatterOptions,
        _set_allow_inflight_collective_as_graph_input,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    total = sum(range(1, world + 1))
    seen = {}

    def opts_of(cls, async_op):
        o = cls()
        o.asyncOp = async_op
        return o

    for async_op in (False, True):
        t = torch.full((1000,), float(rank + 1))
        w1 = pg.allreduce([t], opts_of(AllreduceOptions, async_op))
        b = torch.full((7,), float(rank))
        w2 = pg.broadcast([b], opts_of(BroadcastOptions, async_op))
        g = torch.empty(3 * world)
        w3 = pg._allgather_base(
            g, torch.full((3,), float(rank)), opts_of(AllgatherOptions, async_op)
        )
        rs = torch.empty(2)
        w4 = pg._reduce_scatter_base(
            rs, torch.ones(2 * world) * (rank + 1), opts_of(ReduceScatterOptions, async_op)
        )
        c = [torch.ones(5) * (rank + 1), torch.ones(9) * (rank + 1)]
        w5 = pg.allreduce_coalesced(c, opts_of(AllreduceCoalescedOptions, async_op))
        works = [w1, w2, w3, w4, w5]
        for w in works:
            if w is not None:
                w.wait()
        seen[async_op] = [w is None for w in works]
        assert torch.equal(t, torch.full((1000,), float(total)))
        assert torch.equal(b, torch.zeros(7))
        assert torch.equal(g, torch.arange(world).repeat_interleave(3).float())
        assert torch.equal(rs, torch.full((2,), float(total)))
        assert all(torch.equal(x, torch.full_like(x, float(total))) for x in c)

    # A synchronous call behind asynchronous ones runs after them (with a Work or without).
    big = torch.full((1 << 20,), float(rank + 1))
    works = [dist.all_reduce(big, async_op=True) for _ in range(3)]
    small = torch.full((4,), float(rank + 1))
    dist.all_reduce(small)
    assert all(w.is_completed() for w in works)
    assert torch.equal(big, torch.full_like(big, float(total * world * world)))
    assert torch.equal(small, torch.full_like(small, float(total)))

    # Coalesced synchronous calls (the parts complete inline).
    outs = [torch.empty(2 * world), torch.empty(3 * world)]
    with dist._coalescing_manager():
        for o, n in zip(outs, (2, 3)):
            dist.all_gather_into_tensor(o, torch.full((n,), float(rank)))
    assert all(
        torch.equal(o, torch.arange(world).repeat_interleave(o.numel() // world).float())
        for o in outs
    )

    # With in-flight collectives as graph inputs on, c10d registers the Work with the output.
    _set_allow_inflight_collective_as_graph_input(True)
    try:
        t = torch.ones(4)
        w = pg.allreduce([t], opts_of(AllreduceOptions, False))
        inflight_work = w is not None
        w.wait()
    finally:
        _set_allow_inflight_collective_as_graph_input(False)
    assert torch.equal(t, torch.full((4,), float(world)))
    return seen, inflight_work


def test_sync_calls_return_no_work_and_async_calls_do():
    for seen, inflight_work in run_distributed(_calls, world_size=2, backend="smddp"):
        assert seen[False] == [True] * 5, seen  # every synchronous call completed inline
        assert seen[True] == [False] * 5, seen  # every asynchronous call has its Work
        assert inflight_work
