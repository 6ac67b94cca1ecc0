r"""Where a collective's CPU time goes, from a system-wide ``perf record``.

Usage::

    perf record -F 999 -a -g -o all_reduce.data -- \
        python -m benchmarks multihost --layouts 2x2 --rate unlimited --ops all_reduce \
            --sizes 64M --backends smddp --iters 40
    python -m tools.perf_split all_reduce.data

It reads the samples (``perf script``), keeps the window from the first to the last sample
in smddp's reduction kernels (the timed calls and their warm-up; start-up, imports and the
namespaces' set-up fall outside), and splits the busy samples of that window by the function
each sample landed in (its own time, not its callers'):

- copies in user space (``memcpy``/``memmove``: staging through shared memory segments);
- the reduction (smddp's kernels);
- copies between user buffers and socket buffers (the kernel's ``_copy_from_iter`` and
  ``_copy_to_iter``);
- the kernel's TCP/IP path (TCP, IP, the veth pairs and the bridge, softirqs);
- syscall entry and exit;
- polling and scheduling (``poll``, ``sched_yield``, the scheduler; smddp's waits);
- everything else, by library.

Note [Samples in a virtual machine]
On a virtual machine without a PMU, perf samples on a timer interrupt, which cannot land
while interrupts are disabled: the time spent with them off is charged to the function that
turns them back on (``_raw_spin_unlock_irqrestore``) or to the softirq handler. Both are
counted as the TCP/IP path, where nearly all of those sections are on these runs; the split
is by where the CPU was, to a few percent, not an exact attribution.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from collections.abc import Iterable
from typing import NamedTuple

# The function's name may hold parentheses (C++ signatures); the object's path, last, not.
_LINE = re.compile(r"\s*(\S+)\s+(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*)\s+\(([^()]*)\)\s*$")
_REDUCTION = re.compile(r"(^|::)k_(f32|bf16|f16|f64)\b|reduce_mixed")
# (category, the object it must come from, a pattern of function names), first match wins.
_RULES: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    ("reduction (smddp's kernels)", "_C.", _REDUCTION),
    ("polling and waiting", "_C.", re.compile(r"wait|poll|spin|yield", re.I)),
    ("smddp, other", "_C.", re.compile(r".")),
    ("copies in user space", "libc", re.compile(r"mem(cpy|move)")),
    ("polling and waiting", "libc", re.compile(r"poll|sched_yield|futex|pthread_cond|sleep")),
    ("syscall entry and exit", "libc", re.compile(r"^(__send|__libc_recv|send|recv)")),
    (
        "copies to and from socket buffers",
        "kernel",
        re.compile(r"copy_(from|to)_iter|copy_user|copy_mc|csum_partial_copy"),
    ),
    (
        "syscall entry and exit",
        "kernel",
        re.compile(r"^(entry_SYSCALL|do_syscall|syscall_|__x64_sys_|__sys_|sock_|fdget|__fget)"),
    ),
    (
        "polling and waiting",
        "kernel",
        re.compile(r"poll|schedule|task_switch|futex|yield|pick_next|try_to_wake"),
    ),
    (
        "kernel TCP/IP path",
        "kernel",
        re.compile(
            r"tcp|^ip_|skb|^dev_|netif|napi|veth|^br_|net_rx|softirq|_raw_spin|^nf_|inet|^sk_"
            r"|qdisc|^sch_|page_frag|^eth_|^dst_|^fib_"
        ),
    ),
    ("kernel, other", "kernel", re.compile(r".")),
    ("Python", "libpython", re.compile(r".")),
)
IDLE = "idle"
OTHER = "other user space"


class Sample(NamedTuple):
    """One sample: the command and thread it was in, when, and the function it landed in."""

    comm: str
    tid: int
    time: float
    symbol: str
    dso: str


def parse(lines: Iterable[str]) -> list[Sample]:
    """The samples of ``perf script -F comm,tid,time,ip,sym,dso --hide-call-graph`` output."""
    samples = []
    for line in lines:
        m = _LINE.match(line)
        if m:
            comm, tid, when, symbol, dso = m.groups()
            symbol = re.sub(r"\+0x[0-9a-f]+$", "", symbol)
            samples.append(Sample(comm, int(tid), float(when), symbol, dso))
    return samples


def category(sample: Sample) -> str:
    """Where one sample's CPU time counts (module docstring)."""
    if sample.comm == "swapper":
        return IDLE
    dso = "kernel" if "kernel" in sample.dso else sample.dso
    for name, where, pattern in _RULES:
        if where in dso and pattern.search(sample.symbol):
            return name
    return OTHER


def window(samples: list[Sample]) -> list[Sample]:
    """The samples from the first to the last one in smddp's reduction kernels."""
    times = [s.time for s in samples if "_C." in s.dso and _REDUCTION.search(s.symbol)]
    if not times:
        raise ValueError(
            "no sample landed in smddp's reduction kernels: record a reducing collective "
            "(all_reduce or reduce_scatter) with smddp, system-wide (perf record -a)"
        )
    first, last = min(times), max(times)
    return [s for s in samples if first <= s.time <= last]


def split(
    samples: list[Sample],
) -> tuple[collections.Counter[str], dict[str, collections.Counter[str]]]:
    """Busy samples per category, and per category the functions they landed in."""
    counts: collections.Counter[str] = collections.Counter()
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for sample in samples:
        name = category(sample)
        counts[name] += 1
        functions[name][sample.symbol] += 1
    return counts, functions


def table(samples: list[Sample]) -> str:
    """The window's split as a Markdown table, idle time in the heading."""
    inside = window(samples)
    counts, functions = split(inside)
    busy = sum(n for name, n in counts.items() if name != IDLE)
    total = busy + counts[IDLE]
    span = max(s.time for s in inside) - min(s.time for s in inside)
    lines = [
        f"{span:.2f} s window, {total} samples, {busy / total:.0%} busy",
        "",
        "| where | share of the busy samples | functions (share of the row) |",
        "|---|---|---|",
    ]
    for name, n in counts.most_common():
        if name == IDLE:
            continue
        top = ", ".join(f"`{f}` {c / n:.0%}" for f, c in functions[name].most_common(3))
        lines.append(f"| {name} | {n / busy:.0%} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m tools.perf_split PERF.DATA``: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a perf.data file recorded system-wide (perf record -a)")
    args = parser.parse_args(argv)
    command = ["perf", "script", "-i", args.data, "-F", "comm,tid,time,ip,sym,dso"]
    out = subprocess.run(
        [*command, "--hide-call-graph"], capture_output=True, text=True, check=True
    ).stdout
    print(table(parse(out.splitlines())))


if __name__ == "__main__":
    main()
