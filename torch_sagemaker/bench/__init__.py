"""Benchmarks: ``python -m torch_sagemaker.bench <name> [options]``.

Each benchmark is a module of this package with a ``main(argv)`` function; the
dispatcher in ``__main__`` imports it only when asked for, so one benchmark's
dependencies never slow down or break another.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

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
