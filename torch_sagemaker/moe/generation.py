"""``generate()`` on an expert-parallel model: every rank decodes until the last one is done.

Note [Generation with experts on other ranks]: the ranks of an expert parallel group are
data-parallel ranks, each decoding its own prompts, and every decoding step's forward
dispatches tokens to the experts of the others (all-to-all or all-gather). Hugging Face's
``generate`` leaves its loop on a rank once that rank's sequences are finished; its peers,
still decoding, then wait in the next step's dispatch for ever. Hugging Face has the remedy,
``synced_gpus=True``: a finished rank keeps running forwards (its outputs discarded) until
every rank is done, agreeing through one small all-reduce per step. It turns it on by itself
only for DeepSpeed ZeRO-3 and FSDP models, so an expert parallel model without FSDP (as for
inference) hung as soon as two ranks stopped at different steps. ``sync_generation`` makes
``synced_gpus=True`` the default of such a model's ``generate``; a value the caller passes
is kept.
"""

from __future__ import annotations

import types
from typing import Any

import torch.distributed as dist
from torch import nn


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin.generate``, with ``synced_gpus`` on by default across ranks."""
    if kwargs.get("synced_gpus") is None and dist.is_initialized() and dist.get_world_size() > 1:
        kwargs["synced_gpus"] = True
    return type(self).generate(self, *args, **kwargs)  # type: ignore[attr-defined]


def sync_generation(model: nn.Module) -> None:
    """Makes ``model.generate`` decode on every rank until all are done (Note above).

    A model without ``generate`` (not a generation model) is left alone. The method is bound
    to the model itself, so a deep copy generates on its own.

    Args:
        model: An expert parallel Hugging Face model.
    """
    if callable(getattr(type(model), "generate", None)):
        model.generate = types.MethodType(_generate, model)  # type: ignore[assignment]


__all__ = ["sync_generation"]
