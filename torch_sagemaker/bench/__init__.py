"""Benchmarks: ``python -m torch_sagemaker.bench <name> [options]``.

Each benchmark is a module of this package with a ``main(argv)`` function; the
dispatcher in ``__main__`` imports it only when asked for, so one benchmark's
dependencies never slow down or break another.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch.multiprocessing as mp

# name -> (module, one-line description). Add a benchmark by adding a line here.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "collectives": (
        "torch_sagemaker.bench.collectives",
        "nccl-tests style sweep of the smddp and gloo collectives",
    ),
    "training": (
        "torch_sagemaker.bench.training",
        "training-step time: FSDP2 and DDP over smddp and gloo",
    ),
    "offload": ("torch_sagemaker.bench.offload", "activation offload step times"),
    "moe": (
        "torch_sagemaker.bench.moe",
        "expert parallelism: Mixtral ep 1 vs ep 2/4, both dispatchers",
    ),
    "context_parallel": (
        "torch_sagemaker.bench.context_parallel",
        "context parallelism: tokens/s, activation memory, exposed communication",
    ),
    "gpu": (
        "torch_sagemaker.bench.gpu",
        "smddp on CUDA tensors: copy bandwidth, all_reduce vs NCCL, kernels launched",
    ),
    "checkpoint": (
        "torch_sagemaker.bench.checkpoint",
        "checkpoint save/load with and without checksums",
    ),
}


def set_rank_environment(rank: int, world: int, port: int, log_level: str = "WARNING") -> None:
    """Sets torchrun's variables for a benchmark rank spawned on this host (``127.0.0.1:port``)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TSM_LOG_LEVEL=log_level,
    )


def end_rank(queue: Any | None = None) -> NoReturn:
    """Ends a spawned benchmark rank at once, after its groups and its results are done with.

    It destroys the rank's process groups, delivers what it put on ``queue`` and exits
    without shutting the interpreter down.

    Groups live on after ``dist.destroy_process_group()`` while anything references them
    (``tsm.state``, DTensor's caches of device meshes, FSDP states in reference cycles), so
    their threads are still there while the interpreter shuts down. A gloo worker thread
    that releases a collective's tensors then asks for the GIL, and a thread that asks for it
    during shutdown is ended, which aborts the process ("terminate called without an active
    exception"; Note [Tensors are released in the caller's thread] in
    csrc/smddp/backend/work.h explains the GIL request, which smddp's own threads avoid).
    A benchmark rank has nothing to clean up that the operating system does not, so it
    leaves with ``os._exit(0)``. Errors raised before this call still end the rank with its
    traceback and a non-zero exit code.

    Args:
        queue: The multiprocessing queue this rank put its results on, if any.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if queue is not None:
        queue.close()
        queue.join_thread()  # the feeder thread has written everything to the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a benchmark's ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., None], nprocs: int, *args: Any) -> Any:
    """Spawns ``nprocs`` ranks running ``target(rank, nprocs, port, *args, queue)``.

    Returns:
        The first object a rank put on ``queue`` (the benchmarks' rank 0 puts its result),
        after every rank exited.

    Raises:
        RuntimeError: If a rank exited with a non-zero code.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, nprocs, port, *args, queue)) for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"benchmark rank exited with code {p.exitcode}")
    return result


def comma_list(allowed: Iterable[str] | None = None) -> Callable[[str], list[str]]:
    """An argparse ``type`` for comma-separated options, checked against ``allowed``.

    Args:
        allowed: the values accepted; None accepts any.

    Returns:
        A function that splits its argument on commas and raises
        ``argparse.ArgumentTypeError`` naming the unknown values and the accepted ones.
    """
    choices = None if allowed is None else tuple(allowed)

    def parse(text: str) -> list[str]:
        values = text.split(",")
        unknown = sorted(set(values) - set(choices)) if choices is not None else []
        if unknown and choices is not None:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return values

    return parse
