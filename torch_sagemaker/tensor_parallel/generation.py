"""``generate()`` on a tensor-parallel model: the logits it reads are whole, not vocab shards.

The ``lm_head`` style returns the logits as a DTensor split over the vocabulary, which the
loss reads without gathering them (docs/tensor_parallel.md). Hugging Face's generation loop
instead mixes the logits with plain tensors (``next_tokens * unfinished_sequences``), which
DTensor refuses. During ``generate`` the output head gathers its logits (one all-gather of
the last positions' vocabulary shards per step); training and plain forwards keep the
sharded logits.

Note [Generation under FSDP2]: Hugging Face's ``generate`` may call parts of the model before
the first forward of the root: a multimodal model computes its image features (Gemma 3's
``get_image_features`` runs the vision tower) while preparing the inputs. Under FSDP2 the
root's parameters are sharded then (after a training step), and the replicated vision tower
refuses to compute with this rank's shard (Note [Parameters still sharded by FSDP] in
``local_parameters.py``). So ``generate`` gathers the root's parameters first
(``unshard()``), as the root's first forward would; nested FSDP units gather their own in
their forwards. Before any forward, FSDP2 has not yet decided which module is the root: the
first ``fully_shard`` module called would take itself for it (a vision encoder layer, whose
parameters the replicated tower has swapped for plain tensors, then failed in FSDP's lazy
initialization), so the root's lazy initialization runs first, as in its first forward. The
root keeps its parameters after a forward anyway (``shard_model`` does not reshard the root
after forward), so nothing is resharded afterwards.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import fsdp2 as fsdp2_compat

_FLAG = "_tsm_whole_logits"  # on the output head: gather its logits (set during generate)
_HEAD = "_tsm_logits_head"  # on the model: the output head's name in it


def _gather_when_generating(head: nn.Module, _args: tuple, output: Any) -> Any:
    if getattr(head, _FLAG, False) and isinstance(output, DTensor):
        return output.full_tensor()
    return output


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin.generate`` with the output head gathering its logits.

    An FSDP2 root gathers its parameters first (Note [Generation under FSDP2]).
    """
    head = self.get_submodule(getattr(self, _HEAD))
    if isinstance(self, FSDPModule):  # Note [Generation under FSDP2]
        fsdp2_compat.lazy_init_root(self)
        self.unshard()
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
