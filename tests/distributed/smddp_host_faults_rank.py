"""Faults between two simulated hosts (netns_hosts.py), one job, five faults in turn.

``python -m tests.distributed.smddp_host_faults_rank HOST OUT`` runs on each host and starts
that host's two ranks (this same module with ``--rank``), which write ``rank<R>.json`` into
OUT. Ranks 0-1 live on host 0, ranks 2-3 on host 1. Each fault hits host 1 during an
all_reduce of its own group, whose timeout is ``FAULT_TIMEOUT_S`` (``BLIP_TIMEOUT_S`` for the
two blips):

1. ``stall``: host 1's ranks are stopped (SIGSTOP) for longer than the timeout while host 0's
   ranks wait for them in the collective, then resumed;
2. ``link``: host 1's link goes down (``ip link set eth0 down`` inside it), and comes back up
   once its ranks have their error;
3. ``silent``: host 1's link is down for a moment (BLIP_S) as a new group makes its first
   connections, in an all_reduce whose timeout is BLIP_TIMEOUT_S. Host 0 knows host 1's
   hardware address, so its connection requests go out and get no answer; that group's
   attempts wait SILENT_ATTEMPT_S each (``connect_attempt_timeout``), and are made again
   until the link is back. Host 1's own attempts find no route. The all_reduce ends well;
4. ``blip``: the same with another new group, but rank 0 has forgotten host 1's address:
   its attempts get no answer to address resolution instead;
5. ``kill``: host 1's ranks are killed (SIGKILL).

Each rank records, for each fault, the error its all_reduce raised and how long it took,
and for ``silent`` and ``blip`` its group's connection attempts that the network did not
carry (``connects_unanswered``, ``connects_unreachable``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

# The job waits out the timeout twice (the stall and the link), so it is kept short; it stays
# above the test's 3 s of slack, so that an error that came at once (the kill) and one that
# waited out the timeout cannot be mistaken for each other.
FAULT_TIMEOUT_S = 4.0
STALL_S = 7.0  # host 0 must give up on host 1 first: 3 s past the timeout, for a loaded machine
RANKS_PER_HOST = 2
# Longer than the kernel takes to give up on a neighbour that does not answer (3 probes, 1 s
# apart), with 3 s to spare for a rank that starts its attempts late on a loaded machine, so
# the attempts made meanwhile fail; and far inside the blip groups' timeout.
BLIP_S = 6.0
BLIP_TIMEOUT_S = 40.0
# Far below the default 20 s: a few of these attempts fit in the blip, which the kernel's own
# retransmissions of one attempt's request (1 s, then 2 s later) would otherwise span.
SILENT_ATTEMPT_S = 1.0
BLIP_PEER = "10.9.0.2"  # host 1's address (tools.netns.HOST_ADDRESS)


def _spawn_host(host: int, out: str) -> int:
    """Starts this host's ranks and waits for them; 0 once each rank wrote its result or was
    killed by the kill fault (host 1's ranks end that way)."""
    procs = []
    for local in range(RANKS_PER_HOST):
        rank = host * RANKS_PER_HOST + local
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(2 * RANKS_PER_HOST),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(RANKS_PER_HOST),
            MASTER_ADDR="10.9.0.1",
            MASTER_PORT="29511",
        )
        procs.append(
            subprocess.Popen([sys.executable, "-m", __spec__.name, "--rank", out], env=env)
        )
    codes = [p.wait(timeout=240) for p in procs]
    expected = [0] * RANKS_PER_HOST if host == 0 else [-signal.SIGKILL] * RANKS_PER_HOST
    print(f"host {host}: rank exit codes {codes}, expected {expected}", flush=True)
    return 0 if codes == expected else 1


def _timed_all_reduce(group, expect: float | None = None) -> dict:
    """An all_reduce of ones on ``group``: its error or None, its seconds, and whether every
    element came out ``expect`` (None: not checked)."""
    import torch
    import torch.distributed as dist

    start = time.monotonic()
    t = torch.ones(1 << 18)
    try:
        dist.all_reduce(t, group=group)
        exact = None if expect is None else bool(torch.all(t == expect))
        return {"error": None, "seconds": time.monotonic() - start, "exact": exact}
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}


