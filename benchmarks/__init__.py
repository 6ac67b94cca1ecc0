"""Benchmarks: ``python -m benchmarks <name> [options]``, run from a checkout.

This package is not installed with the library (the wheel holds ``torch_sagemaker`` only);
the simulated hosts, the S3 server and the peers it measures against live in ``tools/``.
Each benchmark is a module of this package with a ``main(argv)`` function; the
dispatcher in ``__main__`` imports it only when asked for, so one benchmark's
dependencies never slow down or break another.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing import reduction as mp_reduction
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp

from tools.ranks import free_port, set_rank_environment  # noqa: F401  (benchmarks import them from here)

# name -> (module, one-line description). Add a benchmark by adding a line here.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "collectives": (
        "benchmarks.collectives",
        "nccl-tests style sweep of the smddp and gloo collectives",
    ),
    "training": (
        "benchmarks.training",
        "training-step time: FSDP2 and DDP over smddp and gloo",
    ),
    "offload": ("benchmarks.offload", "activation offload step times"),
    "moe": (
        "benchmarks.moe",
        "expert parallelism: Mixtral ep 1 vs ep 2/4, both dispatchers",
    ),
    "context_parallel": (
        "benchmarks.context_parallel",
        "context parallelism: tokens/s, activation memory, exposed communication",
    ),
    "gpu": (
        "benchmarks.gpu",
        "smddp on CUDA tensors: staged all_reduce vs its bound, bf16, --timeline, kernels",
    ),
    "cross_memory": (
        "benchmarks.cross_memory",
        "copying another process's memory: process_vm_readv against memcpy",
    ),
    "fp8": (
        "benchmarks.fp8",
        "FP8 vs bf16 matmul and linear-layer time (example model, 4096-wide layer)",
    ),
    "checkpoint": (
        "benchmarks.checkpoint",
        "checkpoint save/load with and without checksums",
    ),
    "multihost": (
        "benchmarks.multihost",
        "smddp and gloo between simulated hosts, against the NIC's rate",
    ),
    "planner": (
        "benchmarks.planner.validation",
        "the planner's memory and time predictions against this machine, published configs",
    ),
}


def end_rank(queue: Any | None = None) -> NoReturn:
    """Ends a benchmark rank at once, after its groups and its results are done with.

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


@dataclasses.dataclass
class RankFailure:
    """What a rank put on the results queue instead of a result: its traceback."""

    rank: int
    traceback: str


class _PortTakenError(Exception):
    """The store's port, free when chosen, was taken before rank 0 bound it."""


_NOTHING = object()  # no result yet

# Attempts with a new port when another process took the chosen one first (an ephemeral bind
# between free_port() and rank 0's store binding it).
_PORT_ATTEMPTS = 3


# Note [Benchmark ranks forked from a warm server]: the ranks used to be spawned, and each
# imported torch (and, for the training benchmarks, transformers' model machinery) itself:
# seconds of CPU per rank before its first measurement, on a 2-core machine while its peers
# were starting too. They are forked instead from multiprocessing's fork server, which
# imports those libraries once per parent process (six test files of the benchmarks: 111 s
# before, 32 s after, run back to back). Nothing is measured before a rank has started, so the
# figures do not change. The server holds no per-run setting: a forked rank inherits the
# server's environment, not the parent's of the moment, so _rank_entry first puts back the
# parent's environment as it was at start (what a spawned rank inherited), and its standard
# output and error: the server's are those of the moment it started (under pytest, an
# earlier test's capture). torch_sagemaker is not preloaded: it reads its settings (log
# level, SMDDP_*) when imported.
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils"]


