"""Checkpoints of the example: sharded (reshardable) saves, resume, retention, Hugging Face export.

``torch.sagemaker.distributed.checkpoint.TrainingState`` holds the model, optimizer, LR
scheduler, step, data position and RNG states; sharded checkpoints reload under another
world size or hybrid/TP layout. Directories are named ``<model_type>-<N>steps`` as in SMP's
scripts, and the newest ``num_kept`` are kept.
"""

from __future__ import annotations

import os
import re

from torch.sagemaker.distributed.checkpoint import (
    TrainingState,
    is_complete,
    maybe_finalize_async_calls,
)

STEP_DIR = r"^.*-(\d+)steps$"


def step_dirs(root: str | None) -> list[tuple[int, str]]:
    """Complete checkpoint directories under ``root`` as (step, path), oldest first."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = re.match(STEP_DIR, name)
        if match and is_complete(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
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

    Returns:
        The path loaded, or None when 'latest'/'auto' found no complete checkpoint.
    """
    path = target
    if target in ("latest", "auto"):
        dirs = step_dirs(root)
        if not dirs:
            return None
        path = dirs[-1][1]
    state.load(path)
    return path
