"""Marks every test with its tier, from the directory it lives in.

- ``tests/unit``: ``unit`` (no processes spawned for ranks; seconds in all);
- ``tests/distributed``: ``distributed`` (ranks spawned by ``launcher.run_distributed``);
- ``tests/gpu``: ``gpu`` (skip themselves without CUDA).

So ``pytest -m "not distributed"`` is the fast tier and ``-m distributed`` the slow one,
whatever markers a file sets itself. ``slow`` stays a per-test marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit": pytest.mark.unit, "distributed": pytest.mark.distributed, "gpu": pytest.mark.gpu}
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(item.fspath).resolve().relative_to(_TESTS).parts[0]
        except ValueError:  # a test outside tests/ (not collected by default)
            continue
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])
