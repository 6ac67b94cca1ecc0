"""smddp when a rank is killed or stopped during set-up: its /dev/shm segment is removed (by
its peer, by the next job, or on SIGTERM), and a peer that stalls before its first TCP
message is waited for. Each test here failed before the change it guards (crash, hang, leak
or silent success)."""

import os
import signal
import time

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.smddp_rank_helpers import RecordingStore
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


# --- /dev/shm segments of ranks killed during set-up ---------------------------------------


def _member(rank, store_port, block, report):
    """A rank that creates the default group over a store; with ``block``, it stops for good
    right after publishing its segment (killed there by the test). Reports go through a pipe
    of its own: a killed rank must not hold a lock that others need to report."""
    import traceback
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    import torch.distributed as dist

    import torch_sagemaker  # noqa: F401

    def nonce_of(store):
        nonce = [
            v.decode().split(":")[0] for k, v in store.seen.items() if k.endswith("smddp/keys")
        ]
        return nonce[0] if nonce else ""

    def stop_here():
        report.send(("blocked", nonce_of(store)))
        time.sleep(3600)

    store = RecordingStore.create(
        "127.0.0.1",
        store_port,
        2,
        False,
        block_on=(f"smddp/shm/{rank}", stop_here) if block else None,
    )
    start = time.monotonic()
    try:
        dist.init_process_group(
            "smddp", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=40)
        )
        report.send(("created", ""))
    except Exception:
        report.send(("error", f"{traceback.format_exc()} [after {time.monotonic() - start:.1f} s]"))
    report.send(("nonce", nonce_of(store)))


def _segments_with(nonce):
    return [f for f in os.listdir("/dev/shm") if f.startswith("smddp_") and nonce in f]


def _start_members(blocked, kill_with):
    """Starts 2 ranks; ``blocked`` ones stop inside set-up and are killed with ``kill_with``
    once every blocked rank is there. Returns what the ranks reported: {kind: {rank: value}}."""
    import multiprocessing as mp
    from datetime import timedelta
    from multiprocessing.connection import wait

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    server = dist.TCPStore(
        "127.0.0.1", 0, 3, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_member, args=(r, server.port, r in blocked, pipes[r][1]), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = {}

    def receive(timeout):
        for conn in wait([pipes[0][0], pipes[1][0]], timeout=timeout):
            try:
                kind, value = conn.recv()
            except EOFError:
                continue
            got.setdefault(kind, {})[0 if conn is pipes[0][0] else 1] = value

    deadline = time.monotonic() + 240
    while set(got.get("blocked", {})) != set(blocked) and time.monotonic() < deadline:
        receive(5)
    assert set(got.get("blocked", {})) == set(blocked), got
    for r in blocked:
        os.kill(procs[r].pid, kill_with)
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        receive(1)
    receive(0)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    del server
    return got


def test_a_rank_killed_during_set_up_is_cleaned_up_by_its_peer():
    got = _start_members(blocked={1}, kill_with=signal.SIGKILL)
    error = got["error"][0]
    assert "rank 1" in error and "exited during set-up" in error, error
    assert float(error.rsplit("[after ", 1)[1].split(" s]")[0]) < 30, error
    nonce = got["nonce"][0]
    assert nonce and _segments_with(nonce) == [], _segments_with(nonce)


def _one_rank_group():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_segments_of_a_job_killed_during_set_up_are_removed_by_the_next_job():
    got = _start_members(blocked={0, 1}, kill_with=signal.SIGKILL)
    nonce = got["blocked"][0]
    leftover = _segments_with(nonce)
    assert nonce and len(leftover) == 2, leftover  # nobody was left to remove them
    assert run_distributed(_one_rank_group, world_size=1, backend="smddp", fresh=True) == [1.0]
    assert _segments_with(nonce) == []


def test_sigterm_during_set_up_removes_the_segment():
    got = _start_members(blocked={0, 1}, kill_with=signal.SIGTERM)
    nonce = got["blocked"][0]
    assert nonce and _segments_with(nonce) == [], _segments_with(nonce)


def _first_message_to_a_stopped_peer(op):
    """Rank 1 stops itself (SIGSTOP) for 3 s right after a new group is made, before the
    first message over the TCP mesh: rank 0's connection is not answered for longer than
    a handshake may take (2 s). The group's timeout is 60 s."""
    import subprocess

    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    me = dist.get_rank()
    group = dist.new_group([0, 1], pg_options=SMDDPOptions(timeout=60))
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    resume = None
    if me == 1:
        resume = subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until rank 1 is stopped ("T" in /proc)
            with open(f"/proc/{pids[1]}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.01)
    n = 1 << 20
    try:
        return _send_or_reduce(op, me, group, n)
    finally:
        if resume is not None:
            resume.wait()


def _send_or_reduce(op, me, group, n):
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        x = torch.ones(n)
        dist.all_reduce(x, group=group)
        return x[0].item()
    if me == 0:
        dist.send(torch.ones(n), 1, group=group)
        return "sent"
    x = torch.zeros(n)
    dist.recv(x, 0, group=group)
    return x.sum().item()


@pytest.mark.parametrize("op", ["send", "all_reduce"])
def test_a_peer_that_stalls_before_the_first_tcp_message_is_waited_for(op):
    # Before: the connecting rank gave up after the 2 s handshake limit ("its listener did
    # not answer the handshake"), whatever the group's timeout; gloo waits.
    results = run_distributed(
        _first_message_to_a_stopped_peer,
        op,
        backend="smddp",
        env={"SMDDP_FORCE_LOCAL_SIZE": "1"},
        timeout=120,
    )
    assert results == ([2.0, 2.0] if op == "all_reduce" else ["sent", float(1 << 20)])