class _ParentFd:
    """The parent's file descriptor ``fd``, sent to a forked rank as it starts."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        # Pickled while the rank starts, when multiprocessing can pass descriptors along.
        return (_received_fd, (mp_reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return dup.detach()


def rank_context() -> Any:
    """The multiprocessing context the benchmark ranks start in (a fork server on CPU).

    Where CUDA is available the ranks are spawned, as before: the server's imports may
    initialize CUDA's driver, which a forked process cannot use.
    """
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_entry(
    target: Callable[..., None], rank: int, nprocs: int, port: int, args, queue, environ, fds
):
    os.environ.clear()
    os.environ.update(environ)
    for fd, parents in zip((1, 2), fds):
        if parents != fd:  # a spawned rank receives the parent's number itself
            os.dup2(parents, fd)
            os.close(parents)
    try:
        target(rank, nprocs, port, *args, queue)
    except BaseException:
        queue.put(RankFailure(rank, traceback.format_exc()))
        queue.close()
        queue.join_thread()
        raise


def run_ranks(
    target: Callable[..., None],
    nprocs: int,
    *args: Any,
    results: int = 1,
    on_result: Callable[[Any], None] | None = None,
    result_timeout_s: float = 3600.0,
) -> list[Any]:
    """Starts ``nprocs`` ranks running ``target(rank, nprocs, port, *args, queue)``.

    The ranks are fresh processes (on CPU, forked from a fork server that imported torch, Note
    [Benchmark ranks forked from a warm server]), with ``port`` a free port on 127.0.0.1 for
    their store. While waiting the caller watches the ranks, so a rank that fails, or dies
    without a word, ends the run at once with its traceback or exit code, instead of leaving the
    caller waiting on the queue; every wait (each result, then the ranks' exit) is bounded by
    ``result_timeout_s``. When rank 0's store could not bind ``port`` because another process
    took it first, the ranks start again on a new port (up to three tries).

    Args:
        target: The rank's function; it puts its results on ``queue``.
        nprocs: The number of ranks.
        *args: Passed to ``target`` after the port.
        results: How many objects to take from the queue.
        on_result: Called with each result as it arrives (progress reports).
        result_timeout_s: The longest wait for any one result.

    Returns:
        The first ``results`` objects put on the queue, in order, after every rank exited.

    Raises:
        RuntimeError: A rank failed (its traceback is in the message), exited with a
            non-zero code, or sent no result for ``result_timeout_s``.
    """
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_once(target, nprocs, args, results, on_result, result_timeout_s)
        except _PortTakenError as e:
            if attempt == _PORT_ATTEMPTS - 1:
                raise RuntimeError(f"the store's port was taken {_PORT_ATTEMPTS} times: {e}") from e
    raise AssertionError("unreachable")


def _run_once(target, nprocs, args, results, on_result, result_timeout_s) -> list[Any]:
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    start = (dict(os.environ), (_ParentFd(1), _ParentFd(2)))
    procs = [
        ctx.Process(target=_rank_entry, args=(target, r, nprocs, port, args, queue, *start))
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    try:
        got = []
        for _ in range(results):
            got.append(_next_result(queue, procs, result_timeout_s))
            if on_result is not None:
                on_result(got[-1])
        _await_exit(queue, procs, result_timeout_s)
        return got
    finally:
        for p in procs:
            if p.is_alive():  # peers of a failed rank, waiting on it in a collective
                p.terminate()
            p.join()


def _await_exit(queue, procs, timeout_s: float) -> None:
    """Waits (at most ``timeout_s``) until every rank exited, reading the queue meanwhile.

    A rank that fails after the results were in sends its traceback, and a traceback left
    unread in a full pipe would keep that rank from exiting.
    """
    deadline = time.monotonic() + timeout_s
    failure = None
    while any(p.exitcode is None for p in procs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the benchmark ranks did not exit within {timeout_s:.0f} s")
        try:
            item = queue.get(timeout=0.5)
        except queue_module.Empty:
            continue
        if isinstance(item, RankFailure) and failure is None:
            failure = item
    if failure is not None:
        raise RuntimeError(f"benchmark rank {failure.rank} failed:\n{failure.traceback}")
    for rank, p in enumerate(procs):
        if p.exitcode:
            raise RuntimeError(f"benchmark rank {rank} exited with code {p.exitcode}")


def _next_result(queue, procs, timeout_s: float) -> Any:
    """The next result on ``queue``; raises as soon as a rank failed or died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            item = queue.get(timeout=0.5)
        except queue_module.Empty:
            item = _after_exit(queue, procs)
        if item is _NOTHING:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no result from the benchmark ranks in {timeout_s:.0f} s")
            continue
        if not isinstance(item, RankFailure):
            return item
        if item.rank == 0 and "EADDRINUSE" in item.traceback:  # rank 0 binds the store
            raise _PortTakenError(item.traceback.strip().splitlines()[-1])
        raise RuntimeError(f"benchmark rank {item.rank} failed:\n{item.traceback}")


def _after_exit(queue, procs) -> Any:
    """What the ranks put on the queue last, once they can send nothing more.

    ``_NOTHING`` while no rank died and some still run. Once a rank died, or all exited, a
    result may still be in the pipe (a rank writes it there before it exits): that result,
    or an error naming the rank that died.
    """
    codes = [p.exitcode for p in procs]
    if not any(codes) and None in codes:
        return _NOTHING
    try:
        return queue.get(timeout=2.0)
    except queue_module.Empty:
        pass
    for rank, code in enumerate(codes):
        if code:  # killed, or failed before it could say why
            raise RuntimeError(
                f"benchmark rank {rank} exited with code {code} before delivering its results"
            )
    raise RuntimeError("the benchmark ranks exited without delivering their results")


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
