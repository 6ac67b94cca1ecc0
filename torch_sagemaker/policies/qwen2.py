"""Qwen2 (``Qwen2ForCausalLM``): Llama's layout with biases on q/k/v.

Column-parallel projections split their bias with their output features, so the Llama
plan applies unchanged; small Qwen2 models tie the LM head to the embedding, which both
shard over the vocabulary (the tie is kept).
"""

from __future__ import annotations

from torch_sagemaker.policies.llama import LLAMA_ACTIVATIONS, LLAMA_SPLIT_SIZES, llama_style_plan
from torch_sagemaker.policies.model_policy import ModelPolicy

QWEN2 = ModelPolicy(
    name="qwen2",
    model_classes=("Qwen2ForCausalLM",),
    layer_class="Qwen2DecoderLayer",
    attention="model.layers.*.self_attn",
    tp_plan=llama_style_plan(),
    sliding_window_attr="sliding_window",
    tp_split_sizes=LLAMA_SPLIT_SIZES,
    activations=LLAMA_ACTIVATIONS,
    notes="q/k/v biases split with their heads; tied embeddings stay tied.",
)
