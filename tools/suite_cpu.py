"""Where the test suite's time goes: each test's wall time and the machine's CPU meanwhile.

``--durations`` gives wall time only, and on a 2-core machine that does not say whether a test
keeps both cores busy (ranks that compute; process start-ups that import torch) or waits
(a timeout it must see expire, a shaped link). This pytest plugin records, for every test
(its setup, call and teardown), the wall time and the busy and idle CPU-seconds of the whole
machine from ``/proc/stat``, so it counts the ranks, launchers and simulated hosts a test
starts, wherever they run. Run the suite alone on the machine, or others' work counts too::

    python -m pytest -p tools.suite_cpu --suite-cpu-out /tmp/suite_cpu.jsonl tests
    python -m tools.suite_cpu /tmp/suite_cpu.jsonl          # the table by file

A file whose busy CPU-seconds are near twice its wall time keeps both cores busy: only less
work shortens it. One well below waits, and would overlap with other tests' work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu() -> tuple[float, float]:
    """``(busy, idle)`` CPU-seconds of the whole machine since boot (Linux ``/proc/stat``).

    Idle counts the idle and I/O-wait ticks; busy the user, nice, system, interrupt and
    steal ones.
    """
    with open("/proc/stat") as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        raise RuntimeError(f"/proc/stat does not start with the cpu line: {fields[:2]}")
    ticks = [int(v) for v in fields[1:9]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / _TICKS, idle / _TICKS


def pytest_addoption(parser: pytest.Parser) -> None:
    """The option naming the output file."""
    parser.addoption(
        "--suite-cpu-out",
        default="suite_cpu.jsonl",
        help="where tools.suite_cpu writes one JSON line per test (default: suite_cpu.jsonl)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Starts recording into the file ``--suite-cpu-out`` names."""
    config.pluginmanager.register(_Recorder(config.getoption("--suite-cpu-out")), "suite_cpu")


class _Recorder:
    def __init__(self, path: str) -> None:
        self._out = open(path, "w")  # noqa: SIM115 - open for the whole session

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Iterator[None]:
        busy0, idle0 = machine_cpu()
        t0 = time.monotonic()
        yield
        busy1, idle1 = machine_cpu()
        row = {
            "id": item.nodeid,
            "wall": round(time.monotonic() - t0, 3),
            "busy": round(busy1 - busy0, 2),
            "idle": round(idle1 - idle0, 2),
        }
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()

    def pytest_unconfigure(self) -> None:
        self._out.close()


def by_file(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """``[(file, wall s, busy CPU-s, tests)]``, the most busy CPU first."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        entry = totals[row["id"].split("::")[0]]
        entry[0] += row["wall"]
        entry[1] += row["busy"]
        entry[2] += 1
    return sorted(
        ((name, wall, busy, int(n)) for name, (wall, busy, n) in totals.items()),
        key=lambda r: -r[2],
    )


def table(rows: list[dict], top: int = 25, cores: int | None = None) -> str:
    """A Markdown table of the ``top`` files by busy CPU, and the suite's totals."""
    cores = cores or os.cpu_count() or 1
    wall = sum(r["wall"] for r in rows)
    busy = sum(r["busy"] for r in rows)
    lines = [
        f"{len(rows)} tests: {wall:.0f} s of wall time, {busy:.0f} busy CPU-s "
        f"({busy / (cores * wall) if wall else 0:.2f} of {cores} cores; at full use "
        f"{busy / cores:.0f} s)",
        "",
        "| file | tests | wall s | busy CPU-s | cores used |",
        "|---|---|---|---|---|",
    ]
    for name, w, b, n in by_file(rows)[:top]:
        lines.append(f"| {name} | {n} | {w:.1f} | {b:.1f} | {b / w if w else 0:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Prints the table of a file the plugin wrote."""
    parser = argparse.ArgumentParser(prog="python -m tools.suite_cpu", description=__doc__)
    parser.add_argument("path", help="the JSON lines --suite-cpu-out named")
    parser.add_argument("--top", type=int, default=25, help="files to list (default 25)")
    parser.add_argument("--cores", type=int, default=None, help="default: this machine's")
    args = parser.parse_args(argv)
    with open(args.path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print(table(rows, args.top, args.cores))


if __name__ == "__main__":
    main()
