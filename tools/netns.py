"""Simulated hosts on one machine, for benchmarks of the inter-host path.

Each host is a process tree in Linux network, IPC and UTS namespaces of its own: its own
hostname, shared-memory namespace (so smddp sees another host) and network stack, whose one
interface ``eth0`` has the address 10.9.0.<host + 1>. The hosts' cables (veth pairs) meet
at a bridge, the switch, in a network namespace of its own that this module's ``switch``
command runs in. With a rate, every cable is shaped at both ends with a token bucket
(``tc qdisc ... tbf``): the host's ``eth0`` egress is its upload, the switch port's egress
its download, so each host has a NIC of that rate in both directions. A host's TCP congestion
control is its own (``--congestion``; Note [Simulated hosts run cubic]). Nothing is addressed
outside 10.9.0.0/24 and loopback, and a private /etc/hosts (a bind mount in the switch's
own mount namespace) names the hosts, so no name lookup reaches the machine's resolver.

    python -m tools.netns --hosts 2 --rate 2gbit --timeout 60 -- CMD ...

runs CMD on every host (``{host}`` in CMD becomes the host's index) and must itself run
inside ``unshare --net --mount`` (``run_hosts`` does that; as a user other than root, with
``--user --map-root-user``). A host's processes see the switch's pid in
``TSM_NETNS_SWITCH_PID``, which ``port_counters`` uses to read the switch's ports.
The /dev/shm and the file system stay shared with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HOST_ADDRESS = "10.9.0.{}"
# Host i's cable's MAC address (i from 1, as HOST_ADDRESS): locally administered.
HOST_MAC = "02:00:0a:09:00:{:02x}"
# Note [Static neighbours]
# Each host knows every other host's MAC address from the start (permanent neighbour
# entries, as /etc/hosts names them), so nothing on the switch resolves addresses. On this
# 2-core machine every host's first connections to all the others made a broadcast storm:
# with 48 hosts each ARP request reaches 47 ports, some 100 000 frames that the kernel's
# per-CPU input queues (net.core.netdev_max_backlog, 1000) dropped by the tens of thousands,
# so requests went unanswered and connect() failed with EHOSTUNREACH, gloo's group set-up
# and smddp's first all_reduce alike. A real switch floods those frames to hosts of their
# own that each take 47 of them; here they all land on the same two cores. What the hosts'
# own data meets (the queues, the shapers) is unchanged. A link set down inside a host can drop
# its entries (the kernel flushes a device's neighbours): after that, it resolves addresses
# as any host does.

# Note [Memory floor]
# Every simulated host's ranks run on this machine, so a layout of many hosts can use all of
# its memory: 64 hosts of one rank (bench multihost, before Note [A light host process] in
# tools/bench_host.py) took 24 GiB within two minutes, and the kernel's OOM killer then killed
# the benchmark's own process, leaving the hosts running. So the switch stops every host once
# the machine's available memory falls below a floor, and says so; their results are lost,
# the machine is not.
MEMORY_FLOOR_BYTES = 1 << 30
HOST_NAME = "tsm-host-{}"
SWITCH_PID_VARIABLE = "TSM_NETNS_SWITCH_PID"
# Whole 64 KiB offload segments must pass the bucket at once, or TCP stalls on a shaped veth.
# A message that finds the bucket full passes this many bytes at once, above the rate.
BURST_BYTES = 96 * 1024
BURST = f"{BURST_BYTES // 1024}kb"  # tc's kb: 1024 bytes
QUEUE_LATENCY = "50ms"  # how long a packet may wait in the bucket's queue before it drops
# Note [Shallow switch ports]
# A datacenter switch port queues a few MiB at most (shared buffers of tens of MiB over
# dozens of ports), so several hosts sending to one (the mesh's incast) lose packets there
# and TCP backs off. A 50 ms queue at 2 Gbit/s holds 12.5 MB, and hides what a job on a real
# fabric meets. So run_hosts can bound the switch ports' queues in bytes (tbf's limit); the
# hosts' own uploads keep QUEUE_LATENCY, as a host's qdisc and NIC ring queue what its own
# flows send. bench multihost's default is SWITCH_QUEUE_BYTES.
SWITCH_QUEUE_BYTES = 2 << 20

# Note [Simulated hosts run cubic]
# A network namespace starts with the machine's TCP congestion control, whatever the machine's
# owner chose for its own traffic; this machine's is BBR. Linux's default is cubic, and it is
# what the hosts smddp is for (EC2 instances with Amazon Linux or Ubuntu) run unless someone
# changed it. So the benchmark's hosts (bench multihost) run cubic where they can, and each run
# records what every host ran; run_hosts keeps the machine's unless asked, which the
# functional tests of faults and launchers use. It matters: on 4 hosts of 2 ranks at 2
# Gbit/s, 64 MiB all_reduce, smddp reached 0.86-0.91 of the NIC bound under cubic and
# 0.77-0.87 under BBR (five interleaved rounds each), gloo 0.77-0.80 against 0.61-0.71 (two
# rounds each).
#
# Where they can: Linux lets a network namespace other than the machine's own choose only a
# congestion control listed in net.ipv4.tcp_allowed_congestion_control, whoever asks, root
# included (the kernel's tcp_set_default_congestion_control refuses the others with EPERM
# outside the initial namespace). That list is the machine's, and some machines leave cubic
# off it (kernel 6.18 with "reno bbr" was seen). So the benchmark's default, AUTO, is cubic
# where the list has it and otherwise the machine's own, said in the header and recorded;
# a name asked for explicitly (``--congestion cubic``) that the list lacks is refused before
# any host starts, naming the list and how its owner can extend it. Making the hosts without
# a user namespace does not help: the rule is the network namespace's, and the switch runs
# as root without one already when it can. Setting it per socket (TCP_CONGESTION, allowed to
# a namespace's root) would need every backend's sockets, gloo's included, to do so.
DEFAULT_CONGESTION = "cubic"
#: The benchmark's default: DEFAULT_CONGESTION where namespaces may choose it, else the
#: machine's own (``resolve_congestion``).
AUTO_CONGESTION = "auto"
#: The machine's own congestion control, whatever it is.
SYSTEM_CONGESTION = "system"
_CONGESTION_SYSCTL = "/proc/sys/net/ipv4/tcp_{}congestion_control"

# Run by each host's shell inside its namespaces: waits for the cable, configures it, runs
# the command. $1 host name, $2 address, $3 TCP congestion control (empty: the machine's),
# $4 net.ipv4.tcp_slow_start_after_idle (empty: the kernel's default), $5 the other hosts'
# neighbour entries as `ip -batch` lines (Note [Static neighbours]), the rest the command.
_HOST_SETUP = r"""
set -e
hostname "$1"
ip link set lo up
n=0
until ip link show eth0 >/dev/null 2>&1; do
  n=$((n + 1)); [ "$n" -le 3000 ] || { echo "eth0 never appeared in 60 s" >&2; exit 97; }
  sleep 0.02
