"""Llama 2 and Llama 3 (``LlamaForCausalLM``): grouped-query attention, RoPE scaling, tied heads.

The plan is Megatron's: q/k/v and gate/up projections split by output features (whole heads
per rank), o and down projections by input features, vocabulary-parallel embedding and LM
head, and sequence parallelism for the norms between the parallel regions. RoPE (any
``rope_scaling``) is computed per position and needs no change. Key/value projections use
``kv_colwise`` so that models with fewer kv heads than the degree replicate them.
"""

from __future__ import annotations

from torch_sagemaker.policies.activations import (
    LLAMA_ATTENTION,
    LLAMA_ATTENTION_MASKED,
    LLAMA_FINAL,
    LLAMA_MLP,
)
from torch_sagemaker.policies.model_policy import ActivationProfile, ModelPolicy


def llama_style_plan(base: str = "model", mlp: bool = True) -> dict[str, str]:
    """The TP plan of a Llama-shaped decoder (shared by Mistral, Qwen2 and Mixtral).

    Args:
        base: Name of the decoder stack inside the causal-LM module.
        mlp: Whether to include the dense gate/up/down MLP (False for MoE models).

    Returns:
        Module-name pattern -> style name.
    """
    layer = f"{base}.layers.*"
    plan = {
        f"{base}.embed_tokens": "vocab_embedding",
        f"{layer}.input_layernorm": "sequence_parallel_norm",
        f"{layer}.self_attn.q_proj": "colwise",
        f"{layer}.self_attn.k_proj": "kv_colwise",
        f"{layer}.self_attn.v_proj": "kv_colwise",
        f"{layer}.self_attn.o_proj": "rowwise",
        f"{layer}.post_attention_layernorm": "sequence_parallel_norm",
        f"{base}.norm": "sequence_parallel_norm",
        "lm_head": "lm_head",
    }
    if mlp:
        plan.update(
            {
                f"{layer}.mlp.gate_proj": "colwise",
                f"{layer}.mlp.up_proj": "colwise",
                f"{layer}.mlp.down_proj": "rowwise",
            }
        )
    return plan


#: What the Llama-style plan splits besides the heads (MLP columns), for ``check_model``.
LLAMA_SPLIT_SIZES = {"intermediate_size": "the MLP's columns (gate/up colwise, down rowwise)"}

#: What a Llama-shaped decoder saves for backward (shared by Mistral and Qwen2, whose layers
#: are Llama's with other defaults; q/k/v biases save nothing more). Their sliding windows
#: (Mistral; Qwen2 with ``use_sliding_window``) make the attention save a mask and repeated
#: key/value heads (Note [Masked attention saves more]).
LLAMA_ACTIVATIONS = ActivationProfile(
    attention=LLAMA_ATTENTION,
    mlp=LLAMA_MLP,
    final=LLAMA_FINAL,
    masked_attention=LLAMA_ATTENTION_MASKED,
)

LLAMA = ModelPolicy(
    name="llama",
    model_classes=("LlamaForCausalLM",),
    layer_class="LlamaDecoderLayer",
    attention="model.layers.*.self_attn",
    tp_plan=llama_style_plan(),
    tp_split_sizes=LLAMA_SPLIT_SIZES,
    activations=LLAMA_ACTIVATIONS,
    notes="Llama 2/3/3.1 (GQA, rope scaling); kv heads fewer than the degree are replicated.",
)
