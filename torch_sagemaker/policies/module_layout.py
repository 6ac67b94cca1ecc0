"""What the plan path reads from a model's own modules: head sizes, experts, packed blocks.

Generic over transformers' families: an attention module's head size (``attention_head_dim``),
the expert count of fused experts (``expert_count``), the widths of the blocks in a packed
projection's output (``packed_blocks``), the attention attributes that hold the width of
all heads together (``FULL_WIDTH_ATTRS``), which ``tensor_parallel.plan`` scales per rank,
and the transformer layer class (``transformer_layer_class``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
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

    The layout: an integer ``num_experts``, no list of modules below (a list of expert
    modules is not it), parameters of the module itself whose first dimension is the count
    (transformers 5's fused ``gate_up_proj``/``down_proj`` and their biases), and on child
    modules only parameters whose first dimension holds several rows per expert, each
    expert's together (DBRX's ``w1``, ``v1``, ``w2`` of shape ``(experts x ffn, hidden)``
    on ``experts.mlp``). A contiguous split of that dimension gives each rank whole
    experts. (A child with one row per expert, a router's ``(experts, hidden)`` weight in a
    whole MoE block, is not it.)
    """
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    if any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in module.modules()):
        return None
    own = list(module.parameters(recurse=False))
    below = [p for c in module.children() for p in c.parameters()]
    if not own and not below:
        return None
    if any(p.ndim < 2 or p.shape[0] != count for p in own):
        return None
    if any(p.ndim < 2 or p.shape[0] % count or p.shape[0] == count for p in below):
        return None
    return count


#: Attention attributes holding the width of all heads together, each with the attribute of
#: one head's size next to it: ``tensor_parallel.plan`` scales them to this rank's heads.
FULL_WIDTH_ATTRS = (("all_head_size", "attention_head_size"), ("split_size", "head_dim"))


def packed_blocks(model: nn.Module, name: str, attention: list[str]) -> tuple[int, ...]:
    """The widths of the blocks the output of the packed projection ``name`` holds.

    Inside an attention module (one of ``attention``): blocks of the heads' width
    (``num_attention_heads`` x the module's head size), three for ``[q | k | v]``; or, under
    grouped-query attention, ``[q | k | v]`` with keys and values of the module's (else the
    config's) ``num_key_value_heads`` (DBRX's ``Wqkv``). Elsewhere two equal blocks,
    transformers' meaning of ``packed_colwise`` (a fused ``[gate | up]``). Note [Packed
    projections] in ``tensor_parallel/projection_styles.py`` (a ``Conv1D``, equal blocks
    only), Note [Fused projections computed by rows] in ``tensor_parallel/fused_rows.py``
    (an ``nn.Linear``).

    Raises:
        ValueError: The output is neither a whole number (at least 2) of the heads' widths
            nor grouped-query ``[q | k | v]``, so a block-by-block split cannot keep the
            heads whole (one key/value head shared by all, multi-query attention, is its
            own style, ``shared_kv_colwise``).
    """
    features = out_features(model.get_submodule(name))
    owner = next((a for a in attention if name.startswith(f"{a}.")), None)
    if owner is None:
        return (features // 2, features // 2)
    config = text_config(model)
    module = model.get_submodule(owner)
    heads = int(config_value(config, "num_attention_heads", 0) or 0)
    head_dim = attention_head_dim(module, config)
    width = heads * head_dim
    kv_heads = getattr(module, "num_key_value_heads", None)
    if not isinstance(kv_heads, int):
        kv_heads = int(config_value(config, "num_key_value_heads", 0) or 0)
    # (first: with 4 query and 2 key/value heads, [q | k | v] is also two heads' widths)
    if 1 < kv_heads < heads and features == (heads + 2 * kv_heads) * head_dim:
        return (width, kv_heads * head_dim, kv_heads * head_dim)
    if width > 0 and features % width == 0 and features // width >= 2:
        return (width,) * (features // width)
    grouped = (
        f", nor [q | k | v] of {heads} query and {kv_heads} key/value heads"
        if 1 < kv_heads < heads
        else ""
    )
    raise ValueError(
        f"its {features} output features are not a whole number of blocks of the {heads} "
        f"heads' width {width}{grouped}, so a block-by-block split would not keep the heads "
        "of each block whole"
    )


def transformer_layer_class(model: nn.Module, plan: dict[str, str]) -> str:
    """The transformer layer: of the ``_no_split_modules`` classes, the text decoder's.

    Only classes whose modules are elements of an ``nn.ModuleList`` count (a layer stack),
    and of those the outermost: ``_no_split_modules`` may name a layer's attention too
    (mBART), which can outnumber the layers. A multimodal model names its vision tower's
    layers there too. Classes with layers in the text decoder (``get_decoder()``) come first,
    then those the plan splits, then the most repeated one. A model whose
    ``_no_split_modules`` names no layer stack (older families) gets the class of the
    outermost list elements that hold planned modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    modules = list(model.named_modules())
    in_plan = [n for n, _ in modules if any(fnmatchcase(n, key) for key in plan)]
    decoder = _decoder_name(model, modules)
    elements = [  # (name, class name) of every module that is a layer stack's element
        (f"{name}.{child}" if name else child, type(module).__name__)
        for name, stack in modules
        if isinstance(stack, nn.ModuleList)
        for child, module in stack.named_children()
    ]
    named = [(n, c) for n, c in elements if c in names]
    holding = [(n, c) for n, c in elements if any(p.startswith(f"{n}.") for p in in_plan)]
    candidates = _outermost(named) or _outermost(holding)
    if not candidates:
        raise ValueError(
            f"tsm.transform: {type(model).__name__} has a transformers TP plan but its "
            f"_no_split_modules ({sorted(names) or 'none'}) name none of its modules, so there "
            "is no transformer layer to wrap, checkpoint and offload. Register a "
            "torch_sagemaker.policies.ModelPolicy naming its layer class (docs/tensor_parallel.md)."
        )
    counts: dict[str, int] = {}
    planned: set[str] = set()
    in_decoder: set[str] = set()
    for name, cls in candidates:
        counts[cls] = counts.get(cls, 0) + 1
        if decoder and name.startswith(f"{decoder}."):
            in_decoder.add(cls)
        if any(n.startswith(f"{name}.") for n in in_plan):
            planned.add(cls)
    # the repeated decoder layer
    return max(counts, key=lambda n: (n in in_decoder, n in planned, counts[n]))


def _outermost(elements: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(name, class)`` pairs not inside another pair's module."""
    return [(n, c) for n, c in elements if not any(n.startswith(f"{o}.") for o, _ in elements)]


def _decoder_name(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> str:
    """The name of the text decoder below ``model`` (``get_decoder()``), or ``""``."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except (AttributeError, NotImplementedError, ValueError):
        return ""
    return next((n for n, m in modules if m is decoder and n), "")


__all__ = [
    "FULL_WIDTH_ATTRS",
    "attention_head_dim",
    "expert_count",
    "packed_blocks",
    "transformer_layer_class",
]
