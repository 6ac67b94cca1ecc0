"""``python -m torch_sagemaker.bench gpu``: smddp on CUDA tensors against NCCL.

Prints, from ranks spawned on this host (several may share one GPU):

1. Device<->host copy bandwidth, pinned and pageable host memory (what the staged path of
   Note [Device staging] in csrc/smddp/backend/device_staging.h is bounded by).
2. all_reduce time against message size: smddp with pinned host buffers, smddp with the
   shared-memory pool, and NCCL as the same-run baseline where it can run (one GPU per
   rank: NCCL refuses two ranks on one GPU). Medians over ``--iters``, timed from issue to
   the current stream having waited on the result.
   The same-run floor beside them: every rank copying its tensor to pinned host memory and
   back (``copy D2H+H2D``).
3. The kernels the staged all-reduce launched (torch.profiler): the design says none
   besides copies.

Needs CUDA; on a machine without it, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker.bench import comma_list, run_ranks, set_rank_environment
from torch_sagemaker.bench.collectives import parse_size
from torch_sagemaker.bench.collectives_report import format_size

DEFAULT_SIZES = "64K,1M,4M,16M,64M,256M"
COPY_SIZES = (1 << 20, 16 << 20, 256 << 20)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_sagemaker.bench gpu", description=__doc__)
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--sizes", type=comma_list(), default=DEFAULT_SIZES.split(","))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes]
    return args


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


def _time_all_reduce(t: torch.Tensor, group, iters: int, warmup: int) -> float:
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        dist.all_reduce(t, group=group, async_op=True).wait()  # the stream waits
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _time_round_trip(t: torch.Tensor, iters: int, warmup: int) -> float:
    """Median µs of copying ``t`` to pinned host memory and back on one stream.

    The floor of any staged collective on one GPU that does not overlap its two copies
    (the staged path overlaps them by chunks, so it can come in under this).
    """
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    times = []
    for i in range(warmup + iters):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        host.copy_(t, non_blocking=True)
        t.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


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
    from torch_sagemaker.distributed import SMDDPOptions

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("smddp", timeout=timedelta(seconds=600))
    ranks = list(range(world))
    groups = {
        "smddp pinned": dist.new_group(ranks, pg_options=SMDDPOptions(staging_memory="pinned")),
        "smddp pool": dist.new_group(ranks, pg_options=SMDDPOptions(staging_memory="pool")),
    }
    one_gpu_each = torch.cuda.device_count() >= world
    if not args.no_nccl and dist.is_nccl_available() and one_gpu_each:
        groups["nccl"] = dist.new_group(ranks, backend="nccl")
    result: dict[str, Any] = {
        "copies": _copy_bandwidth(device) if rank == 0 else None,
        "rows": [],
    }
    for size in args.sizes:
        t = torch.ones(size // 4, device=device)
        row = {"size": size}
        for name, g in groups.items():
            row[name] = _time_all_reduce(t, g, args.iters, args.warmup)
        dist.barrier()
        row["copy D2H+H2D"] = _time_round_trip(t, args.iters, args.warmup)
        result["rows"].append(row)
    result["kernels"] = _staged_kernels(groups["smddp pinned"], device)
    result["backends"] = [*groups, "copy D2H+H2D"]
    result["gpus"] = torch.cuda.device_count()
    result["device"] = torch.cuda.get_device_name(device)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def _report(r: dict, world: int) -> str:
    lines = [f"{world} ranks on {r['gpus']} GPU(s) ({r['device']})", "", "copy bandwidth:"]
    lines += ["| bytes | host memory | direction | GB/s |", "|---|---|---|---|"]
    for c in r["copies"]:
        lines.append(f"| {format_size(c['bytes'])} | {c['host']} | {c['dir']} | {c['GBps']:.1f} |")
    base = r["backends"][0]
    head = ["size"] + [f"{b} (us)" for b in r["backends"]]
    head += [f"{b} / {base}" for b in r["backends"][1:]]
    lines += ["", "all_reduce float32, median:", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    for row in r["rows"]:
        cells = [format_size(row["size"])] + [f"{row[b]:.0f}" for b in r["backends"]]
        cells += [f"{row[b] / row[base]:.2f}" for b in r["backends"][1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "copy D2H+H2D: every rank copying its tensor to pinned host memory and back at the "
        "same time, as the staged ranks do: the floor of a staged collective whose two "
        "copies do not overlap"
    )
    if "nccl" not in r["backends"]:
        lines.append("(no NCCL baseline: NCCL needs one GPU per rank)")
    kernels = r["kernels"]
    lines += ["", f"kernels besides copies in a staged all_reduce: {kernels or 'none'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its tables; 2 when CUDA is not available."""
    args = _parse(argv or [])
    if not torch.cuda.is_available():
        print("bench gpu needs CUDA (torch.cuda.is_available() is False here)")
        return 2
    result = run_ranks(_rank, args.nprocs, args)[0]
    print(_report(result, args.nprocs))
    return 0
