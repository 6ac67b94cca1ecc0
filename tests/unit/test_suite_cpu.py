"""tools.suite_cpu: the plugin records every test, and the table sums them by file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tools import suite_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_plugin_records_each_tests_wall_and_cpu(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import time\n"
        "def test_spins():\n"
        "    end = time.monotonic() + 0.3\n"
        "    while time.monotonic() < end:\n"
        "        pass\n"
        "def test_sleeps():\n"
        "    time.sleep(0.3)\n"
    )
    out = tmp_path / "cpu.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tools.suite_cpu", "--suite-cpu-out",
         str(out), "-p", "no:cacheprovider", str(tmp_path / "test_two.py")],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"].split("::")[1] for r in rows] == ["test_spins", "test_sleeps"], rows
    spins, sleeps = rows
    assert spins["wall"] >= 0.3 and sleeps["wall"] >= 0.3, rows
    # The spinning test kept a core busy; the machine's other work counts too, so only
    # what the spin alone guarantees is checked.
    assert spins["busy"] >= 0.2, spins
    assert all(r["busy"] >= 0 and r["idle"] >= 0 for r in rows), rows


def test_the_table_sums_by_file_most_cpu_first():
    rows = [
        {"id": "tests/a.py::t1", "wall": 2.0, "busy": 1.0, "idle": 3.0},
        {"id": "tests/b.py::t1", "wall": 1.0, "busy": 2.0, "idle": 0.0},
        {"id": "tests/a.py::t2[x]", "wall": 2.0, "busy": 2.0, "idle": 2.0},
    ]
    assert suite_cpu.by_file(rows) == [("tests/a.py", 4.0, 3.0, 2), ("tests/b.py", 1.0, 2.0, 1)]
    text = suite_cpu.table(rows, cores=2)
    assert text.splitlines()[0] == (
        "3 tests: 5 s of wall time, 5 busy CPU-s (0.50 of 2 cores; at full use 2 s)"
    )
    assert "| tests/a.py | 2 | 4.0 | 3.0 | 0.75 |" in text
    assert "| tests/b.py | 1 | 1.0 | 2.0 | 2.00 |" in text


def test_machine_cpu_counts_up():
    busy, idle = suite_cpu.machine_cpu()
    assert busy > 0 and idle >= 0
    later = suite_cpu.machine_cpu()
    assert later[0] >= busy and later[1] >= idle
