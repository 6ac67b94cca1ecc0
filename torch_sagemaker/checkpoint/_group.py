"""The ranks taking part in one save or load, and the few collectives the protocol needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from torch_sagemaker.checkpoint.marker import CheckpointError

T = TypeVar("T")


class Participants:
    """Ranks of ``process_group`` (or every rank), with the coordinator as a global rank.

    Without an initialized process group everything is local (``distributed`` is False).

    Args:
        process_group: The group that saves or loads together; ``None`` means all ranks.
        coordinator_rank: Global rank that writes the marker and renames the directory.
            SMP passes ``min(global ranks of the group)``; any member is accepted.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, coordinator_rank: int = 0) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        if not self.distributed:
            self.ranks = [0]
            self.rank = 0
            self.coordinator = 0
            return
        self.ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise ValueError(
                f"rank {self.rank} called a checkpoint function with a process_group of ranks "
                f"{self.ranks} it is not part of; only members of the group may call it."
            )
        if coordinator_rank not in self.ranks:
            # SMP scripts pass 0 by default even for sub-groups; fall back to the group's
            # first rank, which is what DCP itself coordinates with.
            coordinator_rank = self.ranks[0]
        self.coordinator = coordinator_rank

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank is the coordinator."""
        return self.rank == self.coordinator

    def barrier(self) -> None:
        """Waits for every participant (no-op without a process group)."""
        if self.distributed:
            dist.barrier(group=self.group)

    def run_on_coordinator(self, fn: Callable[[], T], step: str = "a checkpoint step") -> T:
        """Runs ``fn`` on the coordinator; every participant gets its result or its error.

        The broadcast doubles as a barrier: when it returns, ``fn`` has finished.

        Args:
            fn: The work (on the coordinator only).
            step: What ``fn`` does, for the error when a participant fails meanwhile.

        Raises:
            CheckpointError: If ``fn`` raised, or the group failed (a rank died) meanwhile.
        """
        result: list[Any] = [None, None]  # error text, value
        if self.is_coordinator:
            try:
                result[1] = fn()
            except Exception as e:  # noqa: BLE001 - forwarded to every rank below
                result[0] = f"{type(e).__name__}: {e}"
                if not self.distributed:
                    raise
        try:
            result = self.broadcast(result)
        except Exception as e:  # noqa: BLE001 - a collective failure is a checkpoint failure here
            raise CheckpointError(
                f"{step} failed: a rank of the checkpoint group {self.ranks} "
                f"failed meanwhile ({type(e).__name__}: {e})."
            ) from e
        if result[0] is not None:
            raise CheckpointError(
                f"rank {self.coordinator} failed to finish the checkpoint: {result[0]}"
            )
        return result[1]

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every participant."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.coordinator, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every participant's ``obj`` in group-rank order on the coordinator, else ``None``."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * len(self.ranks) if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self.coordinator, group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every participant's ``obj`` in group-rank order (``[obj]`` without a process group)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return out
