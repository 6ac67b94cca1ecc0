"""The host buffer pool of activation offloading: reuse at fixed shapes, bounded otherwise.

Each "cycle" below is what one forward/backward pair does to the pool: acquire a block per
offloaded storage, then release them all when the pass is gone (Note [Host pool trimming]).
"""

from __future__ import annotations

import pytest

from torch_sagemaker.offload.buffers import HostBufferPool


def cycle(pool: HostBufferPool, sizes: list[int]) -> None:
    """One pass: every block in use at once, then all released."""
    blocks = [pool.acquire(n) for n in sizes]
    for block in blocks:
        pool.release(block)


def test_fixed_sizes_reuse_every_block():
    pool = HostBufferPool()
    sizes = [4096, 4096, 8192, 1024, 4096]
    cycle(pool, sizes)
    assert pool.allocations == len(sizes) and pool.allocated_bytes == sum(sizes)
    for _ in range(10):
        cycle(pool, sizes)
    assert pool.allocations == len(sizes), "a step of the same shapes allocated again"
    assert pool.reuses == 10 * len(sizes)
    assert pool.allocated_bytes == sum(sizes) and pool.dropped_bytes == 0


def test_varying_sizes_stay_within_twice_a_step():
    """A new sequence length every step (unpadded batches) used to add blocks forever."""
    pool = HostBufferPool()
    for step in range(60):
        seq = 8 + step
        sizes = [512 * seq] * 4 + [8 * seq]  # four layers' hidden states, the positions
        cycle(pool, sizes)
        assert pool.in_use_bytes == 0
        # The need grows every step, so the largest recent one is this step's.
        assert pool.allocated_bytes <= 2 * sum(sizes), (step, pool.allocated_bytes, sum(sizes))


def test_alternating_shapes_keep_both_sets():
    """Micro-batches of two lengths in turn: both sets of blocks survive (no new allocation)."""
    pool = HostBufferPool()
    long, short = [6000] * 3, [4000] * 3
    cycle(pool, long)
    cycle(pool, short)
    allocations = pool.allocations
    for _ in range(5):
        cycle(pool, long)
        cycle(pool, short)
    assert pool.allocations == allocations and pool.dropped_bytes == 0


def test_the_pool_shrinks_after_the_shapes_do():
    pool = HostBufferPool(history=4)
    cycle(pool, [100_000] * 4)
    small = [1000] * 4
    for _ in range(4):
        cycle(pool, small)
    assert pool.allocated_bytes == sum(small), pool.allocated_bytes  # the big blocks are gone
    assert pool.dropped_bytes == 400_000


def test_overlapping_passes_are_one_cycle():
    """Two forwards before their backwards (pipeline style) share one cycle; nothing is lost."""
    pool = HostBufferPool()
    for _ in range(4):
        first = [pool.acquire(n) for n in (300, 500)]
        second = [pool.acquire(n) for n in (300, 700)]
        for block in first:
            pool.release(block)
        third = [pool.acquire(n) for n in (300, 500)]  # reuses the first pass's blocks
        for block in second + third:
            pool.release(block)
    assert pool.allocations == 4 and pool.allocated_bytes == 1800


def test_retain_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="retain_factor=0.5: must be >= 1"):
        HostBufferPool(retain_factor=0.5)
