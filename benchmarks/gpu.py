"""``python -m benchmarks gpu``: smddp's staged all-reduce against its own bound.

Prints, from ranks spawned on this host (several may share one GPU):

1. Device<->host copy bandwidth, pinned and pageable host memory.
2. all_reduce against message size, for each of ``--dtypes`` (float32 and bfloat16, the
   dtype SMP's scripts reduce in): the three stages of the staged path, each alone and every
   rank at once (device->host, smddp's CPU all_reduce on host buffers, host->device); the
   serial sum and the pipelined bound they give (Note [Staging bounds] in gpu_report.py);
   smddp with pinned host buffers and with the shared-memory pool; NCCL where it can run (one
   GPU per rank: NCCL refuses two ranks on one GPU); and the copy floor, every rank copying its
   tensor to host memory and back. Medians over ``--iters``, each cell the slowest rank's; a
   staged call is timed from issue until the current stream has waited on its result.
3. With ``--timeline``: the phases of one call per rank for each of ``--timeline-sizes``
   (Note [Staging timeline] in csrc/smddp/backend/device_staging.h).
4. The kernels the staged all-reduce launched (torch.profiler): the design says none besides
   copies.

``--device cpu`` rehearses it without a GPU through the staging seam: the staged groups take
CPU tensors down the device path (``stage_cpu``), with plain copies and no streams, and every
part but 1 and 4 runs. Its figures say nothing about a GPU. With ``--device cuda`` (the
default) and no CUDA, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import comma_list, run_ranks, set_rank_environment
from benchmarks.collectives import parse_size
from benchmarks.gpu_report import STAGES, report

DEFAULT_SIZES = "64K,1M,4M,16M,64M,256M"
COPY_SIZES = (1 << 20, 16 << 20, 256 << 20)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__)
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default), or cpu: the rehearsal through the staging seam",
    )
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--sizes", type=comma_list(), default=DEFAULT_SIZES.split(","))
    p.add_argument("--dtypes", type=comma_list(), default=list(DTYPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    p.add_argument(
        "--chunk-bytes",
        default=None,
        help="the staged groups' staging_chunk_bytes (default: SMDDP_STAGING_CHUNK_BYTES's)",
    )
    p.add_argument("--no-table", action="store_true", help="leave out part 2 (the table)")
    p.add_argument("--timeline", action="store_true", help="print one call's phases per rank")
    p.add_argument("--timeline-sizes", type=comma_list(), default=["64K", "16M"])
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes]
    args.timeline_sizes = [parse_size(s) for s in args.timeline_sizes]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes {','.join(unknown)}: not one of {', '.join(DTYPES)}")
    return args


def _host_us(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


class _Rig:
    """What differs between a GPU and the CPU rehearsal: the device, the clock, the groups."""

    def __init__(self, kind: str, rank: int) -> None:
        self.cuda = kind == "cuda"
        self.device = torch.device("cpu")
        if self.cuda:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_us(self, fn: Callable[[], Any]) -> float:
        """µs of ``fn`` on the device's clock: on a GPU, until the current stream is done."""
        if not self.cuda:
            return _host_us(fn)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    def staged_options(self, chunk_bytes: str | None, timeline: bool = False) -> dict[str, Any]:
        """The staged groups' options by column name, the one the bounds compare first."""
        from torch_sagemaker.smddp import SMDDPOptions

        common: dict[str, Any] = {"staging_chunk_bytes": chunk_bytes, "timeline": timeline or None}
        if not self.cuda:
            return {"smddp staged": SMDDPOptions(stage_cpu=True, **common)}
        return {
            "smddp pinned": SMDDPOptions(staging_memory="pinned", **common),
            "smddp pool": SMDDPOptions(staging_memory="pool", **common),
        }


