"""Marks every test with its tier, from the directory it lives in.

- ``tests/unit``: ``unit`` (no processes spawned for ranks; seconds in all);
- ``tests/distributed``: ``distributed`` (ranks spawned by ``launcher.run_distributed``);
- ``tests/gpu``: ``gpu`` (skip themselves without CUDA).

So ``pytest -m "not distributed"`` is the fast tier and ``-m distributed`` the slow one,
whatever markers a file sets itself. ``slow`` stays a per-test marker. The files of
``COMPAT_FILES`` are also marked ``compat``: the subset ``make test-compat`` runs on each
supported torch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

_TIERS = {"unit": pytest.mark.unit, "distributed": pytest.mark.distributed, "gpu": pytest.mark.gpu}
# The distributed files that `make test-compat` runs on every supported torch besides the fast
# tier (docs/compatibility.md): the collectives, each parallelism's parity, resharding
# checkpoints and SMP's own scripts.
COMPAT_FILES = frozenset(
    {
        "test_smddp_collectives.py",
        "test_hybrid_shard.py",
        "test_tp_parity.py",
        "test_context_parallel.py",
        "test_expert_parallel.py",
        "test_checkpoint_reshard.py",
        "test_smp_script_checkpoints.py",
    }
)
_TESTS = Path(__file__).resolve().parent


# Note [Two workers, one of them for ranks]: `make test` runs pytest-xdist's two workers. Every
# test that starts ranks, simulated hosts or smddp groups (tests/distributed, tests/gpu and
# SHARED_MACHINE_UNIT_FILES) is one unit of work, RANKS_GROUP, which runs in order on one
# worker, as in a run without workers: those tests assume a machine of their own (fixed
# namespace and host names, /dev/shm segments counted before and after, a 4-rank pool per 2
# cores). The other worker runs the single-process tests beside them, on CPU the ranks leave
# idle: the suite kept 0.80 of the 2 cores busy without workers (docs/log/suite.md). The
# grouping is our scheduler's, by path: xdist's own `--dist loadgroup` marks tests by
# rewriting their node ids, which pytest 9 no longer reads (every test went to either worker).
RANKS_GROUP = "ranks"
SHARED_MACHINE_UNIT_FILES = frozenset({"test_launch_env.py"})


def shares_the_machine(nodeid: str) -> bool:
    """Whether the test of ``nodeid`` runs in RANKS_GROUP (Note [Two workers, one of them for
    ranks])."""
    path = nodeid.split("::", 1)[0]
    return path.startswith(("tests/distributed/", "tests/gpu/")) or (
        path.rsplit("/", 1)[-1] in SHARED_MACHINE_UNIT_FILES
    )


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class RanksApart(LoadScopeScheduling):
        """Each test its own unit of work, but RANKS_GROUP's tests one unit together."""

        def _split_scope(self, nodeid: str) -> str:
            return RANKS_GROUP if shares_the_machine(nodeid) else nodeid

    return RanksApart(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(item.fspath).resolve().relative_to(_TESTS).parts[0]
        except ValueError:  # a test outside tests/ (not collected by default)
            continue
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])
        if tier == "distributed" and Path(item.fspath).name in COMPAT_FILES:
            item.add_marker(pytest.mark.compat)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Note [C++ tests built while the suite runs] in tests/unit/test_cpp_core.py. Not in an
    # xdist worker: every worker collects every test, and the test already runs beside the
    # ranks there (Note [Two workers, one of them for ranks]).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(
        item.nodeid.endswith("test_cpp_core.py::test_cpp_core_tests_pass") for item in session.items
    ):
        from tests.unit import test_cpp_core

        test_cpp_core.start_background_build()


def machine_line() -> str:
    """The CPU the tests ran on, for the end of every run (Note [The suite's time is the CPU's]).

    Returns:
        For example ``"machine: 2 CPUs, AMD EPYC (family 23, model 1), torch kernels AVX2"``.
    """
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():  # the first CPU's block is enough
                break
    cpu = fields.get("model name", "unknown CPU")
    if "cpu family" in fields:
        cpu += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    import torch

    kernels = torch.backends.cpu.get_cpu_capability()
    return f"machine: {os.cpu_count()} CPUs, {cpu}, torch kernels {kernels}"


# Note [The suite's time is the CPU's]: the machines this suite runs on are not one model. The
# same tests took 864.9 s under `.ci/run` on 2026-12-04 and 1593.1 s on 2026-12-05; a training
# step of the 58M Llama alone took 1.30-1.38 s on 2026-11-21 (that week's logs name AVX-512) and
# 2.92 s on a first-generation EPYC (family 23, model 1: AVX2 on 128-bit units) on 2026-12-05.
# So every run ends with the CPU it had, and a suite time is read beside it.
def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(machine_line())


def pytest_sessionfinish(session: pytest.Session) -> None:
    import sys

    module = sys.modules.get("tests.unit.test_cpp_core")
    if module is not None:
        module.stop_background_build()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port), shared by the session, stopped after.

    Yields a ``tests.s3_server.S3Server``; ``server.env`` points the library at it. Skips,
    naming the package, where moto is not installed (requirements-dev.txt installs it).
    """
    pytest.importorskip("moto.server", reason="needs moto[server] (requirements-dev.txt)")
    pytest.importorskip("s3torchconnector.dcp", reason="needs s3torchconnector[dcp]")
    from tests.s3_server import moto_s3

    with moto_s3() as server:
        yield server
