"""The C++ tests of the smddp core (tests/cpp), built with the system C++ compiler and run.

``make test-cpp`` compiles the torch-free part of csrc/smddp with tests/cpp (ranks as threads
over an in-memory store: every collective on the shared-memory, TCP and hierarchical paths,
faults, kernels, settings, the per-group scheduler's interleavings, SHA-256/HMAC known answers)
and runs it; ``make sanitize`` runs the same under ASan+UBSan and TSan (not run here: their
builds take minutes on a 2-core machine).
Builds are incremental under build/cpptest/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_HAVE_TOOLS = shutil.which("make") is not None and shutil.which(os.environ.get("CXX", "g++"))


def _make(target: str) -> str:
    # A pytest run under `make test` must not hand make's jobserver to this one.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    result = subprocess.run(
        ["make", "-s", "-j2", target],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_TOOLS, reason="needs make and a C++ compiler")
def test_cpp_core_tests_pass():
    output = _make("test-cpp")
    assert "FAIL" not in output, output[-6000:]
    summary = [line for line in output.splitlines() if "cases passed" in line]
    assert summary, output[-6000:]
    passed, total = summary[-1].split(" cases passed")[0].split(" of ")
    assert passed == total and int(total) >= 40, summary[-1]
