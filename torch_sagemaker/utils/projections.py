"""Recognising transformers' ``Conv1D``, a projection the TP code splits besides ``nn.Linear``.

``Conv1D`` (GPT-2 and its relatives) is a Linear with its weight stored transposed,
``(in_features, out_features)``, computing ``x @ weight + bias``. It is recognised by its
class name and layout, so that nothing here imports transformers.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (``weight`` of shape ``(nx, nf)``)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )


def conv1d_features(module: nn.Module) -> tuple[int, int]:
    """A ``Conv1D``'s ``(in_features, out_features)``: its weight's shape."""
    weight = cast(torch.Tensor, module.weight)
    return int(weight.shape[0]), int(weight.shape[1])


def out_features(module: nn.Module) -> int:
    """The output features of an ``nn.Linear`` or a transformers ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return int(module.out_features)
    return conv1d_features(module)[1]


__all__ = ["conv1d_features", "is_conv1d", "out_features"]
