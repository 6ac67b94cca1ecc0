"""A real SLURM cluster on the two simulated hosts of netns_hosts.py, for launcher tests.

``python -m tests.distributed.slurm_cluster {host} DIR -- SRUN_ARGS... [--- SRUN_ARGS...]``
runs on both hosts (netns_hosts substitutes ``{host}``). Each host starts ``slurmd`` under its
own name (``smddp-host-<i>``, which the hosts' private /etc/hosts resolves); host 0 also
starts ``slurmctld``, waits until both nodes are idle, runs ``srun SRUN_ARGS`` once per
``---``-separated group, then writes ``DIR/done`` and exits with the first failing srun's
status. Host 1 waits for ``DIR/done``. The daemons stop with their hosts.

Authentication is ``auth/none`` and ``cred/none`` (Slurm 22.05 still ships them; no munge
daemon or key is needed), the daemons run as the namespace's root, and every port is on the
hosts' private link. The daemons run in the foreground as children of this process, which
stops them before it exits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from tests.distributed import netns_hosts

READY_S = 120  # slurmctld and both slurmd up and the nodes idle, at most
WAIT_S = 600  # host 1 gives up waiting after this long (netns_hosts' timeout comes first)

_CONF = """\
ClusterName=tsmtest
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={dir}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName={nodes} CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def unavailable_reason() -> str | None:
    """Why a SLURM cluster cannot run here, or None when it can."""
    for tool in ("slurmctld", "slurmd", "srun", "sinfo"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (Debian: apt-get install slurm-wlm)"
    return netns_hosts.unavailable_reason()


# Note [A short spool path]: each job step's daemon (slurmstepd) listens on a Unix socket in
# SlurmdSpoolDir, and a socket's path holds at most 108 bytes. Under pytest's temporary
# directory it took 109 once the machine's pytest session counter reached three digits
# (/tmp/pytest-of-root/pytest-117/popen-gw0/test_real_srun_one_and_two_hos0/spool-smddp-
# host-0/smddp-host-0_1.0): every step's daemon then exited at start-up ("_create_socket:
# Unix socket path ... is too long" in the slurmd log, "slurmstepd failed to send return
# code" on the console) and srun failed, in full runs under xdist only (a test run alone has
# no popen-gw0 in its path). So the spool directories live in a short directory of their own.
_SPOOL_FILE = "spool_root"  # in DIR: where write_conf put the spool directories


def write_conf(work_dir: str) -> str:
    """Writes ``DIR/slurm.conf`` for the two hosts; returns its path.

    The slurmd spool directories go to a short new directory under the system's temporary
    directory (Note [A short spool path]); ``remove_spool(DIR)`` deletes it.
    """
    names = [netns_hosts.HOST_NAME.format(i) for i in range(2)]
    path = os.path.join(work_dir, "slurm.conf")
    os.makedirs(os.path.join(work_dir, "state"), exist_ok=True)
    spool = tempfile.mkdtemp(prefix="slurm-")
    with open(os.path.join(work_dir, _SPOOL_FILE), "w") as f:
        f.write(spool)
    with open(path, "w") as f:
        f.write(_CONF.format(controller=names[0], dir=work_dir, spool=spool, nodes=",".join(names)))
    return path


def remove_spool(work_dir: str) -> None:
    """Deletes the spool directories ``write_conf(work_dir)`` made."""
    with open(os.path.join(work_dir, _SPOOL_FILE)) as f:
        shutil.rmtree(f.read(), ignore_errors=True)


def main(host: int, work_dir: str, sruns: list[list[str]]) -> int:
    conf = os.path.join(work_dir, "slurm.conf")
    env = dict(os.environ, SLURM_CONF=conf)
    name = netns_hosts.HOST_NAME.format(host)
    done = os.path.join(work_dir, "done")
    # In the foreground (-D), as children: a daemon that forked away would outlive the test.
    daemons = []
    try:
        if host == 0:
            daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", conf], env=env))
        daemons.append(subprocess.Popen(["slurmd", "-D", "-f", conf, "-N", name], env=env))
        if host == 1:
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.1)
            return 0
        try:
            _wait_idle(env, daemons)
            status = 0
            for args in sruns:
                code = subprocess.run(["srun", *args], env=env).returncode
                print(f"srun {' '.join(args)}: exit status {code}", flush=True)
                status = status or code
            return status
        finally:
            open(done, "w").close()
    finally:
        _stop(daemons)


def _stop(daemons: list[subprocess.Popen]) -> None:
    for daemon in daemons:
        daemon.terminate()
    for daemon in daemons:
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _wait_idle(env: dict[str, str], daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        exited = [d.args[0] for d in daemons if d.poll() is not None]
        if exited:
            raise RuntimeError(f"{exited} exited during start-up (logs: next to slurm.conf)")
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%n %t"], env=env, capture_output=True, text=True
        ).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        if len(states) == 2 and all(s == "idle" for s in states.values()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"SLURM nodes not idle after {READY_S} s: {out!r}")


if __name__ == "__main__":
    args = sys.argv[1:]
    split = args.index("--")
    groups: list[list[str]] = [[]]
    for arg in args[split + 1 :]:
        if arg == "---":
            groups.append([])
        else:
            groups[-1].append(arg)
    sys.exit(main(int(args[0]), args[1], groups))
