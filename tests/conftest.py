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

from pathlib import Path

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
    # Note [C++ tests built while the suite runs] in tests/unit/test_cpp_core.py.
    if any(
        item.nodeid.endswith("test_cpp_core.py::test_cpp_core_tests_pass") for item in session.items
    ):
        from tests.unit import test_cpp_core

        test_cpp_core.start_background_build()


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
