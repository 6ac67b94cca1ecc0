"""Mixtral (``MixtralForCausalLM``): Llama attention plus a sparse mixture of experts.

Transformers 5 stores the experts of a layer as two fused 3-D parameters,
``mlp.experts.gate_up_proj`` (experts, 2 * intermediate, hidden; gate rows then up rows) and
``mlp.experts.down_proj`` (experts, hidden, intermediate). Splitting the intermediate
dimension would cut the fused gate/up rows in two different places, so the experts are
split along the expert dimension instead: each TP rank holds ``num_local_experts / tp``
whole experts, runs them for all tokens routed to them, and the partial outputs are
summed and reduce-scattered over the sequence (``reduce_scatter_output`` on the MoE block).
The router is small and replicated.

Expert parallelism (``tsm.transform(model, config=MoEConfig(...))``) splits the same fused
tensors over the EP ranks instead; ``moe`` says where they are.
"""

from __future__ import annotations

from torch_sagemaker.policies.activations import (
    GROUPED_EXPERTS,
    LLAMA_ATTENTION,
    LLAMA_ATTENTION_MASKED,
    LLAMA_FINAL,
    LLAMA_MLP,
    NORM_OUTPUT,
    RMS_NORM,
    TOPK_ROUTER,
)
from torch_sagemaker.policies.llama import llama_style_plan
from torch_sagemaker.policies.model_policy import ActivationProfile, ModelPolicy, MoESpec

MIXTRAL = ModelPolicy(
    name="mixtral",
    model_classes=("MixtralForCausalLM",),
    layer_class="MixtralDecoderLayer",
    attention="model.layers.*.self_attn",
    tp_plan={
        **llama_style_plan(mlp=False),
        "model.layers.*.mlp": "reduce_scatter_output",
        "model.layers.*.mlp.gate": "router",
        "model.layers.*.mlp.experts": "experts",
    },
    num_experts_attr="num_local_experts",
    moe=MoESpec(block_class="MixtralSparseMoeBlock", jitter_attr="jitter_noise"),
    sliding_window_attr="sliding_window",
    activations=ActivationProfile(
        attention=LLAMA_ATTENTION,
        mlp=LLAMA_MLP,
        moe=RMS_NORM + NORM_OUTPUT + TOPK_ROUTER + GROUPED_EXPERTS,
        final=LLAMA_FINAL,
        masked_attention=LLAMA_ATTENTION_MASKED,
    ),
    notes="Experts split whole over the TP ranks (degree must divide num_local_experts).",
)
