"""Which models context parallelism refuses at transform time (Note [Context parallel sequence
mixers]): hybrid, linear-attention, sparse-attention and chunked-attention families, on their
config and on their modules; and none of the families it runs exactly.

Tiny models on the meta device (``tools/model_coverage/tiny.py``): nothing is computed.
"""

from __future__ import annotations

import pytest

from torch_sagemaker.context_parallel import prepare
from torch_sagemaker.context_parallel.prepare import (
    check_config_supported,
    check_supported,
    unsupported_mixers,
)
from torch_sagemaker.policies import lookup_policy


def _meta(family: str):
    from tools.model_coverage.tiny import build

    model = build(family, device="meta")
    return model, lookup_policy(model)


#: family -> (what the config check names, a module the module check names, its kind).
REFUSED = {
    "lfm2_moe": ("'conv'", "model.layers.0.conv", "convolution over the sequence"),
    "falcon_h1": ("'hybrid'", "model.layers.0.mamba", "convolution over the sequence"),
    "nemotron_h": ("'linear_attention'", "model.layers.0.mixer", "convolution over the sequence"),
    "olmo_hybrid": ("'linear_attention'", "model.layers.0.linear_attn", "convolution"),
    "qwen3_next": ("'linear_attention'", "model.layers.0.linear_attn", "convolution"),
    "minimax": ("'linear_attention'", "model.layers.1.self_attn", "AttentionInterface"),
    "kimi_linear": ("'linear_attention'", "model.layers.0.self_attn", "AttentionInterface"),
    "bailing_hybrid": ("'linear_attention'", "model.layers.0.self_attn", "AttentionInterface"),
    "deepseek_v32": ("'indexed_attention'", "model.layers.0.self_attn", "indexer"),
    "glm_moe_dsa": ("'indexed_attention'", "model.layers.0.self_attn", "indexer"),
    "axk2": ("'indexed_attention'", "model.layers.0.self_attn", "indexer"),
    "hy_v4": ("'indexed_attention'", "model.layers.0.self_attn", "indexer"),
    "llama4_text": ("'chunked_attention'", None, None),
}

#: Families whose layers mix positions in softmax attention alone (most of them matched one
#: process under cp 2 in an audit; sliding windows are set to None here).
EXACT = (
    "llama", "gpt_neox", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "aria_text",
    "axk1", "deepseek_v2", "deepseek_v3", "diffllama", "flex_olmo", "glm4_moe", "glm4_moe_lite",
    "gptj", "granitemoe", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
    "jais2", "minicpm3", "ministral3", "nanochat", "olmoe", "phimoe", "sarvam_mla",
    "solar_open", "youtu", "lfm2", "smollm3", "minimax_m2", "minimax_m3_vl_text",
    "gemma", "olmo2", "phi3", "starcoder2", "granite", "ernie4_5_moe",
)  # fmt: skip


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_config_check_refuses_non_attention_sequence_mixers(family):
    model, policy = _meta(family)
    name = type(model).__name__
    with pytest.raises(ValueError) as e:
        check_config_supported(model.config, policy, name)
    message = str(e.value)
    assert name in message and REFUSED[family][0] in message, message
    assert "context_parallel_degree=1" in message, message


@pytest.mark.parametrize("family", sorted(f for f, (_, m, _) in REFUSED.items() if m))
def test_module_check_refuses_them_without_the_config(family, monkeypatch):
    """A config that described its layers as plain attention would still be refused."""
    model, policy = _meta(family)
    _, module, kind = REFUSED[family]
    found = {n: why for n, _, why in unsupported_mixers(model, policy)}
    assert module in found and kind in found[module], found
    monkeypatch.setattr(prepare, "check_config_supported", lambda *args: None)
    with pytest.raises(ValueError) as e:
        check_supported(model, policy)
    message = str(e.value)
    assert f"{type(model).__name__} is not supported" in message and module in message, message
    assert "context_parallel_degree=1" in message, message


def test_hybrid_mlp_matched_by_the_attention_pattern_is_not_named():
    """nemotron_h's policy matches every layer's ``mixer``: only the Mamba mixer mixes positions."""
    model, policy = _meta("nemotron_h")
    assert [(n, k) for n, k, _ in unsupported_mixers(model, policy)] == [
        ("model.layers.0.mixer", "NemotronHMamba2Mixer")
    ]


@pytest.mark.parametrize("family", EXACT)
def test_families_context_parallelism_runs_exactly_pass_both_checks(family):
    model, policy = _meta(family)
    config = model.config
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    check_supported(model, policy)
    assert unsupported_mixers(model, policy) == []
