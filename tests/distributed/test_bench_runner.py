"""The benchmarks' rank runner (benchmarks.run_ranks): a failed or dead rank ends
the run at once with its reason, and a store port taken before rank 0 binds it is retried."""

import os
import time

import pytest

import benchmarks as bench
from tests.distributed.launcher import taken_port


# Targets run in spawned processes: module-level, signature (rank, world, port, *args, queue).
def _deliver(rank, world, port, value, queue):
    queue.put((rank, world, value))
    queue.close()
    queue.join_thread()


def _rank1_raises_rank0_waits(rank, world, port, queue):
    if rank == 1:
        raise ValueError("rank 1 gave up on purpose")
    time.sleep(600)  # stands for a collective waiting on rank 1


def _rank1_dies_rank0_waits(rank, world, port, queue):
    if rank == 1:
        os._exit(3)
    time.sleep(600)


def _fails_after_delivering(rank, world, port, queue):
    queue.put(rank)
    if rank == 1:
        raise ValueError("x" * 200_000)  # a traceback larger than a pipe's buffer
    queue.close()
    queue.join_thread()


def _never_delivers(rank, world, port, queue):
    time.sleep(600)


def _binds_store(rank, world, port, queue):
    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    queue.put(port)
    queue.close()
    queue.join_thread()


def test_every_result_comes_back_after_every_rank_exited():
    got = bench.run_ranks(_deliver, 2, "x", results=2)
    assert sorted(got) == [(0, 2, "x"), (1, 2, "x")]


def test_a_failed_rank_ends_the_run_with_its_traceback_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="benchmark rank 1 failed") as e:
        bench.run_ranks(_rank1_raises_rank0_waits, 2)
    assert "rank 1 gave up on purpose" in str(e.value)
    assert time.monotonic() - start < 60  # rank 0 (sleeping 600 s) was stopped


def test_a_rank_that_dies_silently_is_named_with_its_exit_code():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="benchmark rank 1 exited with code 3"):
        bench.run_ranks(_rank1_dies_rank0_waits, 2)
    assert time.monotonic() - start < 60


def test_a_rank_that_fails_after_delivering_is_reported_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="benchmark rank 1 failed") as e:
        bench.run_ranks(_fails_after_delivering, 2, results=2)
    assert "ValueError: xxx" in str(e.value)
    assert time.monotonic() - start < 300  # far below the 3600 s result timeout: no wait


def test_a_rank_that_never_delivers_times_out():
    with pytest.raises(RuntimeError, match="no result from the benchmark ranks in 1 s"):
        bench.run_ranks(_never_delivers, 1, result_timeout_s=1)


def test_a_store_port_taken_first_is_retried_on_a_new_one(monkeypatch):
    # The first port handed out is one another socket listens on.
    real = bench.free_port
    handed: list[int] = []
    with taken_port() as taken:
        ports = [taken]

        def free_port():
            handed.append(ports.pop(0) if ports else real())
            return handed[-1]

        monkeypatch.setattr(bench, "free_port", free_port)
        got = bench.run_ranks(_binds_store, 1)
    assert len(handed) == 2 and got == [handed[1]], handed
