"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention, sparse MoE blocks with a shared expert.

Transformers 5 fuses the routed experts like Mixtral's (``mlp.experts.gate_up_proj``
(E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)); the router ``mlp.gate`` softmaxes over all
experts and renormalizes the top-k weights only when ``norm_topk_prob``. Every block also
runs ``mlp.shared_expert`` (a dense MLP) scaled by ``sigmoid(mlp.shared_expert_gate(x))``;
layers listed in ``mlp_only_layers`` (or off ``decoder_sparse_step``) are dense MLPs and
stay untouched. The policy describes the experts for expert parallelism and ``MoELayer``;
it has no tensor parallel plan of its own, so tensor parallelism takes the model's
transformers plan (``registry.lookup_policy``: whole experts split over the TP ranks,
attention and shared expert split as the plan says).
"""

from __future__ import annotations

from torch_sagemaker.policies.model_policy import ModelPolicy, MoESpec

QWEN2_MOE = ModelPolicy(
    name="qwen2_moe",
    model_classes=("Qwen2MoeForCausalLM",),
    layer_class="Qwen2MoeDecoderLayer",
    attention="model.layers.*.self_attn",
    tp_plan={},
    num_experts_attr="num_experts",
    moe=MoESpec(
        block_class="Qwen2MoeSparseMoeBlock",
        normalize_top_k="norm_topk_prob",
        shared_expert="shared_expert",
        shared_expert_gate="shared_expert_gate",
    ),
    notes="Expert parallelism with the shared expert kept on every rank.",
)
