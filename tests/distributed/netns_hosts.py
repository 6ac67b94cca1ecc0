"""Two simulated hosts for tests of the smddp inter-host path without forcing a layout.

The hosts are those of ``tools.netns`` (Linux network, IPC and UTS namespaces,
cables to a bridge, a private /etc/hosts), unshaped, named ``smddp-host-<i>`` at
10.9.0.<i + 1>. Each has its own hostname and IPC namespace (so the backend sees another
host) and network stack; the file system (and so /dev/shm) stays shared, as the backend never
relies on /dev/shm to tell hosts apart. The launcher tests (mpirun, SLURM) resolve the names
through that /etc/hosts, never through the machine's resolver.
"""

from __future__ import annotations

import subprocess

# The helpers that run inside each simulated host (slurm_cluster, netns_mpirun) import this
# module for the names below and need nothing else. netns is imported only where it is used
# (when it lived in the torch_sagemaker package, importing it cost each host seconds of CPU
# for torch), and its address pattern is repeated here and compared with it on every run.
HOST_ADDRESS = "10.9.0.{}"
HOST_NAME = "smddp-host-{}"


def unavailable_reason() -> str | None:
    """Why the namespaces cannot be made on this machine, or None when they can."""
    from tools import netns

    return netns.unavailable_reason()


def run_on_two_hosts(
    command: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """Runs ``command`` on both hosts (``{host}`` replaced by 0 or 1); output is merged.

    Args:
        command: The program and its arguments.
        timeout_s: Both hosts are killed after this many seconds.
        env: The environment of the commands.
        cwd: Their working directory.

    Returns:
        The finished run: ``returncode`` 0 when both commands succeeded, and ``stdout`` with
        every line prefixed by its host.
    """
    from tools import netns

    assert netns.HOST_ADDRESS == HOST_ADDRESS, (netns.HOST_ADDRESS, HOST_ADDRESS)
    return netns.run_hosts(2, command, timeout_s, env=env, cwd=cwd, host_name=HOST_NAME)
