"""Runs PyTorch's own distributed test suite (``DistributedTest._DistTestBase``) against a
backend, the way PyTorch's ``test/distributed/test_distributed_spawn.py`` runs it for gloo.

That file is not shipped in the wheel; this module is our equivalent. It needs, like
PyTorch's, the environment variables ``BACKEND`` ("smddp" or "gloo"), ``WORLD_SIZE``,
``TEMP_DIR`` (an existing directory) and optionally ``INIT_METHOD``, set before it is
imported (the suite reads them at import time). Two ways to run it:

- every case in freshly spawned ranks, exactly as PyTorch does (slow: each case starts
  ``WORLD_SIZE`` Python processes)::

      BACKEND=smddp WORLD_SIZE=3 TEMP_DIR=$(mktemp -d) \\
          python -m pytest tests/distributed/torch_suite_driver.py -k test_all_reduce_sum

  ``python -m tests.distributed.torch_suite_compare`` runs the whole suite this way on gloo
  and on smddp and lists the cases gloo passes and smddp does not.
- many cases one after another in the same ranks (``run_cases``, what
  ``tests/distributed/test_torch_suite.py`` uses): each case still runs through the suite's
  own per-rank entry point (``TestDistBackend._run``: its own process group over a fresh
  FileStore, the suite's barriers, its skip and error exit codes), only without starting
  new processes for it.

The suite decides what a backend supports from sets in ``DistTestCases``; smddp is
declared there as what it is: a CPU backend with DDP and sub-group support, loaded as a
plugin. Nothing else of the suite is changed.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases

import torch_sagemaker  # noqa: F401  (registers "smddp" in this process and in spawned ranks)

if os.environ.get("BACKEND") == "smddp":
    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("smddp")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    Barrier,
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Every test of the suite, each in ``WORLD_SIZE`` freshly spawned ranks."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.01)


def _outcome(code, traceback_text: str) -> tuple[str, str]:
    from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcessTestCase

    if code in (0, None):
        return "passed", ""
    if code == MultiProcessTestCase.TEST_ERROR_EXIT_CODE:
        return "failed", traceback_text
    for skip in TEST_SKIPS.values():
        if code == skip.exit_code:
            return "skipped", skip.message
    return "failed", f"exit code {code}"


def run_cases(
    names: list[str], root: str, case_timeout_s: float = 300, honour_skips: bool = True
) -> dict[str, tuple[str, str]]:
    """Runs the suite's ``names`` one after another on this rank (every rank of the job
    calls it with the same arguments, ``RANK`` and ``WORLD_SIZE`` set).

    Each case gets its own directory under ``root`` (the suite's ``TEMP_DIR``: barrier
    files, FileStore) and starts and ends on every rank together. With ``honour_skips``
    false, cases the suite marks skipped before starting ranks (many are restricted to gloo
    by name) run anyway; skips decided inside a case still apply.

    Returns:
        ``{name: (outcome, detail)}`` with outcome "passed", "skipped" (detail: the
        suite's reason) or "failed" (detail: the traceback).
    """
    import multiprocessing
    import traceback

    from torch.testing._internal.common_distributed import MultiProcessTestCase

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Some cases set TORCH_DISTRIBUTED_DEBUG and leave it set (with_dist_debug_levels); a
    # spawned rank would start the next case without it.
    debug_level = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    results = {}
    for k, name in enumerate(names):
        # A case the suite marks skipped for this backend (skip_but_pass_in_sandcastle_if sets
        # __unittest_skip__) never starts its ranks under unittest; calling the rank entry
        # point directly would run it anyway.
        method = getattr(TestDistBackendWithSpawn, name)
        if honour_skips and getattr(method, "__unittest_skip__", False):
            results[name] = ("skipped", getattr(method, "__unittest_skip_why__", ""))
            continue
        case_dir = os.path.join(root, f"case{k}")
        if rank == 0:
            for sub in ("barrier", "test_dir", "init_dir"):
                os.makedirs(os.path.join(case_dir, sub))
            open(os.path.join(case_dir, "ready"), "w").close()
        _wait_for(os.path.join(case_dir, "ready"), case_timeout_s)
        os.environ["TEMP_DIR"] = case_dir
        if debug_level is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug_level
        dist.set_debug_level_from_env()
        Barrier.barrier_id = 0  # a fresh process starts at 0; its directory is fresh too
        receive, send = multiprocessing.Pipe(duplex=False)
        code, extra = 0, ""
        try:
            TestDistBackendWithSpawn._run(rank, name, os.path.join(case_dir, "store"), send)
        except SystemExit as e:  # the suite ends every rank with an exit code
            code = e.code
        except Exception:  # raised outside the test itself (process group creation)
            code, extra = MultiProcessTestCase.TEST_ERROR_EXIT_CODE, traceback.format_exc()
        # The suite ends a skipped or failed case with sys.exit before its own
        # destroy_process_group (a spawned rank exits there); here the rank lives on.
        if dist.is_initialized():
            dist.destroy_process_group()
        tb = extra
        try:
            if receive.poll():  # run_test sends the traceback of a failure, then closes
                tb = receive.recv()
        except EOFError:
            pass
        results[name] = _outcome(code, tb)
        open(os.path.join(case_dir, f"done{rank}"), "w").close()
        for r in range(world):
            _wait_for(os.path.join(case_dir, f"done{r}"), case_timeout_s)
    return results
