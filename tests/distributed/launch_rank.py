"""One rank of a launcher test (tests/distributed/test_launchers.py): started by mpirun, srun,
torchrun or with exactly the variables one of them sets, never with RANK given by the test.

It does what SMP's scripts do: ``import smdistributed.dataparallel.torch.torch_smddp``, then
``dist.init_process_group("smddp")`` with no arguments, then ``tsm.init`` with hybrid sharding
(``--smp-config``, default ``{"hybrid_shard_degree": 2}``). It writes ``rank<R>.json`` into
the directory given as its argument: what the launcher said, what ``torch.distributed`` and
``tsm.state`` report, the members of the hybrid-sharding groups, smddp's host layout and the
result of an all_reduce.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_sagemaker import launch_env

# What the launcher gave this process, read before the smddp import exports anything.
LAUNCHER_ENV = {
    k: v
    for k, v in os.environ.items()
    if k.startswith(("OMPI_COMM_WORLD_", "PMI_", "MPI_LOCAL", "SLURM_", "SM_", "SMDATAPARALLEL_"))
    or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
}
LAUNCHER_INFO = launch_env.detect()

import torch.sagemaker as tsm  # noqa: E402

import smdistributed.dataparallel.torch.torch_smddp  # noqa: E402, F401  (as SMP's scripts do)
from torch_sagemaker.smddp import backend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--smp-config", default='{"hybrid_shard_degree": 2}')
    parser.add_argument(
        "--init-group",
        choices=("script", "tsm"),
        default="script",
        help="script: init_process_group('smddp') as SMP's scripts do; tsm: tsm.init alone",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = LAUNCHER_INFO
    assert info is not None, "no launcher variables"
    if args.init_group == "script":
        dist.init_process_group("smddp", timeout=timedelta(seconds=60))
    tsm.init(json.loads(args.smp_config))
    world = dist.get_world_size()
    # An exact sum: every rank contributes rank + 1 in float64, within 2^53.
    total = torch.full((1000,), float(dist.get_rank() + 1), dtype=torch.float64)
    dist.all_reduce(total)
    result = {
        "launcher": info.launcher,
        "launcher_view": {
            "rank": info.rank,
            "world_size": info.world_size,
            "local_rank": info.local_rank,
            "local_world_size": info.local_world_size,
            "node_rank": info.node_rank,
            "master_addr": info.master_addr,
            "master_port": info.master_port,
            "sources": dict(info.sources),
        },
        "dist": {"rank": dist.get_rank(), "world_size": world, "backend": dist.get_backend()},
        "state": {
            "rank": tsm.state.rank,
            "world_size": tsm.state.world_size,
            "local_rank": tsm.state.local_rank,
            "local_world_size": tsm.state.local_world_size,
            "hybrid_shard_degree": tsm.state.hybrid_shard_degree,
        },
        "shard_group": dist.get_process_group_ranks(tsm.state.fsdp_shard_process_group),
        "replicate_group": dist.get_process_group_ranks(tsm.state.fsdp_replicate_process_group),
        "all_reduce": {"min": total.min().item(), "max": total.max().item()},
        "expected_sum": world * (world + 1) / 2,
        "smddp_layout": backend.group_layout(),
        "hostname": os.uname().nodename,
        "launcher_env": LAUNCHER_ENV,
    }
    path = os.path.join(args.out_dir, f"rank{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
