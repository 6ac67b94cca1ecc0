"""``generate()`` on a tensor-parallel model: the logits it reads are whole, not vocab shards.

The ``lm_head`` style returns the logits as a DTensor split over the vocabulary, which the
loss reads without gathering them (docs/tensor_parallel.md). Hugging Face's generation loop
instead mixes the logits with plain tensors (``next_tokens * unfinished_sequences``), which
DTensor refuses. During ``generate`` the output head gathers its logits (one all-gather of
the last positions' vocabulary shards per step); training and plain forwards keep the
sharded logits.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

_FLAG = "_tsm_whole_logits"  # on the output head: gather its logits (set during generate)
_HEAD = "_tsm_logits_head"  # on the model: the output head's name in it


def _gather_when_generating(head: nn.Module, _args: tuple, output: Any) -> Any:
    if getattr(head, _FLAG, False) and isinstance(output, DTensor):
        return output.full_tensor()
    return output


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin.generate`` with the output head gathering its logits."""
    head = self.get_submodule(getattr(self, _HEAD))
    before = getattr(head, _FLAG, False)
    setattr(head, _FLAG, True)
    try:
        return type(self).generate(self, *args, **kwargs)  # type: ignore[attr-defined]
    finally:
        setattr(head, _FLAG, before)


def gather_logits_in_generate(model: nn.Module, head_name: str) -> None:
    """Makes ``model.generate`` read whole logits from its ``lm_head``-styled layer.

    A model without ``generate`` (not a generation model) is left alone. The state lives on
    the model and the head themselves, so a deep copy of the model generates on its own.

    Args:
        model: The tensor-parallel model (a Hugging Face generation model).
        head_name: The output layer's name in ``model`` (``get_submodule``).
    """
    if not callable(getattr(type(model), "generate", None)):
        return
    model.get_submodule(head_name).register_forward_hook(_gather_when_generating)
    setattr(model, _HEAD, head_name)
    model.generate = types.MethodType(_generate, model)  # type: ignore[assignment]


__all__ = ["gather_logits_in_generate"]
