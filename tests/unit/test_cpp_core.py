"""The C++ tests of the smddp core (tests/cpp), built with the system C++ compiler and run.

``make test-cpp`` compiles the torch-free part of csrc/smddp with tests/cpp (ranks as threads
over an in-memory store: every collective on the shared-memory, TCP and hierarchical paths,
faults, kernels, settings, the per-group scheduler's interleavings, SHA-256/HMAC known answers)
and runs it; ``make sanitize`` runs the same under ASan+UBSan and TSan (not run here: their
builds take minutes on a 2-core machine).
Builds are incremental under build/cpptest/. When this test is selected, the session starts
its build at once in the background, at the lowest priority (Note [C++ tests built while the
suite runs]).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_HAVE_TOOLS = shutil.which("make") is not None and shutil.which(os.environ.get("CXX", "g++"))
_BUILD_TARGET = "build/cpptest/plain/smddp_tests"  # the Makefile's test-cpp prerequisite

# Note [C++ tests built while the suite runs]: on a clean checkout this test spent most of its
# time (28 s of 35 in CI) compiling csrc/smddp and tests/cpp, while the suite around it
# leaves about a third of the machine's CPU idle (ranks waiting on peers, timeouts, process
# start-up). So tests/conftest.py starts that build when the session's tests are known, under
# nice 19, which the kernel schedules almost only on otherwise idle CPU; the test waits for
# it, then runs `make test-cpp` as before, which builds whatever is still missing (all of
# it, with the compiler's errors, if the background build failed) and runs the cases.
_background: subprocess.Popen | None = None


def _make_env() -> dict[str, str]:
    # A pytest run under `make test` must not hand make's jobserver to this one.
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def start_background_build() -> None:
    """Starts building the C++ tests at the lowest priority (Note [C++ tests built while the
    suite runs]); its output is discarded, the test's own make reports any failure."""
    global _background
    if _background is not None or not _HAVE_TOOLS or shutil.which("nice") is None:
        return
    _background = subprocess.Popen(
        ["nice", "-n", "19", "make", "-s", "-j2", _BUILD_TARGET],
        cwd=ROOT,
        env=_make_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, so that stop ends the compilers too
    )


def stop_background_build() -> None:
    """Ends a background build still running (a session that stopped early)."""
    global _background
    if _background is not None and _background.poll() is None:
        # SIGTERM: make and the compiler delete the files they were writing.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_background.pid, signal.SIGTERM)
        try:
            _background.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(_background.pid, signal.SIGKILL)
            _background.wait()
    _background = None


def _wait_for_background_build() -> None:
    """Returns once the background build has ended (two makes must not build the same files)."""
    global _background
    if _background is not None:
        try:
            _background.wait(timeout=900)
        except subprocess.TimeoutExpired:
            stop_background_build()
        _background = None


def _make(target: str, nice: bool = False) -> str:
    _wait_for_background_build()
    prefix = ["nice", "-n", "19"] if nice and shutil.which("nice") else []
    result = subprocess.run(
        [*prefix, "make", "-s", "-j2", target],
        cwd=ROOT,
        env=_make_env(),
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
    # The build at the lowest priority, as in the background (under xdist it runs beside the
    # ranks' tests: Note [Two workers, one of them for ranks] in tests/conftest.py); the cases
    # at normal priority, since some of them time faults.
    _make(_BUILD_TARGET, nice=True)
    output = _make("test-cpp")
    assert "FAIL" not in output, output[-6000:]
    summary = [line for line in output.splitlines() if "cases passed" in line]
    assert summary, output[-6000:]
    passed, total = summary[-1].split(" cases passed")[0].split(" of ")
    assert passed == total and int(total) >= 40, summary[-1]
