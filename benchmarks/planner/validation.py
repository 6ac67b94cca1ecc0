"""``python -m benchmarks planner {memory,time,public}``: the planner's validation tables.

- ``memory``: every case of ``validation_memory.CASES`` on 4 spawned CPU ranks; model state
  must match to the byte, saved activations within 10%. Prints the table.
- ``time``: calibrates this machine, runs ``bench training`` and ``bench multihost --train``
  (``validation_time``), prints predicted against measured step times, and with
  ``--record FILE`` writes the record that tests/unit/test_planner_time.py checks. Measure on
  a quiet machine: the record keeps the load average before and after.
- ``public``: the published SMP and HyperPod configurations (``public_configs``) through the
  planner: valid, memory, step time, next to what the source publishes.
- ``peak``: the predicted peak with 1, 2 and 4 micro-batches a step against each rank's
  resident-set high-water mark, on 2 CPU ranks (``validation_peak``), within 10%.

Exit status 1 when a prediction is outside its tolerance.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from benchmarks import cost_model_fit
from benchmarks.planner import validation_memory as vm
from benchmarks.planner import validation_time as vt

#: Where the recorded ``bench multihost`` runs the collective costs are fitted on live.
MULTIHOST_RUNS = os.path.join("tests", "data", "multihost", "*.json")


def _cases_rank(rank: int, world: int, port: int, what: str, queue: Any) -> None:
    """A spawned rank: joins a gloo group, runs ``what``'s cases, rank 0 sends every rank's."""
    import torch
    import torch.distributed as dist

    from benchmarks import end_rank, set_rank_environment
    from benchmarks.planner import validation_peak as vp

    set_rank_environment(rank, world, port, "ERROR")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    run_cases: dict[str, Callable[[], list[Any]]] = {"memory": vm.run_cases, "peak": vp.run_cases}
    mine = run_cases[what]()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        queue.put(every)
    end_rank(queue)


def validate_memory() -> int:
    """Runs the memory cases on 4 ranks and prints the table; 1 if a case is off."""
    from benchmarks import run_ranks

    per_rank = run_ranks(_cases_rank, 4, "memory")[0]
    verdicts = [vm.compare(case, [r[i] for r in per_rank]) for i, case in enumerate(vm.CASES)]
    print(vm.table(vm.CASES, verdicts, [r for r in per_rank[0]]))
    bad = [
        c.name
        for c, v in zip(vm.CASES, verdicts, strict=True)
        if not (v["state_exact"] and v["within"])
    ]
    if bad:
        print(f"\noutside tolerance: {', '.join(bad)}")
    return 1 if bad else 0


def validate_time(args: argparse.Namespace) -> int:
    """Calibrates, measures, prints the table and optionally records; 1 if a row is off."""
    from benchmarks.training import accumulation_problem

    problem = accumulation_problem(args.batch, args.accumulation)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    runs = []
    for path in sorted(glob.glob(args.costs_from)):
        with open(path) as f:
            runs.append(json.load(f))
    if not runs:
        print(
            f"no bench multihost runs match {args.costs_from!r} to fit the costs on",
            file=sys.stderr,
        )
        return 2
    record = vt.run(args, cost_model_fit.fit(cost_model_fit.points(runs)))
    print(
        f"load average before {record['load_average']['before']}, after "
        f"{record['load_average']['after']} on {record['cores']} cores"
    )
    print(vt.table(record))
    if args.record:
        with open(args.record, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"\nrecorded {args.record}")
    off = vt.out_of_tolerance(record)
    if off:
        print(f"\noutside {vt.TIME_TOLERANCE:.0%}: {', '.join(name for name, _ in off)}")
    return 1 if off else 0


def validate_peak() -> int:
    """Runs the peak cases on 2 ranks and prints each rank's table; 1 if a row is off."""
    from benchmarks import run_ranks
    from benchmarks.planner import validation_peak as vp

    per_rank = run_ranks(_cases_rank, 2, "peak")[0]
    bad = []
    for rank, rows in enumerate(per_rank):
        print(f"rank {rank}:\n{vp.table(rows)}\n")
        bad += [f"{r[0]} x{r[1]}" for r in rows if not vp.within(r)]
    if bad:
        print(f"outside {vp.PEAK_TOLERANCE:.0%}: {', '.join(bad)}")
    return 1 if bad else 0


def validate_public() -> int:
    """Prints the published configurations' table; 1 if one is invalid or does not fit."""
    from benchmarks.planner import public_configs

    rows = public_configs.evaluate_all()
    print(public_configs.table(rows))
    return 0 if all(r.valid and r.fits for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks planner``'s arguments."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("memory", help="model state exact, activations within 10%%, on 4 CPU ranks")
    sub.add_parser("public", help="the published SMP and HyperPod configurations")
    sub.add_parser("peak", help="predicted peaks with gradient accumulation, on 2 CPU ranks")
    t = sub.add_parser("time", help="calibrate, measure, compare step times")
    t.add_argument("--runs", type=int, default=3, help="passes of each measurement")
    t.add_argument("--nprocs", type=int, default=2, help="bench training's ranks")
    t.add_argument("--backends", default="smddp,gloo", help="bench training's backends")
    t.add_argument(
        "--modes",
        default="fsdp2_full,fsdp2_hybrid,ddp",
        help="bench training's modes ('' for none)",
    )
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--hidden", type=int, default=512)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--vocab", type=int, default=32000)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--batch", type=int, default=1, help="bench training's sequences per rank")
    t.add_argument(
        "--accumulation",
        type=int,
        default=1,
        help="bench training's micro-batches per step (divides --batch)",
    )
    t.add_argument(
        "--layouts",
        default="2x1,2x2,1x2,1x4",
        help="bench multihost --train layouts HxL ('' for none)",
    )
    t.add_argument("--rate", default="2gbit", help="each simulated host's NIC rate")
    t.add_argument("--timeout", type=float, default=900, help="seconds per multihost job")
    t.add_argument(
        "--costs-from",
        default=MULTIHOST_RUNS,
        help="bench multihost --json runs to fit the collective costs on",
    )
    t.add_argument("--record", help="write the record (calibration, rows, load) here")
    t.add_argument("--note", default="", help="free text kept in the record")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one validation; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.what == "memory":
        return validate_memory()
    if args.what == "public":
        return validate_public()
    if args.what == "peak":
        return validate_peak()
    return validate_time(args)


__all__ = [
    "build_parser",
    "main",
    "validate_memory",
    "validate_peak",
    "validate_public",
    "validate_time",
]
