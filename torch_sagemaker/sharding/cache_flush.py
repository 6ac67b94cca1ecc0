"""``fsdp_cache_flush_warnings``: report when the CUDA caching allocator had to flush its cache.

When the caching allocator cannot serve a request from its cache it frees cached blocks and
retries (``num_alloc_retries`` in ``torch.cuda.memory_stats()``), which synchronises the
device and slows every step that does it. SMP warns about it (config key
``fsdp_cache_flush_warnings``, default true) with its best-practice advice. ``watch`` adds a
forward pre-hook to the root of the FSDP model that compares the counter with the previous
step's and warns, on the rank where it happened, when it grew. Without CUDA there is no
caching allocator and ``watch`` does nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torch_sagemaker.logger import get_logger

_WATCH_ATTR = "_tsm_cache_flush_watch"  # set on a root once its hook is registered


def _retries() -> int:
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def watch(root: nn.Module) -> bool:
    """Warns from ``root``'s forward whenever the allocator retried since the last forward.

    Args:
        root: The root FSDP module (FSDP1 wrapper or FSDP2 root).

    Returns:
        Whether a watch was installed (only with CUDA).
    """
    if not torch.cuda.is_available() or getattr(root, _WATCH_ATTR, False):
        return False
    last = [_retries()]

    def check(module: nn.Module, args: Any) -> None:
        now = _retries()
        if now > last[0]:
            get_logger().warning(
                f"the CUDA caching allocator flushed its cache {now - last[0]} time(s) since the "
                f"previous step ({now} in all); each flush synchronises the GPU "
                "and slows the step. "
                "Raise hybrid_shard_degree (smaller shards per GPU), lower the batch size, or "
                "enable activation checkpointing/offloading; set fsdp_cache_flush_warnings=false "
                "to silence this."
            )
        last[0] = now

    root.register_forward_pre_hook(check)
    setattr(root, _WATCH_ATTR, True)
    return True


__all__ = ["watch"]
