"""The split of `make test` between its two workers (Note [Two workers, one of them for ranks]
in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SHARED_MACHINE_UNIT_FILES, shares_the_machine

UNIT = Path(__file__).resolve().parent


def test_tests_that_start_ranks_share_one_worker_and_the_others_do_not():
    assert shares_the_machine("tests/distributed/test_hybrid_shard.py::test_parity[gloo]")
    assert shares_the_machine("tests/gpu/test_smddp_cuda.py::test_all_reduce")
    assert shares_the_machine("tests/unit/test_launch_env.py::test_torchrun")
    assert not shares_the_machine("tests/unit/test_config.py::test_unknown_key[a::b]")
    assert not shares_the_machine("tests/unit/test_distributed_names.py::test_x")


def test_the_listed_unit_files_exist():
    # A renamed file would leave the list and run beside the ranks unnoticed.
    for name in SHARED_MACHINE_UNIT_FILES:
        assert (UNIT / name).is_file(), name
