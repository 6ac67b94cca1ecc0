"""One simulated host of ``bench multihost``: records its TCP settings and starts its ranks.

``python -m tools.bench_host HOST SPEC`` runs once in each host's namespaces (tools.netns
starts it there) and only waits for its ranks, which run ``benchmarks.multihost --rank-spec``.

Note [A light host process]
Every simulated host of a layout runs this process beside its ranks, all on one machine. As
part of the benchmarks package it imported torch (that package's ``__init__`` does), about
160 MB a host: on 64 hosts of one rank, 10 GB before the first rank had started, and the job
filled the machine's 24 GiB (Note [Memory floor] in tools/netns.py). So it imports the
standard library and tools.netns only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tools import netns

MASTER_PORT = 29530  # inside the hosts' private network
RANK_MODULE = "benchmarks.multihost"  # run with --rank-spec


def host_settings() -> dict[str, str]:
    """This host's TCP settings that the benchmark sets, read back from its own namespace."""
    settings = {"congestion": " ".join(netns.congestion_settings())}
    try:
        with open("/proc/sys/net/ipv4/tcp_slow_start_after_idle") as f:
            settings["slow_start_after_idle"] = f.read().strip()
    except OSError:
        settings["slow_start_after_idle"] = "unknown"
    return settings


def run_host(host: int, spec: dict[str, Any]) -> int:
    """Writes this host's settings beside ``spec["out"]``, runs its ranks, returns 0 if all did.

    Args:
        host: This host's index.
        spec: The job's spec (benchmarks.multihost.run_layout): ``hosts``, ``local``, ``out``,
            ``timeline``, and what the ranks read.
    """
    # What this host's TCP runs, as the kernel says, for the run's record (Note [Simulated
    # hosts run cubic] in tools/netns.py): the driver reads one file per host.
    with open(f"{spec['out']}.host{host}", "w") as f:
        json.dump(host_settings(), f)
    procs = []
    for local in range(spec["local"]):
        env = dict(
            os.environ,
            RANK=str(host * spec["local"] + local),
            WORLD_SIZE=str(spec["hosts"] * spec["local"]),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(spec["local"]),
            MASTER_ADDR=netns.HOST_ADDRESS.format(1),
            MASTER_PORT=str(MASTER_PORT),
            OMP_NUM_THREADS="1",
        )
        if spec.get("timeline"):
            env["SMDDP_TIMELINE"] = "1"
        env.pop("SMDDP_FORCE_LOCAL_SIZE", None)
        argv = [sys.executable, "-m", RANK_MODULE, "--rank-spec", json.dumps(spec)]
        procs.append(subprocess.Popen(argv, env=env))
    codes = [p.wait() for p in procs]
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(run_host(int(sys.argv[1]), json.loads(sys.argv[2])))
