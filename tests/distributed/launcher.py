"""Runs a function on N ranks in spawned processes, for the distributed tests.

``run_distributed(fn, world_size=..., backend=...)`` calls ``fn(*args)`` on every rank and
returns the per-rank results, or raises ``DistributedTestError`` carrying the traceback of
each failing rank (which pytest then shows in its report).

Start-up is expensive here (importing torch and transformers takes seconds per rank on a
2-core machine), so by default the ranks are kept in a *pool* keyed by (world size,
backend, extra environment) and reused by later calls: the default process group is
created once and each call runs in it. After every call the ranks reset ``tsm.state`` and
clear PyTorch's DTensor caches that hold device meshes (so tensor-parallel layouts can follow
one another in a pool).
A pool whose call failed or timed out is torn down (its ranks may be stuck inside a
collective); the next call starts a fresh one. ``fresh=True`` runs in a throw-away pool,
for tests that break the process group on purpose (dead ranks, timeouts) or that need to
create it themselves (``init_process_group=False``).

Each call has a hard timeout: when it expires the ranks are killed and the error names the
ranks that did not finish. Ranks use one intra-op thread each and a free TCP port.
Ranks are forked from a server that has imported torch once (Note [Ranks forked from a
warm server]).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from tools.ranks import free_port, set_rank_environment

# Note [Ranks forked from a warm server]: a rank spawned from scratch imports torch and
# transformers itself, seconds of CPU per rank, and on a busy 2-core machine a fresh 4-rank
# pool took 30-45 s to start (fault tests need a fresh pool each). Ranks are forked instead
# from multiprocessing's fork server, which imports those libraries once per test session
# (a fresh 4-rank pool: 9-18 s, measured on the same machine in the same minutes). The
# server imports only libraries that read no per-pool setting at import time; the ranks
# still set their environment first and import torch_sagemaker themselves (it reads
# TSM_LOG_LEVEL and registers the backend). Forking a process that imported torch is what
# DataLoader workers do; the ranks call torch.set_num_threads(1) after the fork.
# The server also imports transformers' model machinery (modeling_utils, which imports
# torch._dynamo through masking_utils) and the Llama model most tests build: otherwise each
# rank paid about 2.4 CPU-seconds to import it, at its first model (5 distributed test files:
# 239 s before, 198 s after, measured back to back on the same machine). Not where CUDA is
# available: a process forked after CUDA's driver was initialized cannot use it, and the GPU
# tests have not run with that machinery imported before the fork.
# TSM_TEST_START_METHOD=spawn goes back to spawning, to rule the fork server out.
_START_METHOD = os.environ.get("TSM_TEST_START_METHOD", "forkserver")
_CTX = mp.get_context(_START_METHOD)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "transformers",
]
_MODEL_PRELOAD = ["transformers.modeling_utils", "transformers.models.llama.modeling_llama"]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if _START_METHOD == "forkserver":
    _CTX.set_forkserver_preload(_PRELOAD + ([] if _cuda_available() else _MODEL_PRELOAD))


class DistributedTestError(AssertionError):
    """One or more ranks raised, or the call timed out."""


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port another socket listens on while the block runs: what a store finds when an
    ephemeral bind took a port between free_port() and the store binding it."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _check_collectives_waited(fn: Callable[..., Any], left: int) -> None:
    """Fails a call that left functional collectives never waited for: each one's Work and
    output stay in c10d's registry for the life of the process, a leak in a training loop
    (Note [Collectives nobody waits for] in torch_sagemaker/_torch_compat/c10d.py)."""
    if left > 0:
        raise AssertionError(
            f"{getattr(fn, '__qualname__', fn)} left {left} functional collective(s) that "
            "nothing waited for (their results were never used): see Note [Collectives nobody "
            "waits for] in torch_sagemaker/_torch_compat/c10d.py."
        )


def _reset_after_call() -> None:
    import sys

    if "torch_sagemaker" in sys.modules:
        sys.modules["torch_sagemaker"].state.reset()
    if "torch.distributed.tensor" in sys.modules:
        _clear_dtensor_caches()


# Note [Groups released between calls]: a call's groups outlive it unless destroyed, and each
# gloo group keeps a thread that wakes every 10 ms (gloo's TCP loop polls epoll with a 10 ms
# timeout) and two worker threads. A 4-rank gloo pool had gathered 218 such groups mid-suite
# (659 threads a rank) and, idle, kept more than one of the machine's two cores busy, slowing
# every later test. So after a call has finished on every rank, the parent sends each rank
# _RELEASE, and the rank destroys every group but the default one. Not from the rank's own
# `finally`: a rank that finished first could close a group a peer is still completing a
# collective on.
_RELEASE = "release-groups"

# Note [Pools that keep released groups]: a group's threads stop only when its last reference
# goes, and some calls leave references that the release cannot drop (autograd graphs whose
# collectives hold their groups in C++, out of the garbage collector's sight). The shared
# 4-rank gloo pool had kept 108 gloo groups a rank (326 threads) by the middle of the suite,
# and idle, its ranks took a fifth of a core from every later test. So each rank answers the
# release with its thread count, and a pool with a rank above _MAX_IDLE_THREADS (about 40
# gloo groups kept) is shut down before its next call, which starts a fresh one (a second or
# two). A rank that kept nothing has 3 to 14 threads.
_MAX_IDLE_THREADS = 128


def _thread_count() -> int:
    """This process's threads (Linux); 0 where /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _release_groups() -> None:
    """Destroys every process group but the default one, and the last references to them."""
    import gc

    import torch.distributed as dist

    from torch_sagemaker._torch_compat import c10d

    default = c10d.default_group_or_none()
    for group in [g for g in c10d.live_groups() if g is not default]:
        dist.destroy_process_group(group)
    # A group's threads stop when its last reference goes. One pass can leave garbage that
    # only became unreachable when that pass freed C++ objects holding it (an autograd
    # graph's nodes), and with it a call's meshes and groups until the next release: after an
    # expert- or tensor-parallel step on 2 ranks all six of tsm.init's groups outlived the
    # first pass and went in the second. So collect until a pass finds nothing.
    for _ in range(4):
        if not gc.collect():
            break


