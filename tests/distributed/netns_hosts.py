"""Runs a command on two simulated hosts: Linux network, IPC and UTS namespaces joined by a
virtual Ethernet cable, for tests of the smddp inter-host path without forcing a layout.

Each host has its own hostname, IPC namespace (so the backend sees a different host) and
network stack: its loopback reaches only itself and its one interface, ``eth0``, has the
address 10.9.0.<host + 1>. The file system (and so /dev/shm) stays shared, as the backend
never relies on /dev/shm to tell hosts apart, except /etc/hosts: the hosts run in a mount
namespace of their own where a private /etc/hosts names them (``smddp-host-<i>``), so name
lookups (mpirun's, OpenMPI's own hostname) resolve there and never reach the machine's
resolver.

``python -m tests.distributed.netns_hosts --timeout S -- CMD ...`` must run inside
``unshare --net --mount`` (with ``--user --map-root-user`` when not root, which gives an
unprivileged user the right to create the links); ``run_on_two_hosts`` does that. In CMD,
``{host}`` becomes the host's index. The exit status is 0 when both hosts' commands exited with 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HOST_ADDRESS = "10.9.0.{}"
HOST_NAME = "smddp-host-{}"

# Sets the host up inside its fresh namespaces, then runs the command ("$@"). The interface
# is created from outside once the namespace exists, so the host waits for it (at most 10 s).
_HOST_SETUP = r"""
set -e
hostname "smddp-host-$1"  # HOST_NAME
ip link set lo up
n=0
until ip link show eth0 >/dev/null 2>&1; do
  n=$((n + 1)); [ "$n" -le 500 ] || { echo "eth0 never appeared" >&2; exit 97; }
  sleep 0.02
done
ip addr add "$2/24" dev eth0
ip link set eth0 up
shift 2
exec "$@"
"""


def unavailable_reason() -> str | None:
    """Why the namespaces cannot be made on this machine, or None when they can."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command is not installed"
    probe = [
        "unshare",
        "--user",
        "--map-root-user",
        "--net",
        "--mount",
        "--ipc",
        "--uts",
        "ip",
        "link",
        "add",
        "probe0",
        "type",
        "veth",
        "peer",
        "name",
        "probe1",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create user and network namespaces: {e}"
    if done.returncode != 0:
        return f"cannot create user and network namespaces: {done.stderr.strip()}"
    return None


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
        The finished orchestrator: ``returncode`` 0 when both commands succeeded, and
        ``stdout`` with every line prefixed by its host.
    """
    # Real root needs no user namespace, and keeps the right to setgroups(2), which daemons
    # such as slurmd use (a mapped root in a user namespace may not).
    user_ns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    argv = [
        "unshare",
        *user_ns,
        "--net",
        "--mount",
        sys.executable,
        "-m",
        "tests.distributed.netns_hosts",
        "--timeout",
        str(timeout_s),
        "--",
        *command,
    ]
    return subprocess.run(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout_s + 30,
    )


def _start_host(index: int, command: list[str], log) -> subprocess.Popen:
    argv = [
        "unshare",
        "--net",
        "--ipc",
        "--uts",
        "sh",
        "-c",
        _HOST_SETUP,
        "host-setup",
        str(index),
        HOST_ADDRESS.format(index + 1),
        *[part.replace("{host}", str(index)) for part in command],
    ]
    # Output to a file (a pipe left unread could block one host and so both); its own
    # session, so a timeout can kill the host's whole process tree.
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_own_network(host: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Waits until ``host`` runs in a network namespace of its own (unshare(1) enters the
    namespaces before it execs the host's shell, but after Popen returns)."""
    mine = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{host.pid}/ns/net") != mine:
                return
        except FileNotFoundError:  # the host already exited; its log says why
            return
        time.sleep(0.01)
    raise TimeoutError(f"host process {host.pid} did not enter its namespaces in {timeout_s} s")


def _kill_tree(host: subprocess.Popen) -> None:
    try:
        os.killpg(host.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with contextlib.ExitStack() as stack:
        _private_etc_hosts(stack)
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(2)]
        hosts = [_start_host(i, command, logs[i]) for i in range(2)]
        why = _connect_and_wait(hosts, args.timeout)
        for i, log in enumerate(logs):
            log.seek(0)
            for line in log.read().splitlines():
                print(f"[host {i}] {line}")
            if why[i]:
                print(f"[host {i}] killed: {why[i]}")
    codes = [h.returncode for h in hosts]
    print(f"host exit codes: {codes}")
    return 0 if codes == [0, 0] else 1


def _private_etc_hosts(stack: contextlib.ExitStack) -> None:
    """Bind-mounts a private /etc/hosts naming both hosts (this process's own mount namespace,
    private propagation as unshare(1) makes it, so the machine's file is untouched)."""
    hosts = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".hosts"))  # noqa: SIM115
    # The IPv4-mapped IPv6 forms too: a dual-stack listener (TCPStore's) sees its clients
    # as ::ffff:a.b.c.d, and a reverse lookup missing here would go on to DNS.
    hosts.write("127.0.0.1 localhost\n::1 localhost\n::ffff:127.0.0.1 localhost\n")
    for i in range(2):
        address, name = HOST_ADDRESS.format(i + 1), HOST_NAME.format(i)
        hosts.write(f"{address} {name}\n::ffff:{address} {name}\n")
    hosts.flush()
    subprocess.run(["mount", "--bind", hosts.name, "/etc/hosts"], check=True)


def _connect_and_wait(hosts: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Links the hosts, waits for both; returns per host why it was killed ("" if not)."""
    why = "set-up failed"
    try:
        for host in hosts:
            _wait_own_network(host)
        subprocess.run(
            [
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                str(hosts[0].pid),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                str(hosts[1].pid),
            ],
            check=True,
        )
        deadline = time.monotonic() + timeout_s
        # A host that failed leaves the other waiting for it: stop both at once.
        while (
            any(h.poll() is None for h in hosts)
            and time.monotonic() < deadline
            and not any(h.poll() for h in hosts)
        ):
            time.sleep(0.1)
        why = (
            f"timeout ({timeout_s:.0f} s)"
            if time.monotonic() >= deadline
            else "the other host failed"
        )
    finally:
        stopped = [h.poll() is None for h in hosts]
        for host, running in zip(hosts, stopped):
            if running:
                _kill_tree(host)
                host.wait()
        # Whatever a host left behind in its session (a daemon, a launcher's helper) goes too.
        for host in hosts:
            _kill_tree(host)
    return [why if running else "" for running in stopped]


if __name__ == "__main__":
    sys.exit(main())
