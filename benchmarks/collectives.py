"""Collective benchmark in the style of nccl-tests: smddp and gloo side by side, one run.

    python -m benchmarks collectives [--nprocs 2] [--max-bytes 256M] [--plot out.png]
    torchrun --nproc-per-node 2 -m benchmarks collectives
    python -m benchmarks collectives --ops all_reduce --backends smddp,gloo,deepspeed

For every operation and size S (8 B .. 256 MiB by default, float32 data) each backend runs
warm-up iterations, then timed iterations; the reported time is the median over iterations
of the slowest rank (with ``--repeat N``, the median of N whole sweeps' medians, and each
speed-up the median of the N ratios taken within one sweep, with their range). As in
nccl-tests, S is the buffer size for all_reduce, broadcast and reduce, the *total* (gathered
/ scattered) size for all_gather_into_tensor, reduce_scatter_tensor, gather and scatter,
the per-rank send size for all_to_all and sendrecv (every rank sends S to the next rank and
receives S from the previous one with batch_isend_irecv), and the per-rank values of a sparse
embedding gradient for sparse_all_reduce; algbw = S / time and busbw = algbw x
factor (all_reduce 2(n-1)/n, all_gather, reduce_scatter, gather and scatter (n-1)/n,
broadcast, reduce, sendrecv and sparse_all_reduce 1,
all_to_all (n-1)/n).
The first iteration of every case is checked for correct values.

--backends lists torch.distributed backends (the first one is the default group's) and
optionally two peers that run all_reduce only: "smddp-direct", smddp's all-reduce through
``torch_sagemaker.smddp.direct.all_reduce_direct`` (no torch.distributed dispatch), and
"deepspeed": DeepSpeed's CPU shared-memory all-reduce, called directly (install with
``DS_ACCELERATOR=cpu pip install deepspeed``). The table has one speed-up column per other
column: its time / the time of ``--ratio-base`` (default: the first backend).

The same run measures memcpy bandwidth with all ranks copying at once; "copy%" is the time a
memcpy of the bytes the algorithm must read and write in the user's buffers would take at
that bandwidth, as a percentage of the measured time (100% = as fast as copying). Ranks use
one intra-op thread each.

``--pool`` takes smddp's operands from its tensor pool (``allocate_tensor``), as FSDP2 does
for its all-gather and reduce-scatter buffers on smddp: peers on the host then read a
rank's input in place instead of through a staged copy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import comma_list, end_rank, run_ranks
from benchmarks.collectives_report import (
    PASSES,
    busbw_factor,
    format_row,
    format_table,
    plot,
)
from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker._torch_compat import tensor as tensor_compat

DEFAULT_OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "sendrecv",
)
# Rooted collectives (root 0), on request: compare reduce with all_reduce, gather with
# all_gather_into_tensor and scatter with broadcast at the same S to see what rootedness saves.
# And the all_reduce of a sparse embedding gradient (DDP with nn.Embedding(sparse=True)).
OPS = DEFAULT_OPS + ("reduce", "gather", "scatter", "sparse_all_reduce")
# Peers that are not torch.distributed backends: name -> the ops they can run.
PEER_OPS = {"deepspeed": ("all_reduce",), "smddp-direct": ("all_reduce",)}


def parse_size(text: str) -> int:
    """Parses "8", "64K", "1M", "256M", "1G" into bytes."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def make_case(
    op: str,
    nbytes: int,
    world: int,
    rank: int,
    group,
    all_reduce=None,
    empty=None,
    dtype: torch.dtype = torch.float32,
    gather_in_place: bool = False,
):
    """Returns (run, check, actual_bytes) for one operation at about `nbytes`.

    `all_reduce`, if given, replaces dist.all_reduce (an in-place SUM of one tensor).
    `empty`, if given, allocates the operands (an element count -> a tensor of `dtype`)
    instead of torch.empty: ``--pool`` takes them from the backend's pool, as FSDP2 does. The
    sparse case ignores it (a sparse tensor has no pooled storage). `dtype`: the operands'
    element type (the checks' sums, at most a few hundred, are exact in bf16 and fp16 too).
    `gather_in_place`: the all-gather's input is this rank's part of its output, as FSDP2
    passes it.
    """
    esz = torch.empty(0, dtype=dtype).element_size()

    def alloc(n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype) if empty is None else empty(n)
        if t.dtype != dtype:
            raise ValueError(f"make_case: the allocator made {t.dtype}, the case is {dtype}")
        return t

    def full(n: int, value: float) -> torch.Tensor:
        return alloc(n).fill_(value)

    count = max(world, nbytes // esz // world * world)
    if op == "sparse_all_reduce":
        return _sparse_case(nbytes, world, rank, group)
    if op == "all_reduce":
        t = full(count, float(rank + 1))
        want = world * (world + 1) / 2
        if all_reduce is None:

            def run():
                dist.all_reduce(t, group=group)
        else:

            def run():
                all_reduce(t)

        def check():
            t.fill_(float(rank + 1))
            run()
            return bool((t[:: max(1, count // 97)] == want).all())

        return run, check, count * esz
    if op == "all_gather_into_tensor":
        if gather_in_place:
            out = alloc(count)
            inp = out.narrow(0, rank * (count // world), count // world).fill_(float(rank + 1))
        else:
            inp, out = full(count // world, float(rank + 1)), alloc(count)

        def run():
            c10d_compat.all_gather_single(out, inp, group=group)

        def check():
            # What a freed block of an earlier case left in `out` must not pass for a result.
            out.fill_(-1.0)
            inp.fill_(float(rank + 1))
            run()
            want = torch.arange(1, world + 1, dtype=dtype).repeat_interleave(count // world)
            return torch.equal(out, want)

        return run, check, count * esz
    if op == "reduce_scatter_tensor":
        inp, out = full(count, float(rank + 1)), alloc(count // world)

        def run():
            c10d_compat.reduce_scatter_single(out, inp, group=group)

        def check():
            out.fill_(-1.0)  # as for all_gather
            run()
            return bool((out == world * (world + 1) / 2).all())

        return run, check, count * esz
    if op == "broadcast":
        t = full(count, float(rank + 1))

        def run():
            dist.broadcast(t, group_src=0, group=group)

        def check():
            t.fill_(float(rank + 1))
            run()
            return bool((t[:: max(1, count // 97)] == 1).all())

        return run, check, count * esz
    if op == "reduce":
        t = full(count, float(rank + 1))

        def run():
            dist.reduce(t, group_dst=0, group=group)

        def check():
            t.fill_(float(rank + 1))
            run()
            # Only the root's tensor is defined afterwards (gloo uses the others' as scratch).
            return rank != 0 or bool((t[:: max(1, count // 97)] == world * (world + 1) / 2).all())

        return run, check, count * esz
    if op == "gather":
        inp = full(count // world, float(rank + 1))
        outs = [alloc(count // world) for _ in range(world)] if rank == 0 else None

        def run():
            dist.gather(inp, outs, group_dst=0, group=group)

        def check():
            run()
            return rank != 0 or all(outs[r][0].item() == r + 1 for r in range(world))

        return run, check, count * esz
    if op == "scatter":
        ins = [full(count // world, float(r + 1)) for r in range(world)] if rank == 0 else None
        out = alloc(count // world)

        def run():
            dist.scatter(out, ins, group_src=0, group=group)

        def check():
            run()
            return bool((out == rank + 1).all())

        return run, check, count * esz
    if op == "sendrecv":
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        inp, out = full(count, float(rank + 1)), alloc(count)

        def run():
            ops = [
                dist.P2POp(dist.isend, inp, group=group, group_peer=nxt),
                dist.P2POp(dist.irecv, out, group=group, group_peer=prv),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        def check():
            out.zero_()
            run()
            return bool((out[:: max(1, count // 97)] == prv + 1).all())

        return run, check, count * esz
    inp, out = full(count, float(rank + 1)), alloc(count)

    def run_all_to_all():
        dist.all_to_all_single(out, inp, group=group)

    def check_all_to_all():
        run_all_to_all()
        blk = count // world
        return bool(all(out[r * blk].item() == r + 1 for r in range(world)))

    return run_all_to_all, check_all_to_all, count * esz


def _sparse_case(nbytes: int, world: int, rank: int, group):
    """Returns (run, check, actual_bytes) for a sparse embedding gradient's all_reduce.

    S bytes of float32 values per rank: rows of 64 values at random rows of a table 4 x world
    times as tall, some shared between ranks. Each call sums a fresh clone (the sum replaces
    the tensor), so the time includes one clone.
    """
    width = 64
    rows = max(1, nbytes // (4 * width))
    g = torch.Generator().manual_seed(rank)
    indices = torch.randint(0, 4 * world * rows, (1, rows), generator=g)
    base = torch.sparse_coo_tensor(
        indices, torch.full((rows, width), float(rank + 1)), (4 * world * rows, width)
    )

    def run():
        dist.all_reduce(base.clone(), group=group)

    def check():
        t = base.clone()
        dist.all_reduce(t, group=group)
        expected = rows * width * world * (world + 1) / 2
        return t.is_coalesced() and tensor_compat.sparse_values(t).sum().item() == expected

    return run, check, rows * width * 4


class _DirectAllReduce:
    """The "smddp-direct" peer: all_reduce_direct on an smddp group."""

    def __init__(self, fn, group):
        self._fn, self._group = fn, group

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._fn(tensor, group=self._group)


def _timed(run, iters: int, warmup: int, barrier) -> list[float]:
    for _ in range(warmup):
        run()
    barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def pool_empty(group, dtype: torch.dtype = torch.float32):
    """An allocator of ``dtype`` tensors from the smddp backend's pool.

    FSDP2 takes its all-gather and reduce-scatter buffers from there (Note [Zero-copy
    operands] in shm_algos.h).
    """
    cpu = torch.device("cpu")
    backend = c10d_compat.backend_of(group, cpu)
    return lambda n: backend.allocate_tensor(n, dtype=dtype, device=cpu)


def _slowest(times: list[float], ctrl) -> float:
    """Median over iterations of the slowest rank's time (reduced over the control group)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctrl)
    return statistics.median(t.tolist())


def _memcpy_bw(nbytes: int, ctrl) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    iters = max(5, min(200, (256 << 20) // nbytes))
    times = _timed(lambda: dst.copy_(src), iters, 2, lambda: dist.barrier(group=ctrl))
    return nbytes / _slowest(times, ctrl)


def _worker_body(
    rank: int, world: int, args: argparse.Namespace
) -> tuple[list[dict], dict[str, float]] | None:
    torch.set_num_threads(1)
    ctrl = dist.new_group(backend="gloo")  # timing reductions, never timed
    groups: dict[str, Any] = {}
    peers: dict[str, Any] = {}  # ShmAllReduce or _DirectAllReduce: each has all_reduce(tensor)
    for b in args.backends:  # in the same order on every rank: new_group is collective
        if b == "deepspeed":
            from tools.deepspeed_peer import ShmAllReduce

            peers[b] = ShmAllReduce(world, rank, lambda: dist.barrier(group=ctrl))
            groups[b] = ctrl  # only for the barrier before timing
        elif b == "smddp-direct":
            from torch_sagemaker.smddp.direct import all_reduce_direct

            g = (
                dist.group.WORLD
                if dist.get_backend() == "smddp"
                else dist.new_group(backend="smddp")
            )
            peers[b] = _DirectAllReduce(all_reduce_direct, g)
            groups[b] = g
        else:
            groups[b] = dist.group.WORLD if b == dist.get_backend() else dist.new_group(backend=b)
    rows: list[dict] = []
    copy = {"cache": _memcpy_bw(1 << 20, ctrl), "dram": _memcpy_bw(64 << 20, ctrl)}
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= args.factor
    # With --repeat N the whole sweep runs N times and each cell reports the median of its N
    # medians: slow phases of a shared machine last seconds, longer than one case. Speed-ups
    # pair the backends within a sweep (Note [Paired speed-ups]); each sweep starts the
    # backends at a different one so that none is always measured first.
    medians: dict[tuple, tuple[int, list[float]]] = {}  # (op, size, backend) -> bytes, medians
    for sweep in range(args.repeat):
        start = sweep % len(args.backends)
        order = args.backends[start:] + args.backends[:start]
        for op in args.ops:
            for size in sizes:
                for b in order:
                    if b in PEER_OPS and op not in PEER_OPS[b]:
                        continue
                    run, check, actual = make_case(
                        op,
                        size,
                        world,
                        rank,
                        groups[b],
                        peers[b].all_reduce if b in peers else None,
                        pool_empty(groups[b]) if args.pool and b == "smddp" else None,
                    )
                    if not check():
                        raise RuntimeError(f"{b} {op} at {size} bytes produced wrong values")
                    iters = max(args.min_iters, min(args.iters, int(args.budget / max(actual, 1))))
                    barrier = lambda g=groups[b]: dist.barrier(group=g)  # noqa: E731
                    med = _slowest(_timed(run, iters, args.warmup, barrier), ctrl)
                    medians.setdefault((op, size, b), (actual, []))[1].append(med)
    for op in args.ops:
        for size in sizes:
            row = {"op": op, "size": size}
            for b in args.backends:
                if (op, size, b) not in medians:
                    row[b] = None  # not measured: a blank cell
                    continue
                actual, meds = medians[(op, size, b)]
                med = statistics.median(meds)
                algbw = actual / med / 1e9
                bound = (
                    PASSES[op][0](world)
                    * actual
                    / 2
                    / (copy["cache"] if actual <= (1 << 20) else copy["dram"])
                )
                row[b] = {
                    "sweeps_us": [m * 1e6 for m in meds],
                    "time_us": med * 1e6,
                    "algbw": algbw,
                    "busbw": algbw * busbw_factor(op, world),
                    "bytes": actual,
                    "copy_pct": 100 * bound / med,
                }
            rows.append(row)
            if rank == 0 and args.verbose:
                print(format_row(row, args.backends, args.ratio_base), flush=True)
    if args.pool and "smddp" in groups:
        from torch_sagemaker.smddp.backend import pool_stats

        stats = pool_stats(groups["smddp"])
        if rank == 0:
            print(f"smddp read its peers' operands in place in {stats['zero_copy_ops']} calls")
    return (rows, copy) if rank == 0 else None


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch_sagemaker  # noqa: F401  (registers smddp)

    dist.init_process_group(
        args.backends[0], rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    result = _worker_body(rank, world, args)
    if rank == 0:
        queue.put(result)
    end_rank(queue)


def _run(args: argparse.Namespace):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torch_sagemaker  # noqa: F401

        dist.init_process_group(args.backends[0], timeout=timedelta(seconds=600))
        try:
            return _worker_body(dist.get_rank(), dist.get_world_size(), args), dist.get_world_size()
        finally:
            dist.destroy_process_group()
    return run_ranks(_spawned, args.nprocs, args)[0], args.nprocs


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep and prints the table (``--help`` for options)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument(
        "--ops",
        type=comma_list(OPS),
        default=",".join(DEFAULT_OPS),
        help=f"any of {','.join(OPS)} (default: {','.join(DEFAULT_OPS)})",
    )
    p.add_argument(
        "--backends",
        type=comma_list(),
        default="smddp,gloo",
        help="first one is the default group's; add smddp-direct (all_reduce_direct) "
        "or deepspeed (DeepSpeed's CPU shared-memory all_reduce)",
    )
    p.add_argument(
        "--ratio-base",
        default=None,
        help="the column speed-ups are computed against (default: the first backend)",
    )
    p.add_argument("--min-bytes", type=parse_size, default=8)
    p.add_argument("--max-bytes", type=parse_size, default=256 << 20)
    p.add_argument("--factor", type=int, default=2, help="size multiplier between steps")
    p.add_argument("--iters", type=int, default=50, help="timed iterations (at most)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument(
        "--budget",
        type=parse_size,
        default=1 << 30,
        help="bytes per case that bound the iteration count for large sizes",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the sweep this many times; each cell is the median of the runs' medians, "
        "each speed-up the median of the runs' own ratios",
    )
    p.add_argument(
        "--pool",
        action="store_true",
        help="smddp's operands from its tensor pool (allocate_tensor, as FSDP2 uses it), so "
        "peers on the host read them in place; other backends keep torch.empty",
    )
    p.add_argument("--plot", default=None, help="write busbw vs size to this PNG")
    p.add_argument("--quiet", dest="verbose", action="store_false", help="only the final table")
    args = p.parse_args(argv)
    if args.backends[0] in PEER_OPS:
        raise SystemExit(
            f"--backends: {args.backends[0]} is not a torch.distributed backend and "
            "cannot be first (the default group's); put it after smddp"
        )
    if args.ratio_base is not None and args.ratio_base not in args.backends:
        raise SystemExit(
            f"--ratio-base {args.ratio_base!r} is not one of --backends {args.backends}"
        )
    if "deepspeed" in args.backends:
        from tools.deepspeed_peer import require

        try:
            require()
        except ImportError as exc:
            raise SystemExit(str(exc)) from None
    result, world = _run(args)
    if result is None:  # a non-zero rank under torchrun: rank 0 prints
        return 0
    rows, copy = result
    print(format_table(rows, copy, args.backends, world, args.ratio_base))
    if args.plot:
        plot(rows, args.backends, world, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
