"""Plans shipped for families whose transformers plan is empty or partial (no processes).

``policies/shipped_plans`` gives OPT, GPT-2, OpenAI GPT, Fuyu, BLOOM, Falcon, Mllama and
CPM-Ant their entries; these tests check the entries each family gets, the layouts a
config's fused projections must have, and that a plan the user sets wins.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_transformers_plan import OPT_PLAN, meta
from torch_sagemaker.policies import STYLES, check_model, lookup_policy
from torch_sagemaker.policies.transformers_plan import policy_from_plan


def test_a_family_transformers_ships_no_plan_for_gets_the_shipped_one():
    """OPT: transformers' plan is empty, so ``shipped_plans`` gives it one (names from the
    model root, the tied input embedding split with the head); a plan the user sets wins."""
    model = meta("OPTConfig", word_embed_proj_dim=64, ffn_dim=128)
    assert not model.tp_plan
    policy = lookup_policy(model)
    assert policy.name == "opt (shipped plan)", policy.name
    layer = "model.decoder.layers.*"
    assert policy.tp_plan[f"{layer}.self_attn.q_proj"] == "colwise"
    assert policy.tp_plan[f"{layer}.self_attn.out_proj"] == "rowwise_allreduce"
    assert policy.tp_plan[f"{layer}.fc1"] == "colwise"
    assert policy.tp_plan["model.decoder.embed_tokens"] == "vocab_embedding_allreduce"
    assert policy.tp_plan["lm_head"] == "lm_head"  # OPT's loss goes through loss_function
    assert policy.heads_split

    mine = meta("OPTConfig", word_embed_proj_dim=64, ffn_dim=128)
    mine.tp_plan = {k: v for k, v in OPT_PLAN.items() if "fc" not in k}  # the MLP left whole
    policy = lookup_policy(mine)
    assert policy.name == "opt (transformers plan)"
    assert policy.tp_plan[f"{layer}.fc1"] == "replicate_local", policy.tp_plan

    head_only = meta("OPTConfig", word_embed_proj_dim=64, ffn_dim=128)
    head_only.tp_plan = {"lm_head": "colwise_gather_output"}  # the user's, layers whole
    policy = lookup_policy(head_only)
    assert policy.name == "opt (transformers plan)" and not policy.heads_split
    assert not {"colwise", "kv_colwise"} & set(policy.tp_plan.values()), policy.tp_plan


def _gpt2(**overrides):
    import transformers

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, **overrides)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def test_gpt2s_conv1d_projections_get_the_conv1d_styles():
    """GPT-2 (and GPT-SW3, the same classes): its shipped plan on transformers' Conv1D, the
    packed [q | k | v] projection split block by block, the tied embeddings by vocabulary."""
    policy = lookup_policy(_gpt2())
    assert policy.name == "gpt2 (shipped plan)", policy.name
    layer = "transformer.h.*"
    assert policy.tp_plan[f"{layer}.attn.c_attn"] == "conv1d_packed_colwise"
    assert policy.tp_plan[f"{layer}.attn.c_proj"] == "conv1d_rowwise_allreduce"
    assert policy.tp_plan[f"{layer}.mlp.c_fc"] == "conv1d_colwise"
    assert policy.tp_plan[f"{layer}.mlp.c_proj"] == "conv1d_rowwise_allreduce"
    assert policy.tp_plan["transformer.wte"] == "vocab_embedding_allreduce"
    assert policy.tp_plan["lm_head"] == "lm_head"
    assert policy.tp_plan["transformer.wpe"] == "replicate_local"
    assert policy.heads_split and policy.layer_class == "GPT2Block"
    assert {s for s in policy.tp_plan.values()} <= set(STYLES)


def test_a_conv1d_under_a_linear_only_style_is_refused_naming_its_styles():
    model = _gpt2()
    model.tp_plan = {"transformer.h.*.mlp.c_fc": "colwise_gather_output"}
    with pytest.raises(ValueError, match=r"c_fc \(Conv1D\).*nn.Linear.*'packed_colwise'"):
        policy_from_plan(model)


def test_a_packed_conv1d_not_made_of_head_blocks_is_refused():
    """A user plan calling GPT-2's cross-attention query (one head-width block) packed."""
    model = _gpt2(add_cross_attention=True)
    model.tp_plan = {"transformer.h.*.crossattention.q_attn": "packed_colwise"}
    with pytest.raises(ValueError, match=r"q_attn.*'packed_colwise'.*not a whole number"):
        policy_from_plan(model)


