"""TP plans in transformers' terms for families transformers ships none for.

transformers puts a ``base_model_tp_plan`` on most decoder configs; older families (OPT,
StableLM, Persimmon, BioGPT, GPT-Neo, BART's decoder, RoBERTa, ...) have none, and
``tsm.transform`` would refuse them at ``tensor_parallel_degree > 1``. For those whose
layers are plain projections, this
module gives the plan a user would otherwise write (docs/tensor_parallel.md, "A model
without a plan"), keyed like ``base_model_tp_plan``: module names below the base model,
``*`` for layer numbers, transformers' style names. ``transformers_plan.policy_from_plan``
uses one only where the model's own plan is empty, so a plan from transformers or from the
user (``model.tp_plan = {...}``, even one naming only the embeddings) always wins. The
plans then go through the same translation and checks as transformers' own (Note
[Plan-driven layout]).

Note [Which families get a shipped plan]: a family is listed only after its tiny model
passed ``python -m tools.model_coverage`` (tensor parallel 2 x hybrid shard 2 against one
process: logits, loss, gradients and parameters over 3 steps). What keeps the others out,
checked on that harness:

- a norm over the full hidden width between the split projections (BitNet's sub-norms);
- reshapes by a full width taken from the input's size (TrOCR's attention), which no
  attribute scales. Full widths held in attributes are scaled: the BERT family's
  ``all_head_size`` and GPT-2's ``split_size`` generically
  (``tensor_parallel.plan._set_head_counts``), and per family where a name means that only
  there (``width_attrs``: XGLM's and MVP's ``embed_dim``, which in CodeGen means something
  else; CTRL's ``d_model_size``; OpenAI-GPT's ``split_size``, which has no head size beside
  it and is scaled by the rank's share of the heads).

Fused query/key/value projections are in: BLOOM's and Falcon's are head- or group-major,
so a plain column split keeps whole heads; MPT's ``Wqkv`` is ``[q | k | v]`` blocks,
``packed_colwise``; under multi-query attention Falcon's and GPT-BigCode's end with one
shared key/value head, ``shared_kv_colwise``, chosen per config in ``_VARIANTS``; DBRX's
``Wqkv`` is ``[q | k | v]`` of grouped-query attention, narrower keys and values, also
``packed_colwise`` (``module_layout.packed_blocks`` reads the widths). ALiBi
biases built outside the attention are cut per rank, ``head_inputs``.

Sequence-to-sequence configs count the encoder's heads as ``num_attention_heads``; their
causal LMs are the decoder, whose own count is used (``heads_attr``: Whisper's may differ).

The plans name only the layers. ``transformers_plan`` adds the embeddings, split over the
vocabulary as transformers does in the plans it builds: the output one, where it is an
``nn.Linear``, ``colwise_gather_output``; the input one ``embedding_rowwise``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: A self-attention block of separate q/k/v projections and an output projection ``out``.
_QKV = ("q_proj", "k_proj", "v_proj")


def _attention(prefix: str, out: str, qkv: tuple[str, ...] = _QKV) -> dict[str, str]:
    return {
        **{f"{prefix}.{p}": "colwise" for p in qkv},
        f"{prefix}.{out}": "rowwise",
    }


def _mlp(up: tuple[str, ...], down: str) -> dict[str, str]:
    return {**{u: "colwise" for u in up}, down: "rowwise"}


def _bart_like_decoder() -> dict[str, str]:
    """The decoder stack of a sequence-to-sequence family, as its ``*ForCausalLM`` builds it.

    (Its cross-attention runs only with encoder states; it is split like self-attention.)
    """
    layer = "decoder.layers.*"
    return {
        **_attention(f"{layer}.self_attn", "out_proj"),
        **_attention(f"{layer}.encoder_attn", "out_proj"),
        **_mlp((f"{layer}.fc1",), f"{layer}.fc2"),
    }


_BART_LIKE = (
    "whisper",
    "bart",
    "mbart",
    "marian",
    "pegasus",
    "blenderbot",
    "blenderbot-small",
    "plbart",
    "bigbird_pegasus",
)


def _bert_like() -> dict[str, str]:
    """The encoder stack of the BERT family, as its ``*ForCausalLM`` (``is_decoder``) uses it."""
    layer = "encoder.layer.*"
    qkv = ("self.query", "self.key", "self.value")
    return {
        **_attention(f"{layer}.attention", "output.dense", qkv),
        **_mlp((f"{layer}.intermediate.dense",), f"{layer}.output.dense"),
    }


_BERT_LIKE = (
    "bert",
    "bert-generation",
    "megatron-bert",
    "rembert",
    "roformer",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "xlm-roberta",
    "xlm-roberta-xl",
    "big_bird",
    "xmod",
)

#: query_key_value is head-major (each head's q, k, v together): a column split keeps whole
#: heads. The q/k norms act on one head's width with weights shared by all heads, so each
#: rank's heads give part of their gradient.
_PERSIMMON = {
    **_attention("layers.*.self_attn", "dense", ("query_key_value",)),
    "layers.*.self_attn.q_layernorm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_layernorm": "replicated_with_grad_allreduce",
    **_mlp(("layers.*.mlp.dense_h_to_4h",), "layers.*.mlp.dense_4h_to_h"),
}

#: model_type -> plan below the base model (like ``config.base_model_tp_plan``).
SHIPPED_PLANS: dict[str, dict[str, str]] = {
    **{f: _bert_like() for f in _BERT_LIKE},
    **{f: _bart_like_decoder() for f in _BART_LIKE},
    "gpt_neox_japanese": {
        # The attention returns its output bias for the layer to add after the output
        # projection's all-reduce: a parameter of its own, used on whole activations.
        **_attention("layers.*.attention", "dense", ("query_key_value",)),
        "layers.*.attention": "local_params",
        **_mlp(("layers.*.mlp.dense_h_to_4h",), "layers.*.mlp.dense_4h_to_h"),
    },
    "opt": {
        **_attention("decoder.layers.*.self_attn", "out_proj"),
        **_mlp(("decoder.layers.*.fc1",), "decoder.layers.*.fc2"),
    },
    "biogpt": {
        **_attention("layers.*.self_attn", "out_proj"),
        **_mlp(("layers.*.fc1",), "layers.*.fc2"),
    },
    "stablelm": {
        **_attention("layers.*.self_attn", "o_proj"),
        **_mlp(("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"), "layers.*.mlp.down_proj"),
    },
    "persimmon": _PERSIMMON,
    "gpt2": {
        # transformers' Conv1D projections (weights stored transposed); c_attn packs
        # [q | k | v], split block by block (Note [Packed projections]).
        "h.*.attn.c_attn": "packed_colwise",
        "h.*.attn.c_proj": "rowwise",
        **_mlp(("h.*.mlp.c_fc",), "h.*.mlp.c_proj"),
    },
    # GPT-2's layout; its attention cuts c_attn's output at split_size, a full width without
    # a head size beside it (width_attrs)
    "openai-gpt": {
        "h.*.attn.c_attn": "packed_colwise",
        "h.*.attn.c_proj": "rowwise",
        **_mlp(("h.*.mlp.c_fc",), "h.*.mlp.c_proj"),
    },
    # query_key_value is head-major in BLOOM (each head's q, k, v together) and in Falcon
    # without multi-query attention; grouped by key/value head under Falcon's new decoder
    # architecture (each group's queries, then its k and v): a column split keeps whole
    # heads and groups. Their ALiBi biases come from outside the attention, one per head of
    # all ranks (Note [Head-indexed inputs]).
    "bloom": {
        **_attention("h.*.self_attention", "dense", ("query_key_value",)),
        "h.*.self_attention": "head_inputs",
        **_mlp(("h.*.mlp.dense_h_to_4h",), "h.*.mlp.dense_4h_to_h"),
    },
    "falcon": {
        **_attention("h.*.self_attention", "dense", ("query_key_value",)),
        "h.*.self_attention": "head_inputs",
        **_mlp(("h.*.mlp.dense_h_to_4h",), "h.*.mlp.dense_4h_to_h"),
    },
    # Fuyu's language model is Persimmon's
    "fuyu": {f"language_model.{k}": v for k, v in _PERSIMMON.items()},
    "mvp": _bart_like_decoder(),
    "xglm": {
        **_attention("layers.*.self_attn", "out_proj"),
        **_mlp(("layers.*.fc1",), "layers.*.fc2"),
    },
    "ctrl": {
        **_attention("h.*.multi_head_attention", "dense", ("Wq", "Wk", "Wv")),
        **_mlp(("h.*.ffn.0",), "h.*.ffn.2"),
    },
    # c_attn is head-major ([q, k, v] per head) without multi-query attention; with it (the
    # default, StarCoder's), see _VARIANTS
    "gpt_bigcode": {
        "h.*.attn.c_attn": "colwise",
        "h.*.attn.c_proj": "rowwise",
        **_mlp(("h.*.mlp.c_fc",), "h.*.mlp.c_proj"),
    },
    # Wqkv is [q | k | v]: each rank computes its part of every block (Note [Fused
    # projections computed by rows]); ALiBi from outside the attention (Note [Head-indexed
    # inputs])
    "mpt": {
        "blocks.*.attn.Wqkv": "packed_colwise",
        "blocks.*.attn.out_proj": "rowwise",
        "blocks.*.attn": "head_inputs",
        **_mlp(("blocks.*.ffn.up_proj",), "blocks.*.ffn.down_proj"),
    },
    # Wi packs [input | gate]: each rank computes its part of both (Note [Fused projections
    # computed by rows])
    "modernbert-decoder": {
        **_attention("layers.*.attn", "Wo"),
        **_mlp(("layers.*.mlp.Wi",), "layers.*.mlp.Wo"),
        "layers.*.mlp.Wi": "packed_colwise",
    },
    "gpt_neo": {
        **_attention("h.*.attn.attention", "out_proj"),
        **_mlp(("h.*.mlp.c_fc",), "h.*.mlp.c_proj"),
    },
    # its relative-position biases are built outside the attention, one per head of all
    # ranks, by a learned table each rank then uses its heads' columns of (gradients summed)
    "cpmant": {
        "position_bias": "replicated_with_grad_allreduce",
        **_attention(
            "encoder.layers.*.self_att.self_attention",
            "attention_out",
            ("project_q", "project_k", "project_v"),
        ),
        "encoder.layers.*.self_att.self_attention": "head_inputs",
        **_mlp(
            ("encoder.layers.*.ffn.ffn.w_in.w_0", "encoder.layers.*.ffn.ffn.w_in.w_1"),
            "encoder.layers.*.ffn.ffn.w_out",
        ),
    },
    # GIT's text decoder is BERT's encoder stack (its image tower stays whole)
    "git": _bert_like(),
    "dbrx": {
        "blocks.*.norm_attn_norm.attn.Wqkv": "packed_colwise",
        "blocks.*.norm_attn_norm.attn.out_proj": "rowwise",
        "blocks.*.ffn.experts": "moe_tp_experts",
    },
    # MllamaForCausalLM, Llama 3.2 Vision's text model; its cross-attention layers: _VARIANTS
    "mllama_text_model": {
        **_attention("layers.*.self_attn", "o_proj"),
        **_mlp(("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"), "layers.*.mlp.down_proj"),
    },
}


#: model_type -> attention attributes holding all heads' width that the family reshapes by,
#: each with its one-head size attribute (``ModelPolicy.width_attrs``), beyond the generic
#: ``module_layout.FULL_WIDTH_ATTRS``: names that mean this only in these families.
_WIDTH_ATTRS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "xglm": (("embed_dim", "head_dim"),),
    "dbrx": (("hidden_size", "head_dim"),),
    "mvp": (("embed_dim", "head_dim"),),
    "ctrl": (("d_model_size", "depth"),),
    "gpt_bigcode": (("embed_dim", "head_dim"),),  # the query block's width in c_attn's output
    "openai-gpt": (("split_size", None),),  # c_attn's block width; no head size kept
}


#: model_type -> the config attribute of the decoder's head count, for sequence-to-sequence
#: families whose ``num_attention_heads`` is the encoder's (their ``*ForCausalLM`` is the
#: decoder; its attention is multi-head).
_HEADS_ATTRS = {f: "decoder_attention_heads" for f in (*_BART_LIKE, "mvp")}


def heads_attr(model_type: str) -> str | None:
    """The config attribute of the planned stack's head count, where not ``num_attention_heads``.

    Args:
        model_type: The family (``config.model_type``).

    Returns:
        The attribute (``ModelPolicy.num_heads_attr``), or ``None``.
    """
    return _HEADS_ATTRS.get(model_type)


def width_attrs(model_type: str) -> tuple[tuple[str, str | None], ...]:
    """The full-width attention attributes the shipped plan of ``model_type`` scales.

    Args:
        model_type: The family (``config.model_type``).

    Returns:
        ``(width attribute, head size attribute)`` pairs (``ModelPolicy.width_attrs``).
    """
    return _WIDTH_ATTRS.get(model_type, ())


def _falcon_layout(config: Any, tp_degree: int) -> str:
    # Falcon's attention has num_kv_heads key/value heads (groups), or one with multi_query
    # (Falcon-7B's layout); transformers 5.25 also derives num_key_value_heads from them, and
    # its attention repeats the key/value heads by the ratio. A config that states another
    # count (given explicitly, over transformers' own) would have the heads split by it.
    grouped = getattr(config, "new_decoder_architecture", False) or not getattr(
        config, "multi_query", True
    )
    heads = int(getattr(config, "num_kv_heads", 0) or 0) if grouped else 1
    stated = getattr(config, "num_key_value_heads", None)
    if heads and stated is not None and stated != heads:
        return (
            f"num_key_value_heads={stated} contradicts the {heads} key/value head(s) its "
            "attention has (num_kv_heads, multi_query, new_decoder_architecture); set "
            f"num_key_value_heads={heads}"
        )
    if getattr(config, "new_decoder_architecture", False):
        kv = int(getattr(config, "num_kv_heads", 0) or 0)
        if kv % tp_degree:
            return (
                f"its query_key_value packs {kv} key/value head groups (num_kv_heads), which "
                f"do not divide over tensor_parallel_degree {tp_degree}; choose a degree that "
                f"divides {kv}"
            )
    return ""


def _bloom_layout(config: Any, tp_degree: int) -> str:
    if int(getattr(config, "pretraining_tp", 1) or 1) > 1 and getattr(
        config, "slow_but_exact", False
    ):
        return (
            "slow_but_exact=True with pretraining_tp > 1 slices the projections' weights by "
            "the full hidden width inside the model's code; set slow_but_exact=False"
        )
    return ""


def _big_bird_layout(config: Any, tp_degree: int) -> str:
    # BigBirdModel replaces each layer's attention module at forward time when it leaves
    # block_sparse (a sequence too short for its blocks, or a cache): the new module keeps the
    # split projections but counts every head, and the first forward fails on a reshape.
    # block_sparse itself draws its random blocks per head from the head count, so a rank's
    # heads would not attend as the same heads of the whole model do.
    if getattr(config, "attention_type", "original_full") != "original_full":
        return (
            f"attention_type={config.attention_type!r} swaps in a new attention module at "
            "forward time that counts every head (and draws block_sparse's random blocks per "
            "head count); set config.attention_type='original_full' before building the model"
        )
    return ""


def _gemma4_layout(config: Any, tp_degree: int) -> str:
    # Note [Gemma 4's per-layer embeddings]: with per-layer embeddings (the E2B and E4B
    # models), Gemma4Model.forward reads the row of pad_token_id straight from the text
    # embedding's weight, outside the embedding's forward, and mixes it with plain
    # activations. Under TP that weight is a DTensor (split by vocabulary, as the tied
    # lm_head is): PyTorch all-gathers the whole table for the one row, then refuses the mix
    # ("mixed torch.Tensor and DTensor"), mid-forward. The row is read on every call (it
    # stands in for image, video and audio tokens), so only a change to transformers' line
    # could avoid it. Without per-layer embeddings the family passed parity at TP 2 (the coverage
    # tool's tiny config with hidden_size_per_layer_input=0, run once). The text model
    # (gemma4_text, not refused) reads the same weight only when called with inputs_embeds
    # and no input_ids, to recover the ids: such a call fails under TP the same way.
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_layer = getattr(text, "hidden_size_per_layer_input", 0) or 0
    if per_layer:
        return (
            f"text_config.hidden_size_per_layer_input={per_layer} (per-layer embeddings) makes "
            "Gemma4Model.forward read a row of the text embedding's weight directly, outside "
            "the embedding's forward, where tensor parallelism holds that weight as a DTensor; "
            "use tensor_parallel_degree=1 (FSDP still shards it), or tensor parallelism on "
            "its text model alone (Gemma4ForCausalLM, called with input_ids)"
        )
    return ""


#: model_type -> why a config's layout cannot take the family's plan ("" when it can): the
#: plan torch_sagemaker ships, or, for Gemma 4, transformers' own.
_LAYOUT_CHECKS: dict[str, Callable[[Any, int], str]] = {
    "falcon": _falcon_layout,
    "bloom": _bloom_layout,
    "big_bird": _big_bird_layout,
    "gemma4": _gemma4_layout,
}


def layout_check(model_type: str) -> Callable[[Any, int], str] | None:
    """The check of a config's layout against the TP plan of ``model_type``, if any.

    Args:
        model_type: The family (``config.model_type``).

    Returns:
        ``(config, tp_degree) -> reason`` (``ModelPolicy.layout_check``): why the plan cannot
        split that config's model, naming the attribute and what is supported; ``""`` where
        it can. ``None`` for families whose plan fits every config.
    """
    return _LAYOUT_CHECKS.get(model_type)


# Note [Additions to transformers' plans]: some of transformers' own plans leave out a module
# with parameters that computes on split activations: Apertus's xIELU activation (two
# learned scalars, applied to this rank's MLP columns), SarvamMoE's per-head query and key
# norms, and GLM-4-MoE's (with ``use_qk_norm``, as GLM-4.5 sets it; Param2MoE, built on it,
# sets it by default). ``tsm.transform`` refuses such a plan (Note [Replicated module
# check]): replicated as the plan implies, each rank would train its copy on its own part of
# the gradient. For these families the missing entries are added, summing those gradients
# over the ranks (``replicated_with_grad_allreduce``), but only to a plan that keeps every
# entry transformers gives the model: a plan that changes one is taken as written (it may
# gather those activations, where summing would count the gradient once per rank). An entry
# that names no module of the model (GLM-4-MoE without ``use_qk_norm``) is not added.
#: model_type -> entries added to transformers' own plan (keyed like ``base_model_tp_plan``).
PLAN_ADDITIONS: dict[str, dict[str, str]] = {
    "apertus": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
    "apertus1p5_text": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
    **{
        family: {
            "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        }
        for family in ("sarvam_moe", "glm4_moe", "param2moe")
    },
}


#: Families whose experts' forward indexes every expert it is given, the sentinel of other
#: ranks' experts included (Note [Experts that run every index] in
#: ``tensor_parallel/styles.py``): transformers 5.24's DBRX.
_EXPERTS_WITHOUT_SENTINEL = frozenset({"dbrx"})


def experts_without_sentinel(model_type: str) -> bool:
    """Whether the experts of ``model_type`` must see only this rank's choices.

    Args:
        model_type: The family (``config.model_type``).
    """
    return model_type in _EXPERTS_WITHOUT_SENTINEL


def plan_additions(model_type: str) -> dict[str, str]:
    """Entries added to transformers' own plan of ``model_type``, or ``{}``.

    Note [Additions to transformers' plans]; keyed below the base model.

    Args:
        model_type: The family (``config.model_type``).
    """
    return dict(PLAN_ADDITIONS.get(model_type, {}))


def _multi_query(config: Any) -> bool:
    """One key/value head shared by every query head, in Falcon's and GPT-BigCode's configs."""
    return bool(getattr(config, "multi_query", False)) and not getattr(
        config, "new_decoder_architecture", False
    )


def _shared_kv(key: str) -> Callable[[Any], dict[str, str]]:
    """The entry of ``key`` under multi-query attention, where the config has it.

    The fused projection then holds one key and one value head after all the query heads
    (Note [Fused projections computed by rows]).
    """
    return lambda config: {key: "shared_kv_colwise"} if _multi_query(config) else {}


def _mllama_cross_layers(config: Any) -> dict[str, str]:
    """Mllama's cross-attention layers, where the config places some among its layers.

    Their attention is split like self-attention (keys and values of the image states,
    which every rank holds whole); the per-head q/k norms' weights are shared by the
    heads; the layer's own tanh gates scale the all-reduced outputs (``local_params`` on
    those layers only, by number). A text-only forward skips these layers.
    """
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    cross = [i for i in getattr(config, "cross_attention_layers", None) or () if i < layers]
    if not cross:
        return {}
    return {
        **_attention("layers.*.cross_attn", "o_proj"),
        "layers.*.cross_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.cross_attn.k_norm": "replicated_with_grad_allreduce",
        **{f"layers.{i}": "local_params" for i in cross},
    }


def _dbrx_multi_query(config: Any) -> dict[str, str]:
    """DBRX's ``Wqkv`` with one key/value head (``attn_config.kv_n_heads=1``, the default).

    It is then ``[q | k | v]`` with one key and one value head shared by every query head.
    """
    # (attn_config's count is what the attention modules are built with)
    if int(getattr(getattr(config, "attn_config", None), "kv_n_heads", 0) or 0) != 1:
        return {}
    return {"blocks.*.norm_attn_norm.attn.Wqkv": "shared_kv_colwise"}


#: model_type -> the entries a config changes or adds to the family's plan.
_VARIANTS: dict[str, Callable[[Any], dict[str, str]]] = {
    "dbrx": _dbrx_multi_query,
    "falcon": _shared_kv("h.*.self_attention.query_key_value"),
    "gpt_bigcode": _shared_kv("h.*.attn.c_attn"),
    "mllama_text_model": _mllama_cross_layers,
}


def shipped_plan(model_type: str, config: Any = None) -> dict[str, str]:
    """The plan shipped for the family ``model_type``, keyed below the base model, or ``{}``.

    Args:
        model_type: The family (``config.model_type``).
        config: The model's config, where the family's variants differ (Falcon's,
            GPT-BigCode's and DBRX's multi-query attention); ``None``: the family's default
            layout.

    Returns:
        The plan in transformers' terms (as ``config.base_model_tp_plan`` keys it).
    """
    plan = dict(SHIPPED_PLANS.get(model_type, {}))
    variant = _VARIANTS.get(model_type)
    if plan and variant is not None and config is not None:
        plan.update(variant(config))
    return plan


__all__ = [
    "PLAN_ADDITIONS",
    "SHIPPED_PLANS",
    "experts_without_sentinel",
    "heads_attr",
    "layout_check",
    "plan_additions",
    "shipped_plan",
    "width_attrs",
]
