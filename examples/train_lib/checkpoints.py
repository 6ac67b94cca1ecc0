"""Checkpoints of the example: sharded (reshardable) saves, resume, retention, Hugging Face export.

``torch.sagemaker.distributed.checkpoint.TrainingState`` holds the model, optimizer, LR
scheduler, step, data position and RNG states; sharded checkpoints reload under another
world size or hybrid/TP layout. Directories are named ``<model_type>-<N>steps`` as in SMP's
scripts, and the newest ``num_kept`` are kept. ``--checkpoint-dir`` may be a local path or an
``s3://`` URI (endpoint and credentials from the AWS variables); ``--checkpoint-interval auto``
measures the step and save times and picks the interval (``AutoInterval``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.sagemaker.distributed.checkpoint import (
    TrainingState,
    checkpoint_location,
    is_complete,
    maybe_finalize_async_calls,
)
from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
    compute_auto_checkpoint_interval,
)

STEP_DIR = r"^.*-(\d+)steps$"


def step_dirs(root: str | None) -> list[tuple[int, str]]:
    """Complete checkpoint directories under ``root`` as (step, path), oldest first."""
    if not root:
        return []
    location = checkpoint_location(root)  # a directory or an s3:// prefix
    found = []
    for name in location.checkpoint_names():
        match = re.match(STEP_DIR, name)
        # is_complete: also a step saved in per-TP-rank parts (FSDP1 with TP), once all are.
        if match and is_complete(location.child(name)):
            found.append((int(match.group(1)), str(location.child(name))))
    return sorted(found)


def save(state: TrainingState, root: str, model_type: str, num_kept: int, use_async: bool) -> str:
    """Saves ``state`` to ``root/<model_type>-<step>steps``; older ones beyond ``num_kept`` go."""
    path = os.path.join(root, f"{model_type}-{state.step}steps")
    state.save(path, use_async=use_async, num_kept=num_kept, regex=STEP_DIR)
    return path


def finish() -> None:
    """Waits for pending asynchronous saves."""
    maybe_finalize_async_calls(blocking=True)


def resume(state: TrainingState, root: str | None, target: str) -> str | None:
    """Loads ``target`` (a path, or 'latest'/'auto' under ``root``) into ``state``.

    'latest' is chosen on rank 0 and sent to the others: ranks listing ``root`` themselves
    could see different newest checkpoints (a save committing, or retention deleting, between
    their listings) and resume from different steps; the loader would refuse that
    (Note [The ranks of a load read one checkpoint]), this way it does not arise.

    Returns:
        The path loaded, or None when 'latest'/'auto' found no complete checkpoint.
    """
    path: str | None = target
    if target in ("latest", "auto"):
        path = _from_rank_0(lambda: _newest(root), f"listing the checkpoints under {root}")
        if path is None:
            return None
    state.load(path)
    return path


def _newest(root: str | None) -> str | None:
    """The newest complete checkpoint under ``root``, or None."""
    dirs = step_dirs(root)
    return dirs[-1][1] if dirs else None


def _from_rank_0(choose: Callable[[], str | None], what: str) -> str | None:
    """``choose()`` run on rank 0, its result on every rank (run here without a process group).

    Its error, too: raised on rank 0 alone, it would leave the others waiting in the
    broadcast until the group's timeout.
    """
    if not dist.is_initialized():
        return choose()
    box: list = [(None, None)]
    if dist.get_rank() == 0:
        try:
            box = [(choose(), None)]
        except Exception as e:  # noqa: BLE001 - sent to every rank, then raised
            box = [(None, f"{type(e).__name__}: {e}")]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise RuntimeError(f"rank 0 failed {what}: {error}")
    return value


class AutoInterval:
    """``--checkpoint-interval auto``: measure plain steps and one save, then decide.

    Step 1 (first allocations) is not a sample; the next ``warmup_steps`` steps are timed
    without saving; the step after that saves once, timing the save call (the part that
    blocks training) and the wait for the background write. ``compute_auto_checkpoint_interval``
    then picks the smallest interval at which saving costs at most ``max_overhead_fraction`` of
    training time (Note [Automatic checkpoint interval]). Ranks measure different times, so
    they agree on the largest interval any of them computed.

    Args:
        warmup_steps: Plain steps to time.
        max_overhead_fraction: Bound on saving's share of training time.
    """

    def __init__(self, warmup_steps: int = 3, max_overhead_fraction: float = 0.05) -> None:
        self.warmup_steps = warmup_steps
        self.max_overhead_fraction = max_overhead_fraction
        self.step_durations: list[float] = []
        self.interval: int | None = None
        self.measuring = False

    def due(self, step: int, step_time: float) -> bool:
        """Whether to save after ``step`` (which took ``step_time`` seconds)."""
        if self.interval is not None:
            return step % self.interval == 0
        if step > 1 and len(self.step_durations) < self.warmup_steps:
            self.step_durations.append(step_time)
            return False
        self.measuring = step > 1
        return self.measuring

    def measured(self, step_time: float, save_s: float, io_s: float) -> int:
        """Records the measured save and returns the interval all ranks use from now on."""
        decided = compute_auto_checkpoint_interval(
            self.step_durations,
            [step_time + save_s],
            [save_s],
            [io_s],
            self.max_overhead_fraction,
        ).interval
        agreed = torch.tensor([decided], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.interval, self.measuring = int(agreed.item()), False
        return self.interval
