"""Runs PyTorch's whole DistributedTest suite on gloo and on smddp and lists the cases gloo
passes and smddp does not.

    python -m tests.distributed.torch_suite_compare [--backends gloo,smddp] [-k SUBSTRING]
        [--chunk 25] [--spawn] [--run-skipped] [--out results.json]

By default the cases run in chunks, one after another in the same three ranks
(``torch_suite_driver.run_cases``); a chunk whose ranks fail or hang is rerun case by case
in fresh ranks, so one broken case cannot hide the others. ``--spawn`` runs every case in
freshly spawned ranks instead, exactly as PyTorch does (pytest on ``torch_suite_driver``),
which is slower; use it to confirm a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

from tests.distributed.launcher import DistributedTestError, run_distributed

WORLD_SIZE = 3


def case_names() -> list[str]:
    os.environ.setdefault("BACKEND", "gloo")  # the suite reads these when imported
    os.environ.setdefault("WORLD_SIZE", str(WORLD_SIZE))
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
    from tests.distributed.torch_suite_driver import TestDistBackendWithSpawn

    return list(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


def _chunk(names, root, honour_skips=True):
    from tests.distributed.torch_suite_driver import run_cases

    return run_cases(names, root, honour_skips=honour_skips)


def _merge(per_rank: list[dict]) -> dict[str, tuple[str, str]]:
    """One outcome per case: failed if any rank failed, skipped if every rank skipped."""
    merged = {}
    for name in per_rank[0]:
        outcomes = [r[name] for r in per_rank]
        failed = [o for o in outcomes if o[0] == "failed"]
        if failed:
            merged[name] = failed[0]
        elif all(o[0] == "skipped" for o in outcomes):
            merged[name] = outcomes[0]
        else:
            merged[name] = ("passed", "")
    return merged


def run_in_pool(
    backend: str, names: list[str], chunk: int, honour_skips: bool = True
) -> dict[str, tuple[str, str]]:
    env = {"BACKEND": backend, "WORLD_SIZE": str(WORLD_SIZE)}
    results: dict[str, tuple[str, str]] = {}
    for start in range(0, len(names), chunk):
        part = names[start : start + chunk]
        batches = [part]
        while batches:
            batch = batches.pop(0)
            root = tempfile.mkdtemp(prefix=f"torch_suite_{backend}_")
            try:
                per_rank = run_distributed(
                    _chunk,
                    batch,
                    root,
                    honour_skips,
                    world_size=WORLD_SIZE,
                    init_process_group=False,
                    timeout=120 + 90 * len(batch),
                    env={**env, "TEMP_DIR": root},
                )
                results.update(_merge(per_rank))
            except DistributedTestError as e:
                if len(batch) > 1:  # isolate the case that broke the ranks
                    batches = [[n] for n in batch] + batches
                else:
                    results[batch[0]] = ("failed", str(e)[-2000:])
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(
                f"[{backend}] {len(results)}/{len(names)} cases done", file=sys.stderr, flush=True
            )
    return results


def run_spawned(backend: str, names: list[str]) -> dict[str, tuple[str, str]]:
    results = {}
    for name in names:
        root = tempfile.mkdtemp(prefix=f"torch_suite_{backend}_")
        env = {**os.environ, "BACKEND": backend, "WORLD_SIZE": str(WORLD_SIZE), "TEMP_DIR": root}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rA",
                f"tests/distributed/torch_suite_driver.py::TestDistBackendWithSpawn::{name}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        shutil.rmtree(root, ignore_errors=True)
        out = proc.stdout
        if " passed" in out and " failed" not in out:
            results[name] = ("passed", "")
        elif " skipped" in out and " failed" not in out:
            reason = [line for line in out.splitlines() if line.startswith("SKIPPED")]
            results[name] = ("skipped", reason[0] if reason else "")
        else:
            results[name] = ("failed", out[-2000:])
        print(f"[{backend}] {name}: {results[name][0]}", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="gloo,smddp")
    parser.add_argument("-k", dest="filter", default="", help="only cases containing this")
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument("--spawn", action="store_true", help="every case in fresh processes")
    parser.add_argument("--out", default="", help="write the outcomes as JSON here")
    parser.add_argument(
        "--run-skipped",
        action="store_true",
        help="also run cases the suite restricts to other backends by name "
        "(in the same ranks only)",
    )
    args = parser.parse_args()
    names = [n for n in case_names() if args.filter in n]
    outcomes = {}
    for backend in args.backends.split(","):
        start = time.monotonic()
        if args.spawn:
            outcomes[backend] = run_spawned(backend, names)
        else:
            outcomes[backend] = run_in_pool(backend, names, args.chunk, not args.run_skipped)
        print(
            f"[{backend}] {len(names)} cases in {time.monotonic() - start:.0f} s", file=sys.stderr
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(outcomes, f, indent=1)
    for backend, res in outcomes.items():
        counts = {
            k: sum(1 for o, _ in res.values() if o == k) for k in ("passed", "skipped", "failed")
        }
        print(f"{backend}: {counts}")
    if {"gloo", "smddp"} <= set(outcomes):
        gloo, smddp = outcomes["gloo"], outcomes["smddp"]
        worse = [n for n in names if gloo[n][0] == "passed" and smddp[n][0] != "passed"]
        print(f"gloo passes, smddp does not ({len(worse)}):")
        for n in worse:
            detail = smddp[n][1].strip().splitlines()
            print(f"  {n}: {smddp[n][0]}: {detail[-1] if detail else ''}")


if __name__ == "__main__":
    main()
