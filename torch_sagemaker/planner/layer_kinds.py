"""Kinds of layer: which layers of a model save the same tensors for backward.

``layer_kind(config, index)`` (Note [Layer kinds]); the probe measures each kind's attention
apart where kinds differ, and the planner sizes each real layer by its kind.
"""

from __future__ import annotations

from typing import Any

# Note [Layer kinds]
#     Some families build layers of more than one kind: Llama 4 applies no rotary embedding
#     in every fourth layer (``no_rope_layers``), and ``layer_types`` names each layer's
#     attention (sliding, chunked, full). Where the kinds save different tensors for
#     backward, the probe measures each kind's attention on the reduced copy's layers of that
#     kind, and the planner sizes every layer of the real model by its kind
#     (``ActivationProfile.attention_by_kind``). A layer's kind is its value in each of
#     ``LAYER_KIND_ATTRS``, the config's lists of one entry per layer; a kind the reduced
#     copy's layers do not hold is refused, not guessed. Sizes that change layer by layer are
#     another matter (Note [One size per layer]).
#: Config attributes that list one value per layer and change what the layer saves.
LAYER_KIND_ATTRS = ("layer_types", "no_rope_layers")


def layer_kind(config: Any, index: int) -> tuple[tuple[str, Any], ...]:
    """Layer ``index``'s kind: its entry in each of the config's ``LAYER_KIND_ATTRS``.

    Note [Layer kinds]; empty where the config lists none.
    """
    kind = []
    for attr in LAYER_KIND_ATTRS:
        values = getattr(config, attr, None)
        if isinstance(values, list | tuple) and index < len(values):
            kind.append((attr, values[index]))
    return tuple(kind)


__all__ = ["LAYER_KIND_ATTRS", "layer_kind"]
