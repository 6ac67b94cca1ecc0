"""Reading a Hugging Face model's config the same way everywhere."""

from __future__ import annotations

from typing import Any

from torch import nn


def text_config(model: nn.Module) -> Any:
    """The config describing ``model``'s transformer: a multimodal model's text config.

    A composite transformers config (Gemma 3, Qwen2.5-VL) keeps the language model's sizes
    (heads, hidden size, experts) on a sub-config, which ``get_text_config(decoder=True)``
    returns. Any other config is returned as is: one without a text sub-config, an older
    encoder-decoder one (for which transformers would build a copy holding the decoder's
    sizes, not the encoder's), and one that names several (transformers refuses to choose).
    Sizes the tensor parallel, expert and context parallel code reads come from here.
    """
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    if not callable(getter):
        return config
    try:
        text = getter(decoder=True)
    except ValueError:  # several text configs: none is the model's own
        return config
    # A sub-config is one of the config's own attributes; anything else is a derived copy.
    if text is config or any(text is v for v in vars(config).values()):
        return text
    return config