done
ip addr add "$2/24" dev eth0
ip link set eth0 up
[ -z "$5" ] || printf '%s\n' "$5" | ip -batch -  # Note [Static neighbours]
if [ -n "$3" ]; then
  printf '%s\n' "$3" 2>/dev/null >/proc/sys/net/ipv4/tcp_congestion_control || {
    echo "TCP congestion control '$3' could not be set in this host's namespace (available:" \
      "$(cat /proc/sys/net/ipv4/tcp_available_congestion_control); allowed in a namespace" \
      "other than the machine's: $(cat /proc/sys/net/ipv4/tcp_allowed_congestion_control))" >&2
    exit 96
  }
fi
# Written only where it differs: kernels whose namespaces lack their own copy keep working
# for the default.
idle=/proc/sys/net/ipv4/tcp_slow_start_after_idle
if [ -n "$4" ] && [ "$(cat "$idle" 2>/dev/null)" != "$4" ]; then
  printf '%s\n' "$4" 2>/dev/null >"$idle" || {
    echo "net.ipv4.tcp_slow_start_after_idle could not be set to '$4' in this host's" \
      "namespace" >&2
    exit 95
  }
fi
shift 5
exec "$@"
"""


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can."""
    for tool in ("unshare", "ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command is not installed"
    user_ns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    # Everything a run builds, in a namespace of its own: the switch, a cable, a shaper. A
    # kernel without one of them (a module missing, none loadable) says so here.
    probe = (
        "ip link add br0 type bridge && ip link add h0 type veth peer name eth0"
        f" && tc qdisc add dev h0 root tbf rate 1gbit burst {BURST} latency {QUEUE_LATENCY}"
    )
    done = subprocess.run(
        ["unshare", *user_ns, "--net", "--ipc", "--uts", "sh", "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        return (
            "cannot build hosts in network namespaces (a bridge, a veth pair, a tbf qdisc): "
            f"{done.stderr.strip() or done.returncode}"
        )
    return None


def congestion_settings(kind: str = "") -> list[str]:
    """This machine's TCP congestion controls of one kind, read from /proc.

    Args:
        kind: ``""`` the machine's own (one name), ``"available_"`` those its kernel offers,
            ``"allowed_"`` those a network namespace other than the machine's may choose
            (Note [Simulated hosts run cubic]).
    """
    with open(_CONGESTION_SYSCTL.format(kind)) as f:
        return f.read().split()


def check_congestion(name: str) -> str:
    """Returns ``name`` if the simulated hosts can run that TCP congestion control.

    Args:
        name: A congestion control's name, e.g. ``cubic``.

    Raises:
        ValueError: The kernel does not offer it, or offers it to its own namespace only
            (Note [Simulated hosts run cubic]); the message names the lists and the fix.
    """
    offered = congestion_settings("available_")
    if name not in offered:
        raise ValueError(
            f"TCP congestion control {name!r} is not available on this machine: choose one"
            f" of {', '.join(offered)} (net.ipv4.tcp_available_congestion_control)"
        )
    allowed = congestion_settings("allowed_")
    if name not in allowed:
        raise ValueError(
            f"TCP congestion control {name!r} cannot be set in a simulated host's network"
            " namespace: Linux lets a namespace other than the machine's own choose only one"
            " in net.ipv4.tcp_allowed_congestion_control, here"
            f" {' '.join(allowed) or '(empty)'}, root included. Choose one of those, or"
            f" '{SYSTEM_CONGESTION}' for the machine's own, or have the machine's owner add"
            " it: sysctl -w net.ipv4.tcp_allowed_congestion_control="
            f"'{' '.join([*allowed, name])}'"
        )
    return name


def resolve_congestion(asked: str | None) -> tuple[str | None, str]:
    """The congestion control to give the hosts for a benchmark's ``--congestion``.

    Note [Simulated hosts run cubic]: ``AUTO_CONGESTION`` takes ``DEFAULT_CONGESTION``
    where namespaces may choose it and otherwise keeps the machine's own.

    Args:
        asked: ``AUTO_CONGESTION``, ``SYSTEM_CONGESTION`` or None (the machine's own), or a
            name, which must pass ``check_congestion``.

    Returns:
        The name for ``run_hosts`` (None: the machine's own) and why, for the run's header
        ("" where the name was asked for).

    Raises:
        ValueError: A name the hosts cannot run (``check_congestion``).
    """
    if asked in (None, SYSTEM_CONGESTION):
        return None, "the machine's own, as asked"
    if asked != AUTO_CONGESTION:
        return check_congestion(asked), ""
    if DEFAULT_CONGESTION in congestion_settings("allowed_") and (
        DEFAULT_CONGESTION in congestion_settings("available_")
    ):
        return DEFAULT_CONGESTION, "Linux's default"
    allowed = " ".join(congestion_settings("allowed_"))
    return None, (
        f"the machine's own: {DEFAULT_CONGESTION}, the benchmark's default, is not in"
        f" net.ipv4.tcp_allowed_congestion_control ({allowed}), so a namespace cannot choose"
        " it"
    )


def parse_rate(text: str) -> int:
    """Parses a NIC rate such as "2gbit", "500mbit" or "1e9" into bits per second.

    Raises:
        ValueError: The text is not a positive rate, naming it.
    """
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    t = text.strip().lower()
    mult = next((m for u, m in units.items() if t.endswith(u)), 1)
    number = t[:-4] if mult > 1 else t
    try:
        bits = float(number) * mult
    except ValueError:
        bits = 0.0
    if not (bits > 0 and math.isfinite(bits)):
        raise ValueError(f"rate {text!r} is not a positive rate: write e.g. 2gbit, 500mbit")
    return int(bits)


def run_hosts(
    hosts: int,
    command: list[str],
    timeout_s: float,
    rate_bits: int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    host_name: str = HOST_NAME,
    congestion: str | None = None,
    slow_start_after_idle: int | None = None,
    switch_queue_bytes: int | None = None,
    memory_floor_bytes: int = MEMORY_FLOOR_BYTES,
) -> subprocess.CompletedProcess:
    """Runs ``command`` on ``hosts`` simulated hosts joined by a switch; output is merged.

    Args:
        hosts: How many hosts (1 to 250).
        command: The program and its arguments; ``{host}`` becomes the host's index.
        timeout_s: Every host is killed after this many seconds.
        rate_bits: Each host's NIC rate in bits per second (both directions); None: unshaped.
        env: The environment of the commands.
        cwd: Their working directory.
        host_name: The hosts' names, ``{}`` standing for the index (hostname and /etc/hosts).
        congestion: The hosts' TCP congestion control (``cubic``, ``bbr``, ...); None: the
            machine's (Note [Simulated hosts run cubic]).
        slow_start_after_idle: The hosts' ``net.ipv4.tcp_slow_start_after_idle``, 0 or 1;
            None: the kernel's default for a new namespace (1).
        switch_queue_bytes: With a rate, the most bytes each switch port queues towards its
            host (Note [Shallow switch ports]); None: QUEUE_LATENCY's worth.
        memory_floor_bytes: Every host is stopped once the machine's available memory falls
            below this (Note [Memory floor]).

    Returns:
        The finished switch process: ``returncode`` 0 when every host's command succeeded,
        and ``stdout`` with every line prefixed by its host.
    """
    if not 1 <= hosts <= 250:
        raise ValueError(f"hosts={hosts}: simulated hosts number 1 to 250 (one /24 subnet)")
    user_ns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    # The switch runs this file as a script, isolated (-I: no PYTHONPATH, not the script's
    # directory on sys.path): it needs the standard library only, and ``-m`` would first
    # import the torch_sagemaker package (torch with it), seconds of CPU before every run
    # on a small machine. The hosts' commands still get ``env`` (and PYTHONPATH) unchanged.
    switch = [sys.executable, "-I", os.path.abspath(__file__)]
    argv = ["unshare", *user_ns, "--net", "--mount", *switch]
    argv += ["--hosts", str(hosts), "--timeout", str(timeout_s), "--host-name", host_name]
    argv += ["--memory-floor", str(memory_floor_bytes)]
    if rate_bits:
        argv += ["--rate-bits", str(rate_bits)]
    if switch_queue_bytes is not None:
        if switch_queue_bytes < BURST_BYTES:
            raise ValueError(
                f"switch_queue_bytes={switch_queue_bytes}: a switch port must queue at least"
                f" one burst ({BURST_BYTES} bytes), or whole offload segments never pass"
            )
        argv += ["--queue-bytes", str(switch_queue_bytes)]
    if congestion:
        argv += ["--congestion", congestion]
    if slow_start_after_idle is not None:
        if isinstance(slow_start_after_idle, bool) or slow_start_after_idle not in (0, 1):
            raise ValueError(
                f"slow_start_after_idle={slow_start_after_idle!r}: "
                "net.ipv4.tcp_slow_start_after_idle is 0 or 1"
            )
        argv += ["--slow-start-after-idle", str(slow_start_after_idle)]
    return subprocess.run(
        [*argv, "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout_s + 60,
        check=False,
    )


def port_counters(switch_pid: int | None = None) -> dict[str, dict[str, int]]:
    """The switch's ports, read from inside a host.

    Per port ("h<i>", host i's cable): the bytes sent towards the host and the packets its
    bucket dropped.

    Args:
        switch_pid: The switch process; default: ``TSM_NETNS_SWITCH_PID``.
    """
    pid = switch_pid or int(os.environ[SWITCH_PID_VARIABLE])
    out = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "tc", "-s", "-j", "qdisc", "show"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return {
        q["dev"]: {"bytes": int(q.get("bytes", 0)), "drops": int(q.get("drops", 0))}
        for q in json.loads(out or "[]")
        if q.get("kind") == "tbf"
    }


def own_counters(interface: str = "eth0") -> dict[str, int]:
    """This host's NIC: bytes sent and received, and packets its upload bucket dropped.

    The bytes come from /proc/net/dev, which shows the caller's network namespace.
    """
    counters = {"tx_bytes": 0, "rx_bytes": 0, "drops": 0}
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == interface:
                fields = rest.split()
                counters["rx_bytes"], counters["tx_bytes"] = int(fields[0]), int(fields[8])
    out = subprocess.run(
        ["tc", "-s", "-j", "qdisc", "show", "dev", interface],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    ).stdout
    for q in json.loads(out or "[]"):
        if q.get("kind") == "tbf":
            counters["drops"] += int(q.get("drops", 0))
    return counters


def _shape(prefix: list[str], device: str, rate_bits: int, queue_bytes: int | None) -> None:
    queue = ["limit", str(queue_bytes)] if queue_bytes else ["latency", QUEUE_LATENCY]
    subprocess.run(
        [*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_bits}bit"]
        + ["burst", BURST, *queue],
        check=True,
    )


def _private_etc_hosts(stack: contextlib.ExitStack, hosts: int, host_name: str) -> None:
    """Bind-mounts a private /etc/hosts naming the hosts (the switch's own mount namespace)."""
    f = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".hosts"))  # noqa: SIM115
    # With the IPv4-mapped IPv6 forms: a dual-stack listener (TCPStore's) sees its clients
    # as ::ffff:a.b.c.d, and a reverse lookup missing here would go on to DNS.
    f.write("127.0.0.1 localhost\n::1 localhost\n::ffff:127.0.0.1 localhost\n")
    for i in range(hosts):
        address, name = HOST_ADDRESS.format(i + 1), host_name.format(i)
        f.write(f"{address} {name}\n::ffff:{address} {name}\n")
    f.flush()
    subprocess.run(["mount", "--bind", f.name, "/etc/hosts"], check=True)


def _neighbours(index: int, hosts: int) -> str:
    """Host ``index``'s permanent entries for the others, as ``ip -batch`` lines."""
    return "\n".join(
        f"neigh replace {HOST_ADDRESS.format(k + 1)} lladdr {HOST_MAC.format(k + 1)} "
        "dev eth0 nud permanent"
        for k in range(hosts)
        if k != index
    )


def _start_host(
    index: int,
    hosts: int,
    command: list[str],
    log,
    host_name: str,
    congestion: str | None,
    slow_start_after_idle: int | None,
) -> subprocess.Popen:
    argv = ["unshare", "--net", "--ipc", "--uts", "sh", "-c", _HOST_SETUP, "host-setup"]
    argv += [host_name.format(index), HOST_ADDRESS.format(index + 1), congestion or ""]
    argv += ["" if slow_start_after_idle is None else str(slow_start_after_idle)]
    argv += [_neighbours(index, hosts)]
    argv += [part.replace("{host}", str(index)) for part in command]
    env = dict(os.environ, **{SWITCH_PID_VARIABLE: str(os.getpid())})
    # Output to a file (an unread pipe could block a host); its own session, so that a
    # timeout ends the host's whole process tree.
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def _wait_own_network(host: subprocess.Popen, timeout_s: float = 60.0) -> None:
    mine = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{host.pid}/ns/net") != mine:
                return
        except FileNotFoundError:  # it exited already; its log says why
            return
        time.sleep(0.01)
    raise TimeoutError(f"host process {host.pid} did not enter its namespaces in {timeout_s} s")


def _cable(
    index: int, host: subprocess.Popen, rate_bits: int | None, queue_bytes: int | None
) -> None:
    port = f"h{index}"
    subprocess.run(
        ["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0"]
        + ["address", HOST_MAC.format(index + 1), "netns", str(host.pid)],
        check=True,
    )
    subprocess.run(["ip", "link", "set", port, "master", "br0", "up"], check=True)
    if rate_bits:
        _shape([], port, rate_bits, queue_bytes)  # the host's download: the switch's port
        upload = ["nsenter", f"--net=/proc/{host.pid}/ns/net"]
        _shape(upload, "eth0", rate_bits, None)  # its upload


def _memory_available() -> tuple[int, int]:
    """The machine's available and total memory in bytes (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    return info["MemAvailable"], info["MemTotal"]


def _kill_tree(host: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(host.pid, signal.SIGKILL)


def _switch(
    hosts: int,
    rate_bits: int | None,
    timeout_s: float,
    command: list[str],
    host_name: str,
    congestion: str | None,
    slow_start_after_idle: int | None,
    queue_bytes: int | None = None,
    memory_floor: int = MEMORY_FLOOR_BYTES,
) -> int:
    with contextlib.ExitStack() as stack:
        _private_etc_hosts(stack, hosts, host_name)
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "link", "add", "br0", "type", "bridge"], check=True)
        subprocess.run(["ip", "link", "set", "br0", "up"], check=True)
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(hosts)]
        procs = [
            _start_host(i, hosts, command, logs[i], host_name, congestion, slow_start_after_idle)
            for i in range(hosts)
        ]
        why = "set-up failed"
        try:
            for i, proc in enumerate(procs):
                _wait_own_network(proc)
                try:
                    _cable(i, proc, rate_bits, queue_bytes)
                except subprocess.CalledProcessError:
                    # A host whose set-up failed (an unsettable congestion control, say)
                    # may exit before its cable is in, taking its namespace with it: its
                    # log says why, below; anything else is the switch's own failure.
                    if proc.poll() is None:
                        raise
            deadline = time.monotonic() + timeout_s
            available, total = _memory_available()
            # A host that failed leaves the others waiting for it: stop them all at once.
            while (
                any(p.poll() is None for p in procs)
                and time.monotonic() < deadline
                and not any(p.poll() for p in procs)
                and available >= memory_floor
            ):
                time.sleep(0.05)
                available, total = _memory_available()
            why = "a host failed"
            if time.monotonic() >= deadline:
                why = f"timeout ({timeout_s:.0f} s)"
            elif available < memory_floor:
                why = (
                    f"the machine's available memory fell to {available >> 20} MiB of "
                    f"{total >> 20} MiB, below the floor of {memory_floor >> 20} MiB "
                    f"(Note [Memory floor] in tools/netns.py): all {hosts} hosts' processes "
                    "run on this machine; run fewer hosts or ranks, or smaller sizes"
                )
        finally:
            running = [p.poll() is None for p in procs]
            for p in procs:
                _kill_tree(p)
                p.wait()
        for i, log in enumerate(logs):
            log.seek(0)
            for line in log.read().splitlines():
                print(f"[host {i}] {line}")
            if running[i]:
                print(f"[host {i}] killed: {why}")
    codes = [p.returncode for p in procs]
    print(f"host exit codes: {codes}", flush=True)
    return 0 if not any(codes) else 1


def main(argv: list[str] | None = None) -> int:
    """The switch: builds the hosts, runs the command on each, reports their exit codes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--rate-bits", type=int, default=None)
    p.add_argument("--host-name", default=HOST_NAME)
    p.add_argument("--congestion", default=None, help="the hosts' TCP congestion control")
    p.add_argument("--queue-bytes", type=int, default=None, help="each switch port's queue")
    p.add_argument("--memory-floor", type=int, default=MEMORY_FLOOR_BYTES, help="bytes; see Note")
    p.add_argument(
        "--slow-start-after-idle",
        type=int,
        choices=(0, 1),
        default=None,
        help="the hosts' net.ipv4.tcp_slow_start_after_idle",
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return _switch(
        args.hosts,
        args.rate_bits,
        args.timeout,
        command,
        args.host_name,
        args.congestion,
        args.slow_start_after_idle,
        args.queue_bytes,
        args.memory_floor,
    )


if __name__ == "__main__":
    sys.exit(main())
