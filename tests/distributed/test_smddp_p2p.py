"""smddp point-to-point: send/recv/isend/irecv/batch_isend_irecv over the shared-memory
rings (tiny rings too, so messages wrap, stream and get stashed), over TCP, and across
forced hosts; every payload bit-exact; faults end in clear errors."""

import time

import pytest

from tests.distributed import smddp_rank_helpers as rank_helpers
from tests.distributed import smddp_reference as reference
from tests.distributed.launcher import DistributedTestError, run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _payload(src: int, n: int, dtype, salt: int):
    return reference.make_input(src, n, dtype, salt)


# Set by rank 0 once its send larger than the ring is posted; rank 1 waits for it before
# posting the matching recv (the "receiver that comes late" case of _p2p_cases).
_LATE_KEY = "test_p2p/late-send-posted"


def _p2p_cases(expect_eager: bool) -> int:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    store = dist.distributed_c10d._get_default_store()
    checked = 0
    # Ring exchange, every dtype, sizes from empty to larger than the default ring (1 MiB + 64 KiB).
    for dtype in reference.ALL_DTYPES:
        for n in (0, 1, 7, 1031, 300007):
            out = torch.empty(n, dtype=dtype)
            ops = [
                dist.P2POp(dist.irecv, out, prv),
                dist.P2POp(dist.isend, _payload(rank, n, dtype, n), nxt),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            assert reference.same(out, _payload(prv, n, dtype, n)), (dtype, n)
            checked += 1
    # Non-contiguous send and receive tensors.
    src = torch.arange(6000, dtype=torch.float64).reshape(60, 100) + rank
    out = torch.zeros(100, 60, dtype=torch.float64).t()
    reqs = [dist.isend(src[:, ::1].t().contiguous().t(), nxt), dist.irecv(out, prv)]
    for w in reqs:
        w.wait()
    assert torch.equal(out, torch.arange(6000, dtype=torch.float64).reshape(60, 100) + prv)
    checked += 1

    # Once the rings are drained, a small isend over shared memory is buffered in its ring
    # and complete at once.
    dist.barrier()
    if rank == 0:
        w = dist.isend(torch.ones(16), 1, tag=5)
        if expect_eager:  # over TCP (no ring) it may have gone out yet or not: no claim
            assert w.is_completed(), "a small isend over shared memory completes at once"
        w.wait()
    elif rank == 1:
        one = torch.empty(16)
        dist.recv(one, 0, tag=5)
        assert torch.equal(one, torch.ones(16))

    if rank == 0:
        # Tags out of order: the large first message must be moved aside, not lost.
        big, small = _payload(0, 700001, torch.float32, 1), _payload(0, 5, torch.int64, 2)
        dist.send(big, 1, tag=1)
        dist.send(small, 1, tag=2)
        # Many back-to-back sends: more than the ring holds, read in order.
        works = [dist.isend(torch.full((10000,), float(i)), 1, tag=3) for i in range(60)]
        for w in works:
            w.wait()
        # A send larger than the ring to a receiver that comes late: the send is posted (the
        # ring fills and the sender waits for space) before rank 1 posts its recv, which the
        # store key orders; no sleep. It cannot complete before that recv: 2.4 MB exceed
        # the ring, so the eager path (Note [Eager point-to-point]) cannot take it.
        late = dist.isend(_payload(0, 600000, torch.float32, 4), 1, tag=4)
        if expect_eager:  # over TCP the socket buffers may take all of it at once: no claim
            assert not late.is_completed(), "a send larger than its ring"
        store.set(_LATE_KEY, "posted")
        late.wait()
        dist.send(torch.ones(16), 1, tag=5)
        # Interleaved with a collective.
        dist.isend(torch.full((3,), 7.0), 1, tag=6).wait()
        t = torch.ones(4)
        dist.all_reduce(t)
        checked += 5
    elif rank == 1:
        small, big = torch.empty(5, dtype=torch.int64), torch.empty(700001)
        w_small = dist.irecv(small, 0, tag=2)
        w_big = dist.irecv(big, 0, tag=1)
        w_small.wait()
        w_big.wait()
        assert reference.same(small, _payload(0, 5, torch.int64, 2))
        assert reference.same(big, _payload(0, 700001, torch.float32, 1))
        for i in range(60):
            got = torch.empty(10000)
            dist.recv(got, 0, tag=3)
            assert torch.equal(got, torch.full((10000,), float(i))), i
        store.wait([_LATE_KEY])  # rank 0 has posted the tag-4 send
        store.delete_key(_LATE_KEY)  # before the final barrier: the pool's next call starts clean
        late = torch.empty(600000)
        dist.recv(late, 0, tag=4)
        assert reference.same(late, _payload(0, 600000, torch.float32, 4))
        one = torch.empty(16)
        dist.recv(one, 0, tag=5)
        assert torch.equal(one, torch.ones(16))
        t = torch.ones(4)
        dist.all_reduce(t)
        got = torch.empty(3)
        dist.recv(got, 0, tag=6)
        assert torch.equal(got, torch.full((3,), 7.0)) and torch.equal(
            t, torch.full((4,), float(world))
        )
        checked += 5
    else:
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    return checked


@pytest.mark.parametrize(
    "world_size, env, eager",
    [
        (3, {}, True),
        (3, {"SMDDP_P2P_BYTES": "4096"}, True),  # one-page rings: wrap, stream, stash
        (3, {"SMDDP_P2P_BYTES": "0"}, False),  # no rings: everything over TCP (may be quick too)
        (4, {"SMDDP_FORCE_LOCAL_SIZE": "2"}, True),  # pairs inside and across forced hosts
    ],
    ids=["shm", "shm-one-page-rings", "tcp", "forced-hosts"],
)
def test_p2p_matches_payload_bit_for_bit(world_size, env, eager):
    results = run_distributed(
        _p2p_cases, eager, world_size=world_size, backend="smddp", env=env, timeout=300
    )
    assert results[0] == results[1] == 5 * len(reference.ALL_DTYPES) + 1 + 5


def _any_source_and_coalesced():
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sources = {}
    # Every other rank sends rank 0 one message with tag 11, then one with tag 12; rank 0
    # takes the tag-12 ones first (the tag-11 ones are in the way), from whoever has one.
    if rank == 0:
        for tag in (12, 11):
            got = []
            for k in range(world - 1):
                t = torch.empty(5)
                if k % 2:
                    src = dist.recv(t, tag=tag)
                else:
                    work = dist.irecv(t, tag=tag)
                    work.wait()
                    src = work._source_rank()
                assert torch.equal(t, torch.full((5,), float(100 * src + tag))), (tag, src, t)
                got.append(src)
            sources[tag] = sorted(got)
    else:
        for tag in (11, 12):
            dist.send(torch.full((5,), float(100 * rank + tag)), 0, tag=tag)
    # c10d's all_gather_coalesced: outputs[r][i] is input i of rank r.
    inputs = [torch.full((3,), float(rank)), torch.arange(4.0).reshape(2, 2) + 10 * rank]
    outputs = [[torch.empty(3), torch.empty(2, 2)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    for r in range(world):
        assert torch.equal(outputs[r][0], torch.full((3,), float(r)))
        assert torch.equal(outputs[r][1], torch.arange(4.0).reshape(2, 2) + 10 * r)
    dist.barrier()
    return sources


@pytest.mark.parametrize(
    "world_size, env",
    [(3, {}), (3, {"SMDDP_P2P_BYTES": "0"}), (4, {"SMDDP_FORCE_LOCAL_SIZE": "2"})],
    ids=["shm", "tcp", "forced-hosts"],
)
def test_recv_from_any_rank_and_all_gather_coalesced(world_size, env):
    results = run_distributed(
        _any_source_and_coalesced, world_size=world_size, backend="smddp", env=env, timeout=300
    )
    others = list(range(1, world_size))
    assert results[0] == {11: others, 12: others}


def _p2p_faults():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    messages = []
    # A fresh group per case: a failed send/recv poisons its group.
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=2)) for _ in range(2)]
    if rank == 0:
        start = time.monotonic()
        messages += rank_helpers.runtime_errors(
            [lambda: dist.recv(torch.empty(4), 1, group=groups[0], tag=9)]
        )
        messages.append(time.monotonic() - start)
    else:
        time.sleep(2.5)  # never sends; rank 0 waits in the recv until its 2 s timeout
    dist.barrier()
    if rank == 0:
        messages += rank_helpers.runtime_errors(
            [lambda: dist.recv(torch.empty(4), 1, group=groups[1])]
        )  # size
    else:
        dist.send(torch.ones(6), 0, group=groups[1])
    dist.barrier()
    return messages


def test_p2p_faults_raise_clear_errors_within_the_timeout():
    results = run_distributed(
        _p2p_faults, world_size=2, backend="smddp", fresh=True, pg_timeout=2, timeout=120
    )
    timeout_msg, timeout_s, size_msg = results[0]
    assert (
        "recv" in timeout_msg and "timed out after 2.0 s" in timeout_msg and "rank 1" in timeout_msg
    )
    assert 1.5 < timeout_s < 10
    assert "24 bytes but this recv expects 16" in size_msg


def _p2p_dead_peer():
    import os

    import torch
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)
        os._exit(3)
    return rank_helpers.raise_with_elapsed(lambda: dist.recv(torch.empty(4), 1))  # rank 1 is gone


def test_p2p_dead_peer_raises_quickly():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_p2p_dead_peer, world_size=2, backend="smddp", fresh=True, pg_timeout=60)
    section, elapsed = rank_helpers.rank_failure(str(info.value), 0)
    assert "RuntimeError" in section and "recv" in section and "rank 1 exited" in section, section
    assert elapsed < 20, section
