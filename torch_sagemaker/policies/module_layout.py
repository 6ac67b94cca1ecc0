"""What the plan path reads from a model's own modules: head sizes, experts, packed blocks.

Generic over transformers' families: an attention module's head size (``attention_head_dim``),
the expert count of fused experts (``expert_count``), the number of equal blocks in a packed
projection's output (``packed_blocks``), and the attention attributes that hold the width of
all heads together (``FULL_WIDTH_ATTRS``), which ``tensor_parallel.plan`` scales per rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torch_sagemaker.policies.model_policy import config_value
from torch_sagemaker.utils.hf_config import text_config
from torch_sagemaker.utils.projections import out_features


def attention_head_dim(attention: nn.Module, config: Any) -> int:
    """The head size of one attention module: its own ``head_dim``, else the config's.

    (Per module: a heterogeneous config may give layers different head sizes.)
    """
    own = getattr(attention, "head_dim", None)
    if isinstance(own, int) and own > 0:
        return own
    head_dim = config_value(config, "head_dim")
    if head_dim:
        return int(head_dim)
    heads = int(config_value(config, "num_attention_heads", 0) or 0)
    return int(config_value(config, "hidden_size", 0) or 0) // heads if heads else 0


def expert_count(module: nn.Module) -> int | None:
    """The expert count of fused experts stored the way expert splitting needs, or None.

    The layout: an integer ``num_experts``, no child module with parameters, and only
    parameters whose first dimension is that count (transformers 5's fused
    ``gate_up_proj``/``down_proj`` and their biases). A list of expert modules is not it.
    """
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    params = list(module.parameters(recurse=False))
    if not params or any(True for c in module.children() for _ in c.parameters()):
        return None  # (children without parameters, an activation function, are fine)
    if any(p.ndim < 2 or p.shape[0] != count for p in params):
        return None
    return count


#: Attention attributes holding the width of all heads together, each with the attribute of
#: one head's size next to it: ``tensor_parallel.plan`` scales them to this rank's heads.
FULL_WIDTH_ATTRS = (("all_head_size", "attention_head_size"), ("split_size", "head_dim"))


def packed_blocks(model: nn.Module, name: str, attention: list[str]) -> int:
    """How many equal blocks the output of the packed projection ``name`` holds.

    Inside an attention module (one of ``attention``): its output width over the heads'
    (``num_attention_heads`` x the module's head size), 3 for ``[q | k | v]``. Elsewhere 2,
    transformers' meaning of ``packed_colwise`` (a fused ``[gate | up]``). Note [Packed
    projections] in ``tensor_parallel/projection_styles.py`` (a ``Conv1D``), Note [Fused
    projections computed by rows] in ``tensor_parallel/fused_rows.py`` (an ``nn.Linear``).

    Raises:
        ValueError: The output is not a whole number (at least 2) of the heads' widths:
            blocks of unequal widths (keys and values of fewer heads than the queries, as
            under multi-query attention), which a block-by-block split cannot keep whole.
    """
    owner = next((a for a in attention if name.startswith(f"{a}.")), None)
    if owner is None:
        return 2
    config = text_config(model)
    heads = int(config_value(config, "num_attention_heads", 0) or 0)
    width = heads * attention_head_dim(model.get_submodule(owner), config)
    features = out_features(model.get_submodule(name))
    if width <= 0 or features % width or features // width < 2:
        raise ValueError(
            f"its {features} output features are not a whole number of blocks of the "
            f"{heads} heads' width {width}, so a block-by-block split would not keep the heads "
            "of each block whole"
        )
    return features // width


__all__ = ["FULL_WIDTH_ATTRS", "attention_head_dim", "expert_count", "packed_blocks"]
