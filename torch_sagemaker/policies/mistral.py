"""Mistral (``MistralForCausalLM``): Llama's layout plus sliding-window attention.

The sliding window lives in the attention mask, which every rank builds for the full
sequence, so the Llama plan applies unchanged.
"""

from __future__ import annotations

from torch_sagemaker.policies.llama import LLAMA_ACTIVATIONS, LLAMA_SPLIT_SIZES, llama_style_plan
from torch_sagemaker.policies.model_policy import ModelPolicy

MISTRAL = ModelPolicy(
    name="mistral",
    model_classes=("MistralForCausalLM",),
    layer_class="MistralDecoderLayer",
    attention="model.layers.*.self_attn",
    tp_plan=llama_style_plan(),
    sliding_window_attr="sliding_window",
    tp_split_sizes=LLAMA_SPLIT_SIZES,
    activations=LLAMA_ACTIVATIONS,
    notes="Sliding window handled by the (unsharded) attention mask.",
)