def _rank(out: str) -> None:
    import torch
    import torch.distributed as dist

    import torch_sagemaker  # noqa: F401  (registers the smddp backend)
    from torch_sagemaker.smddp import SMDDPOptions

    torch.set_num_threads(1)
    dist.init_process_group("smddp", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    on_host1 = rank >= RANKS_PER_HOST
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    host1_pids = " ".join(str(p) for p in pids[RANKS_PER_HOST:])
    timeout = timedelta(seconds=FAULT_TIMEOUT_S)
    groups = {name: dist.new_group(timeout=timeout) for name in ("stall", "link", "kill")}
    for g in groups.values():
        dist.all_reduce(torch.ones(4), group=g)  # every mesh connection exists now
    # Their connections are made only by their first collectives, during the blips.
    silent = dist.new_group(
        timeout=timedelta(seconds=BLIP_TIMEOUT_S),
        pg_options=SMDDPOptions(connect_attempt_timeout=SILENT_ATTEMPT_S),
    )
    blip = dist.new_group(timeout=timedelta(seconds=BLIP_TIMEOUT_S))
    result: dict = {"pid": os.getpid()}

    # 1. Host 1 stalls: both its ranks are stopped before they join the collective that
    # host 0's ranks wait in, past the timeout, then resumed.
    dist.barrier()
    resumed = os.path.join(out, "host1_resumed")
    if rank == RANKS_PER_HOST:
        os.kill(pids[RANKS_PER_HOST + 1], signal.SIGSTOP)
        subprocess.Popen(
            ["sh", "-c", f"sleep {STALL_S}; touch {resumed}; kill -CONT {host1_pids}"],
            start_new_session=True,
        )
        os.kill(os.getpid(), signal.SIGSTOP)
    elif rank == RANKS_PER_HOST + 1:
        # Stopped while it waits here, never inside the collective: had it begun the
        # all_reduce first, it would wait for rank 2 in shared memory and, resumed past its
        # deadline, time out naming rank 2 before it read host 0's notice.
        deadline = time.monotonic() + 60
        while not os.path.exists(resumed) and time.monotonic() < deadline:
            time.sleep(0.01)
    result["stall"] = _timed_all_reduce(groups["stall"])
    dist.barrier()

    # 2. Host 1's link goes down during the collective, and up once its ranks have an error.
    if rank == RANKS_PER_HOST:
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
    result["link"] = _timed_all_reduce(groups["link"])
    if on_host1:
        # Both of host 1's ranks have their error before the link returns (the other may not
        # notice a link that is back), through the file system the hosts share.
        open(os.path.join(out, f"link_error_{rank}"), "w").close()
        other = os.path.join(out, f"link_error_{2 * RANKS_PER_HOST + 1 - rank}")
        deadline = time.monotonic() + 60
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.01)
        if rank == RANKS_PER_HOST:
            subprocess.run(["ip", "link", "set", "eth0", "up"], check=True)
    dist.barrier()  # the default group's connections outlived the link's absence

    # 3. Host 1's link is down as the silent group's first collective connects. Host 0 knows
    # host 1's address from the start (Note [Static neighbours] in tools/netns.py), so its
    # requests go out, and the switch drops them at host 1's port: no answer.
    _link_down_for_a_blip(out, "silent_down", rank)
    result["silent"] = _timed_all_reduce(silent, expect=dist.get_world_size())
    result["silent"].update(_connect_counts(silent))
    dist.barrier()

    # 4. The same for the blip group, but rank 0's connection to rank 2 must resolve host 1's
    # address first, which the link's absence leaves unanswered: connect() fails with
    # EHOSTUNREACH.
    _link_down_for_a_blip(out, "blip_down", rank)
    if rank == 0:
        subprocess.run(["ip", "neigh", "del", BLIP_PEER, "dev", "eth0"], check=True)
    result["blip"] = _timed_all_reduce(blip, expect=dist.get_world_size())
    result["blip"].update(_connect_counts(blip))
    dist.barrier()
    _write(out, rank, result)
    dist.barrier()  # every rank's first four results are written

    # 5. Host 1's ranks are killed during the collective.
    if rank == RANKS_PER_HOST:
        os.kill(pids[RANKS_PER_HOST + 1], signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    result["kill"] = _timed_all_reduce(groups["kill"])
    _write(out, rank, result)
    os._exit(0)  # the job's other host is gone: skip the collective shutdown


def _link_down_for_a_blip(out: str, name: str, rank: int) -> None:
    """Takes host 1's link down for BLIP_S, and returns on every rank once it is down.

    Every rank learns that through the file system the hosts share, so each connection of
    the collective it starts next is first tried without the link.
    """
    down = os.path.join(out, name)
    if rank == RANKS_PER_HOST:
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
        subprocess.Popen(
            ["sh", "-c", f"sleep {BLIP_S}; ip link set eth0 up"], start_new_session=True
        )
        open(down, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(down) and time.monotonic() < deadline:
        time.sleep(0.01)


def _connect_counts(group: Any) -> dict:
    """The group's connection attempts that the network did not carry, by how they ended."""
    import torch

    from torch_sagemaker._torch_compat import c10d as c10d_compat

    stats = c10d_compat.backend_of(group, torch.device("cpu"))._transport_stats()
    return {k: stats[k] for k in ("connects_unanswered", "connects_unreachable")}


def _write(out: str, rank: int, result: dict) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        _rank(sys.argv[2])
    else:
        sys.exit(_spawn_host(int(sys.argv[1]), sys.argv[2]))
