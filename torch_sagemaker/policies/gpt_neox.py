"""GPT-NeoX (``GPTNeoXForCausalLM``): fused per-head QKV, LayerNorm, parallel residual, dropout.

``attention.query_key_value`` produces, for each head in turn, that head's q, k and v
(the output is viewed as ``(..., heads, 3 * head_size)``), so splitting its output features
into equal contiguous blocks gives every rank whole heads. The residual-path dropouts
(``emb_dropout``, ``post_attention_dropout``, ``post_mlp_dropout``) act on sequence shards
and draw the unsharded model's mask. Attention is multi-head (no kv-head attribute).
"""

from __future__ import annotations

from torch_sagemaker.policies.activations import (
    LAYER_NORM,
    LAYER_NORM_STATS,
    NORM_OUTPUT,
    PLAIN_MLP,
    SDPA,
)
from torch_sagemaker.policies.model_policy import ActivationProfile, ModelPolicy, Saved

_LAYER = "gpt_neox.layers.*"

# With the parallel residual (the default, ``use_parallel_residual``) both norms read the
# layer's input, saved once (by the attention half); the attention output is copied into the
# dense projection's input.
GPT_NEOX_ACTIVATIONS = ActivationProfile(
    attention=LAYER_NORM + NORM_OUTPUT + SDPA + (Saved("q"),),
    mlp=LAYER_NORM_STATS + NORM_OUTPUT + PLAIN_MLP,
    final=LAYER_NORM + NORM_OUTPUT,
    rotary_fraction_attr="rotary_pct",
)

GPT_NEOX = ModelPolicy(
    name="gpt_neox",
    model_classes=("GPTNeoXForCausalLM",),
    layer_class="GPTNeoXLayer",
    attention=f"{_LAYER}.attention",
    tp_plan={
        "gpt_neox.embed_in": "vocab_embedding",
        "gpt_neox.emb_dropout": "sequence_parallel_dropout",
        f"{_LAYER}.input_layernorm": "sequence_parallel_norm",
        f"{_LAYER}.post_attention_layernorm": "sequence_parallel_norm",
        f"{_LAYER}.attention.query_key_value": "colwise",
        f"{_LAYER}.attention.dense": "rowwise",
        f"{_LAYER}.post_attention_dropout": "sequence_parallel_dropout",
        f"{_LAYER}.mlp.dense_h_to_4h": "colwise",
        f"{_LAYER}.mlp.dense_4h_to_h": "rowwise",
        f"{_LAYER}.post_mlp_dropout": "sequence_parallel_dropout",
        "gpt_neox.final_layer_norm": "sequence_parallel_norm",
        "lm_head": "lm_head",
    },
    num_kv_heads_attr=None,
    tp_split_sizes={
        "intermediate_size": "the MLP's columns (dense_h_to_4h colwise, dense_4h_to_h rowwise)"
    },
    activations=GPT_NEOX_ACTIVATIONS,
    notes="Fused QKV is head-major, so a contiguous split keeps whole heads.",
)
