"""One rank of the two-host smddp test (run by torchrun on each simulated host; see
netns_hosts.py). Writes ``rank<R>.json`` into the directory given as its argument.

First every collective check of smddp_checks runs on the real two-host layout; then
rank 3 (on the second host) exits without a word and the other ranks time how long an
all_reduce takes to fail.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_sagemaker  # noqa: F401  (registers the smddp backend)
from tests.distributed import smddp_checks as checks
from torch_sagemaker.smddp import backend

PG_TIMEOUT_S = 60
STAY_ALIVE_S = 30  # at most: each survivor leaves as soon as all three have their error


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("smddp", timeout=timedelta(seconds=PG_TIMEOUT_S))
    rank = dist.get_rank()
    result = {"layout": backend.group_layout(), "hostname": os.uname().nodename}
    result["counts"] = checks.run_all(quick=True)
    result["async_two_groups"] = checks.check_async_two_groups(rounds=10)
    result["object_rounds"] = check_object_collectives(rounds=30)
    dist.barrier()

    if rank == 3:  # dies between collectives, as a crashed host would
        _write(out_dir, rank, result)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
        result["fault"] = {"error": None}
    except RuntimeError as e:
        result["fault"] = {"error": str(e), "seconds": time.monotonic() - start}
    _write(out_dir, rank, result)
    # Stay alive, as a process that handles the error would, until ranks 0-2 all have their
    # error (each has written its result): the others must learn of the failure from the
    # group, not from this process closing its connections.
    deadline = time.monotonic() + STAY_ALIVE_S
    survivors = [os.path.join(out_dir, f"rank{r}.json") for r in range(3)]
    while not all(map(os.path.exists, survivors)) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)  # the group is broken: skip the collective shutdown


def check_object_collectives(rounds: int) -> int:
    """DCP's planning pattern (all_gather, gather to rank 0, broadcast, scatter of objects):
    ranks whose root is on another host run some of these without a shared-memory step and
    so run ahead of their host's peers, which a collective's mismatch check must allow."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for i in range(rounds):
        gathered = [None] * world
        dist.all_gather_object(gathered, (rank, i))
        assert gathered == [(r, i) for r in range(world)], gathered
        at_root = [None] * world if rank == 0 else None
        dist.gather_object({"rank": rank, "round": i}, at_root, dst=0)
        if rank == 0:
            assert at_root == [{"rank": r, "round": i} for r in range(world)], at_root
        plan = [[r * i for r in range(world)]] if rank == 0 else [None]
        dist.broadcast_object_list(plan, src=0)
        assert plan[0] == [r * i for r in range(world)], plan
        mine: list = [None]
        dist.scatter_object_list(mine, plan[0] if rank == 0 else None, src=0)
        assert mine[0] == rank * i, mine
    return rounds


def _write(out_dir: str, rank: int, result: dict) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1])
