"""Parent side: runs many families per launch of ranks, and survives the ones that fail.

The parent has imported torch and transformers; the ranks are forked from it (seconds
saved per rank on a small machine), join one gloo group, ``tsm.init`` once, and run the
families in order, sending each result to the parent as soon as it is done. A family that
raises on any rank, or takes longer than the timeout, ends the launch (the other ranks may
be waiting in a collective the failed rank will never join): the parent records the
error, kills the ranks and starts a fresh launch with the families that remain.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tools.ranks import free_port, set_rank_environment

#: Seconds the other ranks get to report the same family after one rank raised.
GRACE = 20.0
#: Launches that may fail to start (the free port taken by another process meanwhile).
START_ATTEMPTS = 3


class _StartError(RuntimeError):
    """A rank could not join the process group or ``tsm.init``."""


def _rank_main(
    rank: int,
    world: int,
    port: int,
    families: list[str],
    config: dict,
    timeout: float,
    out: Any,
    fsdp: int,
) -> None:
    set_rank_environment(rank, world, port, "ERROR")
    import logging
    import warnings

    import torch
    import transformers

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    # DTensor logs a warning per suboptimal redistribution; the report is the output here.
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        import torch.sagemaker as tsm

        from tools.model_coverage.parity import error_summary, family_parity

        tsm.init(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("error", rank, None, f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    # The rank is a fork of the process that launched it and holds all its objects (a test
    # session's, or the command's imports). Frozen, no garbage collection walks them again,
    # as in the distributed tests' ranks (Note [Start-up objects frozen] in
    # tests/distributed/launcher.py).
    gc.freeze()
    out.put(("ready", rank, None, None, None))
    for family in families:
        try:
            result = family_parity(family, fsdp)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out.put(("error", rank, family, error_summary(e), traceback.format_exc()))
            return
        out.put(("result", rank, family, result, None))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _launch(
    families: list[str],
    world: int,
    config: dict,
    timeout: float,
    log: Callable[[str], None],
    fsdp: int = 2,
) -> tuple[dict[str, Any], list[str]]:
    """One launch of ``world`` ranks over ``families``, in order.

    Returns:
        Results by family (a list of per-rank results, or the error that ended the launch)
        and the families the launch did not reach.
    """
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, port, families, config, timeout, out, fsdp),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[str, Any] = {}
    per_rank: dict[str, dict[int, Any]] = {}
    errors: dict[str, dict[int, str]] = {}
    index, deadline, grace_end = 0, time.monotonic() + timeout, None
    try:
        while index < len(families):
            family = families[index]
            done = per_rank.get(family, {})
            if len(done) == world:
                if family in errors:
                    reason = errors[family][min(errors[family])]
                    results[family] = reason
                    log(f"  {family}: {reason}")
                    return results, families[index + 1 :]
                results[family] = [done[r] for r in range(world)]
                log(f"  {family}: done in {time.monotonic() - deadline + timeout:.0f} s")
                index += 1
                deadline = time.monotonic() + timeout
                continue
            now = time.monotonic()
            wait_until = min(deadline, grace_end) if grace_end else deadline
            if now >= wait_until:
                missing = sorted(set(range(world)) - set(per_rank.get(family, {})))
                got = errors.get(family)
                reason = (
                    next(iter(got.values()))
                    if got
                    else (f"timed out after {timeout:.0f} s (ranks {missing} did not finish)")
                )
                results[family] = reason
                log(f"  {family}: {reason}")
                return results, families[index + 1 :]
            try:
                kind, rank, fam, payload, tb = out.get(timeout=min(1.0, wait_until - now))
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and out.empty():
                    grace_end = time.monotonic()
                continue
            if fam is None:
                if kind == "error":
                    raise _StartError(f"rank {rank} could not start: {payload}\n{tb}")
                continue
            if kind == "error":
                errors.setdefault(fam, {})[rank] = payload
                grace_end = grace_end or time.monotonic() + GRACE
                per_rank.setdefault(fam, {})[rank] = None
            else:
                per_rank.setdefault(fam, {})[rank] = payload
        return results, []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        out.close()


def run_families(
    families: list[str],
    *,
    world: int,
    config: dict,
    timeout: float,
    log: Callable[[str], None] = print,
    fsdp: int = 2,
) -> dict[str, Any]:
    """Runs ``families`` on ``world`` forked ranks, as many launches as failures need.

    ``fsdp``: the FSDP version each family is wrapped in (``parity.family_parity``).

    Returns:
        By family: a list of per-rank results, or the error that ended it.
    """
    results: dict[str, Any] = {}
    remaining = list(families)
    failed_starts = 0
    while remaining:
        log(f"launch of {world} ranks for {len(remaining)} families")
        try:
            done, remaining = _launch(remaining, world, config, timeout, log, fsdp)
        except _StartError as e:
            failed_starts += 1
            if failed_starts == START_ATTEMPTS:
                raise
            log(f"  the launch did not start ({str(e).splitlines()[0]}); again")
            continue
        results.update(done)
    return results