def _openai_gpt():
    import transformers

    config = transformers.OpenAIGPTConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    with torch.device("meta"):
        return transformers.OpenAIGPTLMHeadModel(config)


def test_a_packed_conv1d_whose_attention_cannot_scale_its_split_width_is_refused():
    """OpenAI-GPT splits its packed output by ``split_size`` with no ``head_dim`` beside it:
    under a user's plan, which says nothing of that width, each rank would cut its part at
    the whole width (a shape error on the first forward)."""
    model = _openai_gpt()
    model.tp_plan = {"transformer.h.*.attn.c_attn": "packed_colwise"}
    with pytest.raises(ValueError, match=r"c_attn.*'split_size' \(64\) without a 'head_dim'"):
        policy_from_plan(model)


def test_openai_gpts_shipped_plan_scales_its_split_width_by_the_share_of_heads():
    """Its shipped plan names ``split_size`` as a width with no head size (``width_attrs``),
    which ``tsm.transform`` scales by the rank's share of the heads (the 4-rank parity run:
    tests/distributed/test_model_coverage.py)."""
    from torch_sagemaker.policies import HeadSplit
    from torch_sagemaker.tensor_parallel.plan import _set_head_counts

    model = _openai_gpt()
    policy = lookup_policy(model)
    assert policy.name == "openai-gpt (shipped plan)", policy.name
    assert policy.tp_plan["transformer.h.*.attn.c_attn"] == "conv1d_packed_colwise"
    assert policy.width_attrs == (("split_size", None),)
    attention = model.transformer.h[0].attn
    heads = HeadSplit(
        num_heads=4, num_kv_heads=4, tp=2, local_heads=2, local_kv_heads=2, kv_replicated=False
    )
    _set_head_counts(attention, heads, policy.width_attrs)
    assert (attention.n_head, attention.split_size) == (2, 32)
    # a width both the generic pairs and a family's name is scaled once (GPT-2's split_size)
    gpt2_attention = _gpt2().transformer.h[0].attn
    _set_head_counts(gpt2_attention, heads, (("split_size", None),))
    assert gpt2_attention.split_size == 32


def test_a_shipped_plan_that_names_no_module_of_the_model_is_not_used():
    """A compiled Persimmon holds its modules under ``_orig_mod``: Persimmon's shipped plan
    would split nothing there, so the model is refused rather than left whole."""
    from tools.model_coverage.tiny import build

    compiled = torch.compile(build("persimmon", device="meta"))
    assert compiled.config.model_type == "persimmon"
    with pytest.raises(ValueError, match="base_model_tp_plan"):
        lookup_policy(compiled)


def test_fuyus_shipped_plan_is_persimmons_under_its_language_model():
    from tools.model_coverage.tiny import build

    policy = lookup_policy(build("fuyu", device="meta"))
    assert policy.name == "fuyu (shipped plan)", policy.name
    qkv = "model.language_model.layers.*.self_attn.query_key_value"
    assert policy.tp_plan[qkv] == "colwise"
    assert policy.tp_plan["model.vision_embed_tokens"] == "replicate_local", policy.tp_plan


