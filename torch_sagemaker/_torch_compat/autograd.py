"""Private autograd engine names: the running backward's id and its final callbacks.

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def current_graph_task_id() -> int:
    """The id of the backward pass running in this thread, ``-1`` outside a backward pass."""
    return torch._C._current_graph_task_id()


def queue_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current backward pass has finished.

    Raises:
        RuntimeError: If no backward pass is running.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


__all__ = ["current_graph_task_id", "queue_callback"]
