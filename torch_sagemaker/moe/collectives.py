"""Differentiable collectives with uneven row counts, for token dispatch over the EP group.

- ``all_to_all_rows``: rows of a 2-D tensor sent in chunks of given sizes to each rank
  (``all_to_all_single`` with uneven splits); its backward is the reverse exchange.
- ``all_gather_rows`` / ``reduce_scatter_rows``: every rank's rows concatenated, and its
  adjoint (sum over ranks, each keeps its own rows). Ranks may hold different row counts:
  the rows are padded to the largest count for ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor``, which need equal chunks.

Sizes that arrive from other ranks are checked before any buffer is allocated from them
(``checked_counts``). ``DispatchTimer`` accumulates the wall time spent in these calls
for the MoE benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker._torch_compat import c10d as c10d_compat

#: Largest row count accepted from a peer (a corrupt count must not allocate terabytes).
MAX_ROWS = 2**31 - 1


class DispatchTimer:
    """Wall time of the EP collectives of this process (forward and backward), when enabled.

    With ``sync`` (benchmarks only) each timed collective is preceded by an untimed barrier
    of its group, so the time excludes waiting for slower ranks (load imbalance) and is the
    collective's own cost.
    """

    enabled = False
    sync = False
    seconds = 0.0
    calls = 0
    durations: list[float] = []  # one entry per timed collective, in call order

    @classmethod
    @contextmanager
    def measure(cls, group: dist.ProcessGroup | None = None) -> Iterator[None]:
        """Times the collective run inside the block, if timing is enabled."""
        if not cls.enabled:
            yield
            return
        if cls.sync and group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            cls.seconds += elapsed
            cls.calls += 1
            cls.durations.append(elapsed)

    @classmethod
    def reset(cls, enabled: bool, sync: bool = False) -> None:
        """Clears the totals and turns timing on or off (``sync``: a barrier before each)."""
        cls.enabled, cls.sync, cls.seconds, cls.calls, cls.durations = enabled, sync, 0.0, 0, []


def checked_counts(counts: torch.Tensor, what: str) -> list[int]:
    """``counts`` as Python ints after checking each is in ``[0, MAX_ROWS]`` and so is the sum.

    Raises:
        RuntimeError: Naming the bad value (a peer sent a corrupt count or ran another step).
    """
    values = counts.tolist()
    bad = [v for v in values if not 0 <= v <= MAX_ROWS]
    if bad or sum(values) > MAX_ROWS:
        raise RuntimeError(
            f"expert parallel dispatch received {what} {values}: every count must be in "
            f"[0, {MAX_ROWS}] and so must their sum. The ranks of the expert parallel "
            "group are out of step (different models, layers or steps)."
        )
    return values


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of equal chunks of an int64 vector.

    ``counts.numel()`` must be divisible by the group size.
    """
    out = torch.empty_like(counts)
    with DispatchTimer.measure(group):
        dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _all_to_all(
    x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    with DispatchTimer.measure(group):
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=out_rows, input_split_sizes=in_rows, group=group
        )
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.out_rows, ctx.in_rows, ctx.group = out_rows, in_rows, group
        return _all_to_all(x, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, ctx.in_rows, ctx.out_rows, ctx.group), None, None, None


def all_to_all_rows(
    x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of row blocks of ``x``, sized per group rank.

    Sends ``x[sum(in_rows[:j]):...][:in_rows[j]]`` to group rank ``j``; receives ``out_rows[j]``
    rows from it.
    """
    return _AllToAllRows.apply(x, out_rows, in_rows, group)


def _gather(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    width = max(rows)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((width * len(rows), *x.shape[1:]))
    with DispatchTimer.measure(group):
        c10d_compat.all_gather_single(out, padded, group=group)
    return torch.cat([out[i * width : i * width + n] for i, n in enumerate(rows)])


def _reduce_scatter(
    x: torch.Tensor, rows: list[int], rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    width = max(rows)
    padded = x.new_zeros((width * len(rows), *x.shape[1:]))
    offsets = [0]
    for n in rows:
        offsets.append(offsets[-1] + n)
    for i, n in enumerate(rows):
        padded[i * width : i * width + n] = x[offsets[i] : offsets[i + 1]]
    out = x.new_empty((width, *x.shape[1:]))
    with DispatchTimer.measure(group):
        c10d_compat.reduce_scatter_single(out, padded, group=group)
    # A fresh tensor, not a view: FSDP2 warns about (and in-place ops would break) view outputs.
    return out if rows[rank] == width else out[: rows[rank]].clone()


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, rows: list[int], rank: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        return _gather(x, rows, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(grad, ctx.rows, ctx.rank, ctx.group), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, rows: list[int], rank: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.rows, ctx.group = rows, group
        return _reduce_scatter(x, rows, rank, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather(grad, ctx.rows, ctx.group), None, None, None


def all_gather_rows(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenation of every group rank's ``x``; backward sums.

    Rank ``j`` holds ``rows[j]`` rows.
    """
    return _AllGatherRows.apply(x, rows, dist.get_rank(group), group)


def reduce_scatter_rows(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group of ``x``, of which this rank keeps its share.

    ``x`` has ``sum(rows)`` rows; this rank keeps its ``rows[rank]``.
    """
    return _ReduceScatterRows.apply(x, rows, dist.get_rank(group), group)


__all__ = [
    "DispatchTimer",
    "all_gather_rows",
    "all_to_all_rows",
    "checked_counts",
    "exchange_counts",
    "reduce_scatter_rows",
]
