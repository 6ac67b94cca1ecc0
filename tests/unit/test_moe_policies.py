"""MoE policies describe the real transformers 5 modules (meta models, no processes)."""

import pytest
import torch

from torch_sagemaker.policies import lookup_policy


def _meta(family):
    import transformers as tf
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_experts_per_tok=2,
    )
    cfg = {
        "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=4),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            **common,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        ),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=16),
    }[family]()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_spec_matches_the_model(family):
    model = _meta(family)
    policy = lookup_policy(model)
    spec = policy.moe
    assert policy.name == family and spec is not None
    blocks = [m for m in model.modules() if type(m).__name__ == spec.block_class]
    assert len(blocks) == (1 if family == "qwen2_moe" else 2)  # Qwen2-MoE layer 1 is dense here
    for block in blocks:
        experts = getattr(block, spec.experts)
        assert int(experts.num_experts) == policy.num_experts(model.config) == 4
        assert all(p.shape[0] == 4 for p in experts.parameters(recurse=False))
        assert getattr(block, spec.router).weight.shape == (4, 32)
        assert not list(block.parameters(recurse=False))  # MoELayer adopts children only
        for child in (spec.shared_expert, spec.shared_expert_gate):
            assert child is None or hasattr(block, child)
    assert spec.top_k(model.config) == 2
    # Mixtral always renormalizes; the Qwen models follow norm_topk_prob (default False).
    assert spec.normalize(model.config) is (family == "mixtral")
    if family != "mixtral":
        model.config.norm_topk_prob = True
        assert spec.normalize(model.config) is True


def test_transform_refuses_the_moe_layer_with_context_parallelism():
    """EP x CP is refused by tsm.init; an MoEConfig with cp > 1 (ep 1) by tsm.transform."""
    from torch_sagemaker.moe.apply import check_config
    from torch_sagemaker.moe.moe_config import MoEConfig

    config = MoEConfig()
    assert check_config(config, tp=1, cp=1, ep=1) is config
    with pytest.raises(ValueError, match="context_parallel_degree=2: the MoE layer") as info:
        check_config(config, tp=1, cp=2, ep=1)
    assert "config=None" in str(info.value)
