"""Policies built from transformers' own TP plans (no processes; meta-device models).

The translation of each plan style, the choice between a policy and the plan, the head
bookkeeping it derives, and the errors for entries it cannot honour.
"""

from __future__ import annotations

import pytest
import torch

from torch_sagemaker.moe import apply as moe_apply
from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.policies import STYLES, check_model, lookup_policy
from torch_sagemaker.policies.transformers_plan import PLAN_TP_NOTE, policy_from_plan, wildcard

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def meta(config_name: str, **overrides):
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, config_name)(**{**SIZES, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_wildcard_replaces_layer_numbers_only():
    assert wildcard("model.layers.12.self_attn.q_proj") == "model.layers.*.self_attn.q_proj"
    assert wildcard("h.0.mlp.w2") == "h.*.mlp.w2"
    assert wildcard("model.layers.3") == "model.layers.*"


def test_qwen3_plan_translates_style_by_style():
    policy = lookup_policy(meta("Qwen3Config"))
    assert policy.name == "qwen3 (transformers plan)"
    assert policy.layer_class == "Qwen3DecoderLayer"
    assert policy.attention == ("model.layers.*.self_attn",)
    assert policy.heads_split
    layer = "model.layers.*"
    assert dict(policy.tp_plan) == {
        "model.embed_tokens": "vocab_embedding_allreduce",  # embedding_rowwise
        f"{layer}.self_attn.q_proj": "colwise",
        f"{layer}.self_attn.k_proj": "kv_colwise",  # colwise, num_key_value_heads * head_dim wide
        f"{layer}.self_attn.v_proj": "kv_colwise",
        f"{layer}.self_attn.o_proj": "rowwise_allreduce",  # rowwise
        f"{layer}.self_attn.q_norm": "replicate_partial_grad",  # replicated_with_grad_allreduce
        f"{layer}.self_attn.k_norm": "replicate_partial_grad",
        f"{layer}.mlp.gate_proj": "colwise",
        f"{layer}.mlp.up_proj": "colwise",
        f"{layer}.mlp.down_proj": "rowwise_allreduce",
        "lm_head": "lm_head",  # colwise_gather_output on the output embedding: vocab-parallel
        f"{layer}.input_layernorm": "replicate_local",  # left out of the plan
        f"{layer}.post_attention_layernorm": "replicate_local",
        "model.norm": "replicate_local",
        # modules whose code may read those norms' weights: they see plain values too
        # (concrete names: the pattern model.layers.* would match every module below)
        "model": "local_params",
        "model.layers.0": "local_params",
        "model.layers.1": "local_params",
    }
    assert set(policy.tp_plan.values()) <= set(STYLES)


def test_gathered_projections_do_not_split_heads():
    """Phi-3 gathers its fused qkv: every rank computes every head, so any degree works."""
    policy = lookup_policy(meta("Phi3Config", num_key_value_heads=4))
    assert policy.tp_plan["model.layers.*.self_attn.qkv_proj"] == "colwise_gather"
    assert policy.tp_plan["model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    assert not policy.heads_split
    heads = check_model(policy, meta("Phi3Config", num_key_value_heads=4).config, 8)
    assert (heads.local_heads, heads.local_kv_heads) == (4, 4)  # 8 does not divide 4 heads


def test_whole_head_styles_translate_as_colwise_and_rowwise():
    """transformers 5.25's unit_colwise / unit_rowwise (MiniCPM5-MoE's key and value
    projections): kv_colwise on the key/value projections (replicated below the degree)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **SIZES)
    plan = dict(cfg.base_model_tp_plan)
    for key in ("k_proj", "v_proj", "q_proj"):
        plan[f"layers.*.self_attn.{key}"] = "unit_colwise"
    plan["layers.*.self_attn.o_proj"] = "unit_rowwise"
    cfg.base_model_tp_plan = plan  # (the instance's: transformers 5.24 registers neither)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    styles = lookup_policy(model).tp_plan
    layer = "model.layers.*.self_attn"
    assert styles[f"{layer}.k_proj"] == styles[f"{layer}.v_proj"] == "kv_colwise"
    assert styles[f"{layer}.q_proj"] == "colwise"
    assert styles[f"{layer}.o_proj"] == "rowwise_allreduce"


def test_a_policy_wins_over_the_plan():
    model = meta("LlamaConfig")
    assert model.tp_plan  # transformers ships one
    assert lookup_policy(model).name == "llama"


def test_expert_parallel_policies_take_tp_from_the_plan():
    """Qwen3-MoE's policy has no TP plan: it keeps its MoESpec and gets the plan's TP."""
    policy = lookup_policy(meta("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2))
    assert policy.name == "qwen3_moe" and PLAN_TP_NOTE in policy.notes
    assert policy.moe is not None and policy.moe.replaceable  # MoELayer still allowed (EP)
    assert policy.tp_plan["model.layers.*.mlp.experts"] == "experts_allreduce"
    assert policy.tp_plan["model.layers.*.mlp.gate"] == "replicate_local"


def test_experts_named_only_in_the_ep_plan_are_split_as_before():
    """Note [Experts named only in the EP plan]: transformers 5.25's plans leave the routed
    experts to the EP plan; they are split over the TP ranks as 5.24's plans split them. Here a
    config whose TP plan has no expert entry stands for 5.25's on any transformers."""

    def without_experts(model_type: str, **sizes):
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(model_type, **{**SIZES, **sizes})
        plan = {k: v for k, v in cfg.base_model_tp_plan.items() if ".experts" not in k}
        cfg.base_model_tp_plan = plan  # (the instance's, over the class's)
        assert cfg.base_model_ep_plan["layers.*.mlp.experts"] == "ep_dispatch_experts"
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)

    experts = "model.layers.*.mlp.experts"
    for model_type in ("qwen3_moe", "olmoe"):  # a policy taking TP from the plan; the plan's
        model = without_experts(model_type, num_experts=4, num_experts_per_tok=2)
        assert not any(".experts" in k for k in model.tp_plan), model.tp_plan
        policy = lookup_policy(model)
        assert policy.tp_plan[experts] == "experts_allreduce", (model_type, policy.tp_plan)
        assert policy.moe is not None and policy.moe.experts == "experts"
    # A plan the user sets (one that leaves out an entry of transformers') is taken as
    # written: the experts stay whole on every rank.
    model = without_experts("olmoe", num_experts=4, num_experts_per_tok=2)
    model.tp_plan = {k: v for k, v in model.tp_plan.items() if "self_attn" in k}
    policy = policy_from_plan(model)
    assert policy is not None and experts not in policy.tp_plan and policy.moe is None


def test_plan_moe_allows_expert_parallelism_with_the_models_own_router_only():
    policy = lookup_policy(meta("OlmoeConfig", num_experts=4, num_experts_per_tok=2))
    assert policy.moe is not None and policy.moe.block_class == "OlmoeSparseMoeBlock"
    assert policy.num_experts_attr == "num_experts" and not policy.moe.replaceable
    moe_apply.check_policy(policy, MoEConfig(smp_moe=False))  # accepted
    with pytest.raises(ValueError, match=r"smp_moe=False.*MoESpec"):
        moe_apply.check_policy(policy, MoEConfig(smp_moe=True))


def test_entry_without_equivalent_names_module_style_and_fix():
    model = meta("Qwen3Config")
    # (a style transformers registers, 5.24 to 5.25, that the translation does not take on a
    # Linear: transformers gives it to fused experts' parameters only)
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.up_proj": "packed_rowwise"}
    with pytest.raises(ValueError) as err:
        policy_from_plan(model)
    message = str(err.value)
    for part in (
        "model.layers.0.mlp.up_proj",
        "'packed_rowwise'",
        "model.tp_plan",
        "ModelPolicy",
    ):
        assert part in message, message


def test_style_on_the_wrong_module_type_is_refused():
    model = meta("Qwen3Config")
    model.tp_plan = {**model.tp_plan, "model.layers.*.input_layernorm": "colwise"}
    with pytest.raises(ValueError, match=r"input_layernorm.*'colwise'.*nn.Linear"):
        policy_from_plan(model)


def test_own_parameters_beside_split_projections_are_not_replicated_silently():
    """A module whose own (unplanned) parameters sit above split projections is refused."""
    model = meta("Qwen3Config")
    attention = model.model.layers[0].self_attn
    attention.register_parameter("scale", torch.nn.Parameter(torch.ones(4, device="meta")))
    with pytest.raises(ValueError, match=r"self_attn.*\['scale'\].*not replicated silently"):
        policy_from_plan(model)


def test_planless_subtrees_are_replicated_at_their_root():
    """A plan that names only Bamba's embedding (transformers' up to 5.24; 5.25 also splits its
    attention and MLP): each decoder layer is one replicated subtree; the decoder stack reads
    the final norm only (layers are FSDP units of their own)."""
    model = meta("BambaConfig", attn_layer_indices=[1], mamba_n_heads=8)
    model.tp_plan = {"model.embed_tokens": "embedding_rowwise"}
    policy = lookup_policy(model)
    assert policy.tp_plan["model.embed_tokens"] == "vocab_embedding_allreduce"
    assert policy.tp_plan["model.layers.0"] == "replicate_local"
    assert not any(k.startswith("model.layers.0.") for k in policy.tp_plan)
    assert policy.tp_plan["model"] == "local_params"
    assert not policy.heads_split


def test_a_block_reading_its_childs_weight_gets_plain_values():
    """Qwen3-Next's linear attention convolves with its child's weight directly: the child is
    replicated and the block (own parameters, planned projections below) computes locally."""
    model = meta("Qwen3NextConfig", layer_types=["linear_attention", "full_attention"])
    policy = lookup_policy(model)
    assert policy.tp_plan["model.layers.*.linear_attn.conv1d"] == "replicate_local"
    assert policy.tp_plan["model.layers.*.linear_attn"] == "local_params"
    assert policy.tp_plan["model.layers.*.linear_attn.in_proj_qkvz"] == "colwise_gather"


def test_model_without_policy_or_plan_is_refused_with_the_way_out():
    model = meta("Qwen3Config")
    model.tp_plan = None  # transformers' setter: no plan
    model.__class__ = type("MyModel", (type(model),), {})
    with pytest.raises(ValueError) as err:
        lookup_policy(model)
    assert "base_model_tp_plan" in str(err.value) and "register_policy" in str(err.value)


#: A plan for OPT, which transformers ships none for, as a user writes it: no input embedding.
OPT_PLAN = {
    **{f"model.decoder.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.decoder.layers.*.self_attn.out_proj": "rowwise",
    "model.decoder.layers.*.fc1": "colwise",
    "model.decoder.layers.*.fc2": "rowwise",
    "lm_head": "colwise_gather_output",
}


def test_a_plan_the_user_sets_splits_the_tied_input_embedding_like_the_head():
    """transformers adds the input embedding only to the plans it builds from a config; a
    user's plan that splits the tied output embedding gets it too (tied weights split alike)."""
    model = meta("OPTConfig", word_embed_proj_dim=64, ffn_dim=128)
    assert not model.tp_plan  # transformers ships no plan for OPT
    model.tp_plan = OPT_PLAN
    policy = lookup_policy(model)
    assert policy.tp_plan["model.decoder.embed_tokens"] == "vocab_embedding_allreduce"
    assert policy.tp_plan["model.decoder.layers.*.self_attn.q_proj"] == "colwise"
    assert policy.tp_plan["lm_head"] == "lm_head"  # colwise_gather_output on the output embedding
    assert policy.heads_split

    untied = meta("OPTConfig", word_embed_proj_dim=64, ffn_dim=128, tie_word_embeddings=False)
    untied.tp_plan = OPT_PLAN
    plan = lookup_policy(untied).tp_plan  # left out, so replicated as any other module
    assert plan["model.decoder.embed_tokens"] == "replicate_local", plan

    whole_head = meta("OPTConfig", word_embed_proj_dim=64, ffn_dim=128)
    whole_head.tp_plan = {**OPT_PLAN, "lm_head": "replicate"}  # the vocabulary stays whole
    plan = lookup_policy(whole_head).tp_plan
    assert plan["model.decoder.embed_tokens"] == plan["lm_head"] == "replicate_local", plan


def test_a_model_without_a_plan_is_refused_naming_the_plan_setter():
    import transformers

    config = transformers.RwkvConfig(hidden_size=64, num_hidden_layers=2, vocab_size=128)
    with torch.device("meta"):
        model = transformers.RwkvForCausalLM(config)  # no plan, none shipped
    with pytest.raises(ValueError) as err:
        lookup_policy(model)
    assert "model.tp_plan = {" in str(err.value), err.value


def test_the_layer_class_is_the_outermost_layer_stack_element():
    """mBART's _no_split_modules names its attention too, which outnumbers its layers."""
    import transformers

    config = transformers.MBartConfig(
        vocab_size=128, d_model=64, decoder_layers=2, encoder_layers=2,
        decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=128,
        encoder_ffn_dim=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.MBartForCausalLM(config)
    assert "MBartAttention" in model._no_split_modules
    assert lookup_policy(model).layer_class == "MBartDecoderLayer"


def test_a_model_that_computes_its_own_loss_gets_gathered_logits():
    """BART's decoder calls CrossEntropyLoss in its forward rather than ``loss_function``:
    vocabulary-split logits would reach it as a DTensor, so its head gathers them."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=128, d_model=64, decoder_layers=2, encoder_layers=2,
        decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=128,
        encoder_ffn_dim=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.BartForCausalLM(config)
    policy = lookup_policy(model)
    assert policy.name == "bart (shipped plan)"
    assert policy.tp_plan["lm_head"] == "colwise_gather", policy.tp_plan
    assert lookup_policy(meta("Qwen3Config")).tp_plan["lm_head"] == "lm_head"


def test_without_no_split_modules_the_layer_is_the_list_element_the_plan_splits():
    import transformers

    config = transformers.BioGptConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.BioGptForCausalLM(config)
    assert not model._no_split_modules
    assert lookup_policy(model).layer_class == "BioGptDecoderLayer"


def test_a_multimodal_models_layer_class_is_the_one_its_plan_splits():
    """Gemma 3's vision tower has as many layers as its text model here (a tie of counts):
    FSDP units, checkpointing and offloading go on the decoder layers the plan splits."""
    from tools.model_coverage.tiny import build

    model = build("gemma3", device="meta")
    counts = {}
    for m in model.modules():
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    assert counts["SiglipEncoderLayer"] == counts["Gemma3DecoderLayer"] == 2, counts
    assert lookup_policy(model).layer_class == "Gemma3DecoderLayer"
    # Gemma 4's plan splits its vision layers too: the text decoder's class is still chosen.
    assert lookup_policy(build("gemma4", device="meta")).layer_class == "Gemma4TextDecoderLayer"


def test_gemma4_with_per_layer_embeddings_is_refused_before_any_rank_runs():
    """Note [Gemma 4's per-layer embeddings]: its multimodal forward reads a row of the text
    embedding's weight itself; TP would fail there mid-forward, so the policy refuses it,
    naming the attribute and the fix. Without per-layer embeddings it is split."""
    from tools.model_coverage.tiny import build

    model = build("gemma4", device="meta")
    policy = lookup_policy(model)
    text = model.config.text_config
    assert text.hidden_size_per_layer_input
    for config in (model.config, text):  # (tsm.transform passes the text config)
        with pytest.raises(ValueError, match=r"hidden_size_per_layer_input=\d+.*degree=1"):
            check_model(policy, config, 2)
    check_model(policy, text, 1)
    text.hidden_size_per_layer_input = 0
    check_model(policy, text, 2)


def test_a_split_module_that_computes_more_than_its_weight_is_refused():
    """Splitting the vocabulary of an embedding that normalizes its lookup (Inkling) would
    normalize partial sums."""

    class NormedEmbedding(torch.nn.Embedding):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.embed_norm = torch.nn.LayerNorm(self.embedding_dim)

    model = meta("Qwen3Config")
    with torch.device("meta"):
        model.model.embed_tokens = NormedEmbedding(128, 64)
    with pytest.raises(ValueError, match=r"model.embed_tokens.*embed_norm.weight"):
        policy_from_plan(model)


def test_big_birds_block_sparse_attention_is_refused_naming_the_attribute():
    """BigBird swaps each layer's attention module for one counting every head when it leaves
    block_sparse at forward time (short sequences, a cache): at tp 2 its first forward failed
    on a reshape."""
    sparse = meta("BigBirdConfig", is_decoder=True)  # block_sparse: BigBirdConfig's default
    policy = lookup_policy(sparse)
    assert policy.name == "big_bird (shipped plan)"
    with pytest.raises(ValueError, match="attention_type='original_full'"):
        check_model(policy, sparse.config, 2)
    check_model(policy, sparse.config, 1)  # nothing split
    full = meta("BigBirdConfig", is_decoder=True, attention_type="original_full")
    assert check_model(lookup_policy(full), full.config, 2).local_heads == 2


def test_plan_keys_may_name_numbered_members_below_a_layer_number():
    """CTRL's MLP is an ``nn.Sequential``: ``h.*.ffn.0`` names its first member (``*`` is the
    layer number, ``0`` itself), not every member as ``h.*.ffn.*`` would."""
    import transformers

    config = transformers.CTRLConfig(n_embd=64, n_layer=2, n_head=4, dff=128, vocab_size=128)
    with torch.device("meta"):
        model = transformers.CTRLLMHeadModel(config)
    plan = lookup_policy(model).tp_plan  # (concrete names: ffn.* would reach the ReLU)
    for layer in (0, 1):
        assert plan[f"transformer.h.{layer}.ffn.0"] == "colwise", plan
        assert plan[f"transformer.h.{layer}.ffn.2"] == "rowwise_allreduce", plan
        assert f"transformer.h.{layer}.ffn.1" not in plan, plan
    assert lookup_policy(model).width_attrs == (("d_model_size", "depth"),)


def test_sequence_to_sequence_decoders_count_the_decoders_heads():
    """``num_attention_heads`` is the encoder's in BART-like configs; the causal LM is the
    decoder, whose head count may differ."""
    whisper = meta(
        "WhisperConfig",
        d_model=64,
        encoder_attention_heads=2,
        decoder_attention_heads=4,
        num_key_value_heads=2,
        num_attention_heads=2,
    )
    policy = lookup_policy(whisper)
    assert policy.num_heads_attr == "decoder_attention_heads" and not policy.num_kv_heads_attr
    assert policy.head_counts(whisper.config) == (4, 4)
    assert check_model(policy, whisper.config, 4).local_heads == 1
    xglm = lookup_policy(meta("XGLMConfig", d_model=64, attention_heads=4))
    assert xglm.width_attrs == (("embed_dim", "head_dim"),)


def test_transformers_plans_missing_a_split_module_get_the_entry_users_plans_do_not():
    """Apertus's plan leaves out its xIELU activation (learned scalars on this rank's MLP
    columns): added with summed gradients. A plan changing transformers' entries (here
    gathering the MLP's columns, so the activation sees whole inputs) is taken as written."""
    model = meta("ApertusConfig", hidden_act="xielu")
    plan = lookup_policy(model).tp_plan
    assert plan["model.layers.*.mlp.act_fn"] == "replicate_partial_grad", plan
    model = meta("ApertusConfig", hidden_act="xielu")
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.up_proj": "colwise_rep"}
    plan = lookup_policy(model).tp_plan
    assert plan.get("model.layers.*.mlp.act_fn") != "replicate_partial_grad", plan
