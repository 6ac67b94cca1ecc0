"""Background checkpoint requests (``torch.sagemaker.distributed.checkpoint.async_utils``).

An ``AsyncCallsQueue`` runs requests one after the other on a single worker thread (so two
saves never interleave their collectives) and hands results back in order through
``maybe_finalize_async_calls``, which training loops call every step (non-blocking) and once
at the end (blocking).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker.checkpoint.marker import CheckpointError


@dataclass
class _Call:
    index: int
    description: str
    future: Future


class AsyncCallsQueue:
    """Ordered background execution of checkpoint requests on one worker thread."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._calls: list[_Call] = []
        self._next_index = 0

    def schedule_async_request(self, fn: Callable[[], Any], description: str = "") -> int:
        """Queues ``fn`` for the worker thread and returns the request's index."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsm-checkpoint")
        index = self._next_index
        self._next_index += 1
        self._calls.append(
            _Call(index, description or f"request {index}", self._executor.submit(fn))
        )
        return index

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled but not yet returned by ``maybe_finalize_async_calls``."""
        return len(self._calls)

    def maybe_finalize_async_calls(
        self,
        blocking: bool = True,
        process_group: dist.ProcessGroup | None = None,
        skip_sync: bool = False,
    ) -> list[int]:
        """Collects finished requests, oldest first, re-raising the first failure.

        Args:
            blocking: Wait for every queued request; otherwise take only the finished ones.
            process_group: Ranks that agree on how many requests to finalize (non-blocking
                mode), so that all of them report the same indices; default all ranks.
            skip_sync: Do not agree across ranks (each rank finalizes what it has finished).

        Returns:
            Indices of the finalized requests.

        Raises:
            CheckpointError: If a finalized request failed (``committed=True``: a save whose
                checkpoint is complete, where a rank failed afterwards); later requests stay
                queued.
        """
        if blocking:
            count = len(self._calls)
        else:
            count = 0
            while count < len(self._calls) and self._calls[count].future.done():
                count += 1
            if not skip_sync and dist.is_available() and dist.is_initialized():
                agreed = torch.tensor([count], dtype=torch.int64)
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
                count = int(agreed.item())
        done: list[int] = []
        while self._calls and len(done) < count:
            call = self._calls[0]
            try:
                call.future.result()
            except Exception as e:
                self._calls.pop(0)
                if getattr(e, "committed", False):  # complete; a rank failed afterwards
                    raise CheckpointError(f"{call.description}: {e}", committed=True) from e
                raise CheckpointError(f"{call.description} failed: {e}") from e
            self._calls.pop(0)
            done.append(call.index)
        return done

    def close(self) -> None:
        """Waits for all requests and stops the worker thread (errors are re-raised)."""
        try:
            self.maybe_finalize_async_calls(blocking=True, skip_sync=True)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


DEFAULT_ASYNC_REQUEST_QUEUE = AsyncCallsQueue()
"""The queue ``async_save`` uses when none is given."""


def maybe_finalize_async_calls(
    blocking: bool = True, process_group: dist.ProcessGroup | None = None
) -> list[int]:
    """``DEFAULT_ASYNC_REQUEST_QUEUE.maybe_finalize_async_calls`` (see there)."""
    return DEFAULT_ASYNC_REQUEST_QUEUE.maybe_finalize_async_calls(
        blocking=blocking, process_group=process_group
    )


__all__ = ["DEFAULT_ASYNC_REQUEST_QUEUE", "AsyncCallsQueue", "maybe_finalize_async_calls"]
