"""OpenMPI's mpirun across the two simulated hosts of netns_hosts.py.

``python -m tests.distributed.netns_mpirun {host} DIR -- MPIRUN_ARGS...`` runs on both hosts
(netns_hosts substitutes ``{host}``). Host 1 only holds its namespaces: it records its PID in
``DIR/<address>.pid`` and waits for ``DIR/done``. Host 0 runs OpenMPI's ``mpirun -H <host 0>:2,<host
1>:2 MPIRUN_ARGS...`` with ``netns_rsh_agent.sh`` as mpirun's launch agent (its ``ssh``): for
a remote host the agent enters that host's network, IPC and UTS namespaces by the recorded
PID and starts OpenMPI's daemon there, which starts that host's ranks. Host 0 writes
``DIR/done`` when mpirun exits and exits with mpirun's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.distributed import netns_hosts

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_rsh_agent.sh")
WAIT_S = 600  # host 1 gives up waiting after this long (netns_hosts' timeout comes first)


def main(host: int, work_dir: str, mpirun_args: list[str]) -> int:
    done = os.path.join(work_dir, "done")
    if host == 1:
        pid_file = os.path.join(work_dir, f"{netns_hosts.HOST_ADDRESS.format(2)}.pid")
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return 0
    # Host 0 waits for host 1 to be ready, then runs the job.
    pid_file = os.path.join(work_dir, f"{netns_hosts.HOST_ADDRESS.format(2)}.pid")
    deadline = time.monotonic() + 60
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    hosts = ",".join(f"{netns_hosts.HOST_ADDRESS.format(i + 1)}:2" for i in range(2))
    env = dict(
        os.environ,
        NETNS_PID_DIR=work_dir,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    argv = [
        "mpirun.openmpi",  # OpenMPI's, whichever MPI the `mpirun` alternative points to
        "-H",
        hosts,
        "--mca",
        "plm_rsh_agent",
        AGENT,
        # The daemons talk over the hosts' own link, not loopback.
        "--mca",
        "oob_tcp_if_include",
        "eth0",
        *mpirun_args,
    ]
    try:
        return subprocess.run(argv, env=env).returncode
    finally:
        open(done, "w").close()


if __name__ == "__main__":
    args = sys.argv[1:]
    split = args.index("--")
    sys.exit(main(int(args[0]), args[1], args[split + 1 :]))