def _clear_dtensor_caches() -> None:
    """Drops PyTorch's DTensor caches that hold device meshes.

    They are keyed by mesh *value* (DeviceMesh compares ranks, shape and names, not its
    process groups), so a later call whose mesh equals an earlier, destroyed one would be
    handed the earlier mesh and its groups: redistribution plans, sharding propagation
    results and mesh topology. With them cleared a pool can run tensor-parallel layouts one
    after another.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    clear_redistribute_planner_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    env: dict[str, str],
    init_pg: bool,
    pg_timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    # A rank that dies of a signal (a crash in native code) prints every thread's Python and
    # C++ stacks to stderr, which pytest shows with the failing test; otherwise only its exit
    # code is known.
    faulthandler.enable(all_threads=True)
    set_rank_environment(rank, world_size, port, os.environ.get("TSM_LOG_LEVEL", "WARNING"))
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import torch_sagemaker  # noqa: F401  (registers the smddp backend)
        from torch_sagemaker._torch_compat.c10d import unwaited_collectives
        from torch_sagemaker._torch_compat.signals import print_native_stacks_on_fatal_signal

        print_native_stacks_on_fatal_signal()  # and faulthandler the Python ones, above

        if init_pg:
            # The store gets a start-up allowance of its own: a test's short collective timeout
            # (pg_timeout_s) must not fail the rendezvous of ranks that start slowly on a busy
            # machine.
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world_size,
                rank == 0,
                timeout=timedelta(seconds=max(pg_timeout_s, 180.0)),
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
    except BaseException:
        results.put((rank, False, "start-up failed:\n" + traceback.format_exc()))
        return
    # Note [Start-up objects frozen]: the rank holds about 280,000 objects from importing
    # torch and transformers, and each full garbage collection walked them all: 0.1-0.2 s of
    # CPU a rank, at least once per call (_release_groups collects until nothing is found),
    # so a trivial call on a warm 4-rank pool took 0.2 s of wall time on 2 cores. Frozen, they
    # are never walked again (a trivial call: 0.002 s). They live as long as the rank anyway;
    # what a call creates is still collected, so releasing its groups works as before.
    import gc

    gc.freeze()
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        if task == _RELEASE:
            try:
                _release_groups()
            except BaseException:
                # The next call on this pool still runs; its own groups are new ones.
                traceback.print_exc()
            results.put((rank, True, _thread_count()))  # Note [Pools that keep released groups]
            continue
        fn, args, kwargs = task
        try:
            before = unwaited_collectives()
            value = fn(*args, **kwargs)
            _check_collectives_waited(fn, unwaited_collectives() - before)
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            try:
                _reset_after_call()
            except BaseException:
                pass
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _Pool:
    def __init__(
        self,
        world_size: int,
        backend: str,
        env: dict[str, str],
        init_pg: bool,
        pg_timeout_s: float,
        start_timeout_s: float,
    ) -> None:
        self.world_size = world_size
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.port = port = free_port()
        self.releasing = False  # the ranks' answers to the last release are still to be read
        self.procs = [
            _CTX.Process(
                target=_worker,
                daemon=True,
                args=(
                    r,
                    world_size,
                    backend,
                    port,
                    env,
                    init_pg,
                    pg_timeout_s,
                    self.tasks[r],
                    self.results,
                ),
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._collect(start_timeout_s, what="start-up", conclusive=_port_taken)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def keeps_released_groups(self) -> bool:
        """Reads the ranks' answers to the last release: True when a rank kept more than
        _MAX_IDLE_THREADS threads (Note [Pools that keep released groups]), or did not answer
        (then the pool is shut down already)."""
        if not self.releasing:
            return False
        self.releasing = False
        try:
            threads = self._collect(120, what="the release of the last call's groups")
        except DistributedTestError:
            return True
        return max(threads) > _MAX_IDLE_THREADS

    def _collect(
        self, timeout_s: float, what: str, conclusive: Callable[[str], bool] | None = None
    ) -> list[Any]:
        """The ranks' values by rank; raises with every failure, or the first ``conclusive`` one."""
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        first_failure_at = None
        while len(values) + len(failures) < self.world_size:
            now = time.monotonic()
            # Once a rank failed, give the others a short grace period to report (they are
            # often blocked in a collective with the failed rank) instead of the full timeout.
            limit = deadline if first_failure_at is None else min(deadline, first_failure_at + 10)
            if now >= limit:
                break
            try:
                rank, ok, value = self.results.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(self.procs)
                    if not p.is_alive() and r not in values and r not in failures
                ]
                for r in dead:
                    failures[r] = f"process exited with code {self.procs[r].exitcode} during {what}"
                    first_failure_at = first_failure_at or time.monotonic()
                continue
            if ok:
                values[rank] = value
            else:
                failures[rank] = value
                first_failure_at = first_failure_at or time.monotonic()
                if conclusive is not None and conclusive(value):
                    break
        missing = [r for r in range(self.world_size) if r not in values and r not in failures]
        if failures or missing:
            self.shutdown(force=True)
            parts = [f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)]
            if missing:
                reason = (
                    "did not finish after another rank failed"
                    if failures
                    else f"did not finish within {timeout_s:.0f} s"
                )
                parts.append(f"--- ranks {missing} {reason} (killed) ---")
            raise DistributedTestError(
                f"{what} failed on {self.world_size} ranks:\n" + "\n".join(parts)
            )
        return [values[r] for r in range(self.world_size)]

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        timeout_s: float,
        conclusive: Callable[[str], bool] | None = None,
    ) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        values = self._collect(
            timeout_s, what=f"{getattr(fn, '__name__', fn)}", conclusive=conclusive
        )
        for q in self.tasks:  # Note [Groups released between calls]
            q.put(_RELEASE)
        self.releasing = True
        return values

    def shutdown(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for key, pool in list(_CACHE.items()):
            if pool is self:
                del _CACHE[key]


# Note [Idle pools]: a cached pool's ranks are not quite idle. Each keeps its default group,
# and a gloo group's loop thread wakes every 10 ms (Note [Groups released between calls]):
# 0.001-0.002 of a core a rank. Ranks that ran tensor- or expert-parallel calls keep more
# (70 threads, about 20 gloo groups: 0.02 of a core). With every pool kept to the end of the
# session, a run of tests/distributed started 28 distinct pools and ended with about 100
# rank processes, whose ten busiest took 0.09 of a core while idle. Only the _MAX_POOLS pools
# used last stay. Replaying that run's calls in cached pools: 6 pools kept means 37 starts
# instead of 28 (a fork per rank from the warm server, about 0.4 s a start, Note [Ranks
# forked from a warm server]) and 17 ranks alive at a call on average instead of 51; 3 pools
# kept would mean 56 starts.
_MAX_POOLS = 6
_CACHE: dict[tuple, _Pool] = {}  # in the order of their last use, the latest last


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_CACHE.values()):
        pool.shutdown()


