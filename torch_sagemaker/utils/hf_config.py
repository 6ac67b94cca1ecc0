"""Reading a Hugging Face model's config the same way everywhere."""

from __future__ import annotations

from typing import Any

from torch import nn


def text_config(model: nn.Module) -> Any:
    """The config describing ``model``'s transformer: a multimodal model's text config.

    A composite transformers config (Gemma 3, Qwen2.5-VL) keeps the language model's sizes
    (heads, hidden size, experts) on a sub-config, and ``get_text_config(decoder=True)``
    returns it; every other config is returned as is. Sizes the tensor parallel, expert and
    context parallel code reads come from here, never from ``model.config`` directly.
    """
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config