def test_shipped_plans_check_the_fused_layout_of_the_config():
    """BLOOM and Falcon: the plan follows the config's fused layout, and the policy names
    the layouts it cannot split."""
    bloom = lookup_policy(meta("BloomConfig", n_head=4, n_layer=2))
    assert bloom.name == "bloom (shipped plan)"
    assert bloom.tp_plan["transformer.h.*.self_attention"] == "head_inputs"
    check_model(bloom, bloom_config := meta("BloomConfig", n_head=4).config, 2)
    bloom_config.pretraining_tp, bloom_config.slow_but_exact = 2, True
    with pytest.raises(ValueError, match="slow_but_exact"):
        check_model(bloom, bloom_config, 2)

    def falcon(**layout):
        import transformers
        from transformers import AutoModelForCausalLM

        sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        with torch.device("meta"):  # (its config computes head_dim; it takes none)
            return AutoModelForCausalLM.from_config(transformers.FalconConfig(**sizes, **layout))

    grouped = falcon(new_decoder_architecture=True, num_kv_heads=2)
    policy = lookup_policy(grouped)
    # Falcon's own name, or the one transformers 5.25 derives from it (equal here)
    assert policy.num_kv_heads_attr in ("num_kv_heads", "num_key_value_heads")
    assert policy.head_counts(grouped.config) == (4, 2)
    assert check_model(policy, grouped.config, 2).local_kv_heads == 1
    with pytest.raises(ValueError, match="num_kv_heads.*tensor_parallel_degree 4"):
        check_model(policy, grouped.config, 4)  # 2 groups, no replicating packed kv heads
    contradicting = falcon(multi_query=True, new_decoder_architecture=False, num_key_value_heads=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 contradicts the 1 key/value"):
        check_model(lookup_policy(contradicting), contradicting.config, 2)
    seven_b = falcon(multi_query=True, new_decoder_architecture=False)
    plan = lookup_policy(seven_b).tp_plan  # one shared key/value head: split by queries
    assert plan["transformer.h.*.self_attention.query_key_value"] == "shared_kv_colwise"
    assert (
        lookup_policy(grouped).tp_plan["transformer.h.*.self_attention.query_key_value"]
        == "colwise"
    )


def test_mllamas_cross_attention_layers_get_entries_only_where_the_config_has_them():
    """MllamaForCausalLM keeps its text model under ``model`` although its class names
    ``language_model`` as the base model; its cross-attention layers (by number) own the
    tanh gates that scale their all-reduced outputs (the 4-rank parity run with image
    states: tests/distributed/test_model_coverage.py)."""
    import transformers

    def policy(cross):
        config = transformers.MllamaTextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=cross,
            pad_token_id=0,
        )  # fmt: skip
        with torch.device("meta"):
            return lookup_policy(transformers.MllamaForCausalLM(config))

    with_cross = policy([1, 8])  # (layer 8 is beyond the 3 layers)
    assert with_cross.name == "mllama_text_model (shipped plan)", with_cross.name
    assert with_cross.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert with_cross.tp_plan["model.layers.*.cross_attn.k_proj"] == "kv_colwise"
    assert with_cross.tp_plan["model.layers.*.cross_attn.q_norm"] == "replicate_partial_grad"
    assert with_cross.tp_plan["model.layers.1"] == "local_params"
    assert "model.layers.8" not in with_cross.tp_plan
    text_only = policy([8])
    assert not any("cross_attn" in k for k in text_only.tp_plan), text_only.tp_plan


def test_cpmants_shipped_plan_cuts_its_biases_and_sums_their_tables_gradient():
    """Its per-head biases come from a learned table outside the attention (parity on 4
    ranks: docs/model_coverage.md; the cut itself: tests/unit/test_head_inputs.py)."""
    from tools.model_coverage.tiny import build

    policy = lookup_policy(build("cpmant", device="meta"))
    assert policy.name == "cpmant (shipped plan)"
    attention = "cpmant.encoder.layers.*.self_att.self_attention"
    assert policy.tp_plan[attention] == "head_inputs"
    assert policy.tp_plan[f"{attention}.project_q"] == "colwise"
    assert policy.tp_plan["cpmant.position_bias"] == "replicate_partial_grad"
