"""smddp's per-process resources stay bounded as process groups multiply (Note [One transport
per process] in csrc/smddp/backend/work.h): threads, file descriptors and /dev/shm bytes after 64
groups are those after 4 groups plus a small allowance. Before that change, 4 ranks went from
5 to 43 threads, 29 to 67 fds and 21 to 228 MB of /dev/shm per rank between 4 and 64 groups."""

import os
import time

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

# Members of the groups, cycled: world-sized, pairs, overlapping triples.
_PATTERNS = [[0, 1, 2, 3], [0, 1], [2, 3], [1, 2], [0, 3], [0, 1, 2], [1, 2, 3], [0, 2]]
# Allowances from 4 to 64 groups: worker threads that finish their lane's work linger a
# moment, a descriptor may be open while a segment is set up, and a group's segment still
# costs its control page and the pages its collectives touched (small messages here).
_THREADS = 2
_FDS = 2
_SHM_PER_GROUP_PEER = 64 << 10


def _resources():
    """Threads, open fds, and the smddp segments this process maps: bytes committed in
    /dev/shm (each distinct segment once) and bytes of address space."""
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    fds = len(os.listdir("/proc/self/fd"))
    committed, mapped, seen = 0, 0, set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 6 or "/smddp_" not in fields[5]:
                continue
            start, end = fields[0].split("-")
            mapped += int(end, 16) - int(start, 16)
            inode = (fields[3], fields[4])
            if inode in seen:
                continue
            seen.add(inode)
            # The segments are unlinked once mapped; map_files still reaches the file.
            st = os.stat(f"/proc/self/map_files/{start}-{end}")
            committed += st.st_blocks * 512
    return {"threads": threads, "fds": fds, "shm": committed, "mapped": mapped}


def _settle(bound):
    """Resources once the worker threads of finished work had time to exit (at most 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        r = _resources()
        if bound is None or r["threads"] <= bound or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _use(groups, first, p2p=True):
    """Runs collectives on every group this rank belongs to and checks their results."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    works = []
    for k, (g, ranks) in enumerate(groups, start=first):
        if g is None:
            continue
        t = torch.full((16,), float(me + k))
        works.append((dist.all_reduce(t, group=g, async_op=True), t, sum(r + k for r in ranks)))
    for w, t, want in works:  # all issued before any is waited for: lanes run concurrently
        w.wait()
        assert t.eq(want).all(), (t, want)
    for k, (g, ranks) in enumerate(groups, start=first):
        if g is None:
            continue
        out = torch.empty(len(ranks) * 8)
        dist.all_gather(list(out.chunk(len(ranks))), torch.full((8,), float(me * 100 + k)), group=g)
        assert out.view(len(ranks), 8)[:, 0].tolist() == [float(r * 100 + k) for r in ranks]
        if p2p and len(ranks) == 2:
            peer = ranks[1 - ranks.index(me)]
            got = torch.empty(4)
            reqs = [
                dist.isend(torch.full((4,), float(me + k)), peer, group=g),
                dist.irecv(got, peer, group=g),
            ]
            for r in reqs:
                r.wait()
            assert got.eq(peer + k).all()


def _grow(patterns=_PATTERNS, few=4, many=64, p2p=True):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    before = _settle(None)
    groups = []

    def add(n):
        new = []
        for i in range(len(groups), len(groups) + n):
            ranks = patterns[i % len(patterns)]
            new.append((dist.new_group(ranks), ranks))
        groups.extend((g if dist.get_rank() in r else None, r) for g, r in new)
        _use(groups[-n:], len(groups) - n, p2p)

    add(few)
    dist.barrier()
    at4 = _settle(before["threads"] + _THREADS)
    add(many - few)
    dist.barrier()
    at64 = _settle(at4["threads"] + _THREADS)
    member_of = sum(g is not None for g, _ in groups)
    peers = sum(len(r) for g, r in groups if g is not None)
    return {
        "before": before,
        "at4": at4,
        "at64": at64,
        "member_of": member_of,
        "peers": peers,
        "pid": os.getpid(),
    }


def test_threads_fds_and_shm_bytes_stay_bounded_as_groups_multiply():
    results = run_distributed(_grow, world_size=4, backend="smddp", fresh=True, timeout=300)
    for rank, r in enumerate(results):
        print(f"rank {rank}: before {r['before']} at 4 groups {r['at4']} at 64 groups {r['at64']}")
    for rank, r in enumerate(results):
        at4, at64 = r["at4"], r["at64"]
        assert at64["threads"] <= at4["threads"] + _THREADS, (rank, at4, at64)
        assert at64["fds"] <= at4["fds"] + _FDS, (rank, at4, at64)
        # Each segment of a peer of each new group may cost its touched pages, never its
        # buffers' full size (2 x 1 MiB by default).
        allowance = r["peers"] * _SHM_PER_GROUP_PEER
        assert at64["shm"] <= at4["shm"] + allowance, (rank, at4, at64, allowance)


def test_groups_across_hosts_share_one_acceptor_thread():
    # Every rank its own "host": each group listens and talks over the TCP mesh. Its
    # connections cost descriptors (one per peer and direction, and a port), but no thread.
    results = run_distributed(
        _grow,
        [[0, 1]],
        2,
        16,
        False,
        world_size=2,
        backend="smddp",
        fresh=True,
        timeout=300,
        env={"SMDDP_FORCE_LOCAL_SIZE": "1"},
    )
    for rank, r in enumerate(results):
        print(f"rank {rank}: at 2 groups {r['at4']} at 16 groups {r['at64']}")
        assert r["at64"]["threads"] <= r["at4"]["threads"] + _THREADS, (rank, r)
