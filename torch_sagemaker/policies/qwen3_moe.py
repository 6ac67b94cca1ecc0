"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norms) and sparse MoE blocks.

The experts are fused like Mixtral's; the router renormalizes the top-k weights when
``norm_topk_prob``; there is no shared expert. Layers in ``mlp_only_layers`` are dense.
No tensor parallel plan of its own: tensor parallelism takes the model's transformers plan
(``registry.lookup_policy``).
"""

from __future__ import annotations

from torch_sagemaker.policies.model_policy import ModelPolicy, MoESpec

QWEN3_MOE = ModelPolicy(
    name="qwen3_moe",
    model_classes=("Qwen3MoeForCausalLM",),
    layer_class="Qwen3MoeDecoderLayer",
    attention="model.layers.*.self_attn",
    tp_plan={},
    num_experts_attr="num_experts",
    moe=MoESpec(block_class="Qwen3MoeSparseMoeBlock", normalize_top_k="norm_topk_prob"),
    notes="Experts described for expert parallelism and MoELayer.",
)