def _port_taken(failure: str) -> bool:
    """Whether a rank's start-up failed because the store's port was taken: the pool starts
    again at once, without the grace period for the other ranks' reports (they wait for a
    store that will never answer, and their tracebacks would say nothing more)."""
    return "EADDRINUSE" in failure


def _store_took_no_port(port: int) -> Callable[[str], bool]:
    """Whether a rank's failure is its store's bind of ``port`` (the pool's) being refused."""
    return lambda failure: (
        _port_taken(failure)
        and "server socket has failed to listen" in failure
        and f"port: {port}," in failure
    )


def _start_pool(
    world_size: int, backend: str, env: dict[str, str], init_pg: bool, pg_timeout: float
) -> _Pool:
    """A started pool. The store's port was free when chosen, but another process (an smddp
    listener on an ephemeral port, say) can take it before rank 0 binds it; then the pool
    starts again on a new port, up to three times."""
    for attempt in range(3):
        try:
            return _Pool(world_size, backend, env, init_pg, pg_timeout, start_timeout_s=180)
        except DistributedTestError as e:
            if not _port_taken(str(e)) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    init_process_group: bool = True,
    pg_timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` ranks and returns the results by rank.

    Args:
        fn: A module-level (picklable) function.
        *args: Positional arguments for ``fn`` (picklable).
        world_size: Number of ranks.
        backend: Backend of the default process group ("gloo" or "smddp").
        timeout: Seconds the call may take before the ranks are killed.
        env: Extra environment variables for the ranks (part of the pool key).
        fresh: Use a throw-away pool instead of the shared one.
        init_process_group: Create the default process group before calling ``fn``
            (False implies ``fresh``). Where it is False and the store ``fn`` creates on
            ``MASTER_PORT`` finds that port taken, ``fn`` runs again on a new pool, up to
            three times: it must not fail for what a failed attempt left behind.
        pg_timeout: Timeout given to ``init_process_group``.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        DistributedTestError: With the traceback of each failing rank, or the ranks that
            did not finish in time.
    """
    env = dict(env or {})
    if not init_process_group:
        # The ranks create their store inside ``fn``, so a port taken meanwhile fails the
        # call, not the start: the call runs again on a new pool, as _start_pool does.
        for attempt in range(3):
            pool = _start_pool(world_size, backend, env, False, pg_timeout)
            taken = _store_took_no_port(pool.port)
            try:
                return pool.run(fn, args, kwargs, timeout, conclusive=taken)
            except DistributedTestError as e:
                if not taken(str(e)) or attempt == 2:
                    raise
            finally:
                pool.shutdown()
        raise AssertionError("unreachable")
    key = (world_size, backend, tuple(sorted(env.items())), pg_timeout)
    pool = None if fresh else _CACHE.get(key)
    if pool is not None and not pool.alive():
        pool.shutdown(force=True)
        pool = None
    if pool is not None and pool.keeps_released_groups():
        pool.shutdown()
        pool = None
    if pool is None:
        if not fresh:
            while len(_CACHE) >= _MAX_POOLS:  # Note [Idle pools]
                next(iter(_CACHE.values())).shutdown()
        pool = _start_pool(world_size, backend, env, init_process_group, pg_timeout)
        if not fresh:
            _CACHE[key] = pool
    else:
        _CACHE[key] = _CACHE.pop(key)  # now the latest used
    try:
        return pool.run(fn, args, kwargs, timeout)
    finally:
        if fresh:
            pool.shutdown()