def _median(rig: _Rig, fn: Callable[[], Any], iters: int, warmup: int, host: bool = False) -> float:
    """Median µs of ``fn``, every rank starting together; ``host``: on the host's clock."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        rig.sync()
        t = _host_us(fn) if host else rig.time_us(fn)
        if i >= warmup:
            times.append(t)
    return statistics.median(times)


def _stages(rig: _Rig, nbytes: int, dtype: torch.dtype, iters: int, warmup: int) -> dict:
    """Each stage of the staged path alone (Note [Staging bounds]), in µs."""
    dev = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=rig.device)
    host = rig.host_like(dev)
    return {
        "D2H": _median(rig, lambda: rig.copy(host, dev), iters, warmup),
        # smddp's CPU path: a CPU tensor on the default group, in the caller's thread.
        "host all_reduce": _median(rig, lambda: dist.all_reduce(host), iters, warmup, host=True),
        "H2D": _median(rig, lambda: rig.copy(dev, host), iters, warmup),
    }


def _row(rig: _Rig, groups: dict, size: int, dtype: str, it: int, wu: int) -> dict:
    """One size and dtype: its stages alone, each group's all_reduce, the copy floor (µs)."""
    row: dict[str, Any] = {"size": size, "dtype": dtype}
    row.update(_stages(rig, size, DTYPES[dtype], it, wu))
    t = torch.zeros(size // DTYPES[dtype].itemsize, dtype=DTYPES[dtype], device=rig.device)
    for column, g in groups.items():

        def call(g: Any = g) -> None:
            dist.all_reduce(t, group=g, async_op=True).wait()  # the current stream waits

        row[column] = _median(rig, call, it, wu)
    host = rig.host_like(t)

    def round_trip() -> None:
        rig.copy(host, t)
        rig.copy(t, host)

    row["copy D2H+H2D"] = _median(rig, round_trip, it, wu)
    return row


def _rows(rig: _Rig, groups: dict, chunk_bytes: int, args: argparse.Namespace) -> list[dict]:
    it, wu = args.iters, args.warmup
    chunk = {
        name: _stages(rig, chunk_bytes, DTYPES[name], it, wu)
        for name in args.dtypes
        if any(size > chunk_bytes for size in args.sizes)
    }
    rows = []
    for size in args.sizes:
        for name in args.dtypes:
            row = _row(rig, groups, size, name, it, wu)
            row["chunk"] = chunk[name] if size > chunk_bytes else {k: row[k] for k in STAGES}
            rows.append(row)
    return rows


def _timeline_call(rig: _Rig, group, size: int, dtype: str, iters: int, warmup: int) -> dict:
    """The phases of the middle timed call on this rank (Note [Staging timeline]).

    Besides smddp's spans, the benchmark's own on the same clock (CLOCK_MONOTONIC, which
    ``time.monotonic_ns`` reads on Linux):
    ``bench: call and wait`` from before ``dist.all_reduce`` to ``wait()``'s return, and
    ``bench: stream done`` from then until the device has finished.
    """
    from torch_sagemaker._torch_compat import c10d as c10d_compat

    t = torch.zeros(size // DTYPES[dtype].itemsize, dtype=DTYPES[dtype], device=rig.device)
    pg = c10d_compat.backend_of(group, rig.device)
    pg._staging_timeline()  # drop what earlier calls left
    stamps = []
    for _ in range(warmup + iters):
        dist.barrier()
        rig.sync()
        before = time.monotonic_ns()
        dist.all_reduce(t, group=group, async_op=True).wait()
        waited = time.monotonic_ns()
        rig.sync()
        stamps.append((before, waited, time.monotonic_ns()))
    spans = pg._staging_timeline()
    if not spans:
        raise RuntimeError("bench gpu --timeline: the staged calls recorded no phases")
    first = min(seq for seq, *_ in spans)  # the group's staged calls are numbered in order
    middle = warmup + iters // 2
    mine = [[phase, b, e, n] for seq, phase, b, e, n in spans if seq == first + middle]
    before, waited, done = stamps[middle]
    mine += [["bench: call and wait", before, waited, 0], ["bench: stream done", waited, done, 0]]
    median_us = statistics.median((d - b) / 1e3 for b, _, d in stamps[warmup:])
    return {"size": size, "dtype": dtype, "spans": mine, "median_us": median_us}


def _copy_bandwidth(device: torch.device) -> list[dict]:
    rows = []
    for nbytes in COPY_SIZES:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for kind, host in (
            ("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
            ("pageable", torch.empty(nbytes, dtype=torch.uint8)),
        ):
            for direction, (dst, src) in (("D2H", (host, dev)), ("H2D", (dev, host))):
                times = []
                for _ in range(5):
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                rows.append(
                    {
                        "bytes": nbytes,
                        "host": kind,
                        "dir": direction,
                        "GBps": nbytes / statistics.median(times) / 1e9,
                    }
                )
    return rows


def _staged_kernels(group, device: torch.device) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    t = torch.ones(4 << 20, device=device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n for n in names if not n.startswith(("Memcpy", "Memset")))


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    set_rank_environment(rank, world, port)
    import torch_sagemaker  # noqa: F401  (registers smddp)
    from torch_sagemaker._torch_compat import c10d as c10d_compat

    rig = _Rig(args.device, rank)
    dist.init_process_group("smddp", timeout=timedelta(seconds=600))
    ranks = list(range(world))
    staged = rig.staged_options(args.chunk_bytes)
    groups = {name: dist.new_group(ranks, pg_options=o) for name, o in staged.items()}
    one_gpu_each = rig.cuda and torch.cuda.device_count() >= world
    if not args.no_nccl and dist.is_nccl_available() and one_gpu_each:
        groups["nccl"] = dist.new_group(ranks, backend="nccl")
    first = groups[next(iter(staged))]
    settings = c10d_compat.backend_of(first, rig.device)._settings()
    chunk_bytes = int(settings["staging_chunk_bytes"])
    result: dict[str, Any] = {
        "rank": rank,
        "cuda": rig.cuda,
        "staged": list(staged),
        "chunk_bytes": chunk_bytes,
        "copies": _copy_bandwidth(rig.device) if rig.cuda and rank == 0 else None,
        "rows": [] if args.no_table else _rows(rig, groups, chunk_bytes, args),
        "timeline": [],
    }
    if args.timeline:
        options = next(iter(rig.staged_options(args.chunk_bytes, timeline=True).values()))
        recorded = dist.new_group(ranks, pg_options=options)
        result["timeline"] = [
            _timeline_call(rig, recorded, size, args.dtypes[0], args.iters, args.warmup)
            for size in args.timeline_sizes
        ]
    if rig.cuda:
        result["kernels"] = _staged_kernels(first, rig.device)
        result["gpus"] = torch.cuda.device_count()
        result["device"] = torch.cuda.get_device_name(rig.device)
    queue.put(result)
    dist.destroy_process_group()


def _slowest(rows: list[dict]) -> dict:
    """One row from every rank's: each time the slowest rank's."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if key == "chunk":
            out[key] = {k: max(r[key][k] for r in rows) for k in value}
        elif isinstance(value, float):
            out[key] = max(r[key] for r in rows)
    return out


def merge(results: list[dict]) -> dict:
    """Rank 0's result with every rank's rows and timelines folded in (the slowest rank's times).

    Args:
        results: One result per rank, in any order (each names its ``rank``).
    """
    by_rank = sorted(results, key=lambda r: r["rank"])
    merged = dict(by_rank[0])
    merged["rows"] = [_slowest(list(rows)) for rows in zip(*(r["rows"] for r in by_rank))]
    merged["timeline"] = [
        {
            **calls[0],
            "spans": [c["spans"] for c in calls],
            "median_us": max(c["median_us"] for c in calls),
        }
        for calls in zip(*(r["timeline"] for r in by_rank))
    ]
    return merged


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its tables; 2 when asked for CUDA where there is none."""
    args = _parse(argv or [])
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench gpu needs CUDA (torch.cuda.is_available() is False here); ", end="")
        print("--device cpu rehearses it")
        return 2
    results = run_ranks(_rank, args.nprocs, args, results=args.nprocs)
    print(report(merge(results), args.nprocs))
    return 0
