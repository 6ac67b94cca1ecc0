"""The planner's measured activation profiles (torch_sagemaker/planner/probe.py).

The probe must find, on its own, what the hand-written profiles say (those are checked
against real multi-rank steps in tests/distributed/test_planner_memory.py, which also checks
probed families under TP), explain widths only by the model's sizes, and let the planner
plan families whose policy comes from transformers' plan.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from torch_sagemaker.planner import plan
from torch_sagemaker.planner.model import load_model
from torch_sagemaker.planner.probe import ProbeError, probe_activations
from torch_sagemaker.planner.probe_widths import solve

SMALL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 512,
}


def _spec(tmp_path, model_type, **extra):
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **SMALL, **extra}))
    return load_model(path)


def _counts(terms):
    merged: dict[tuple[str, str, str], int] = {}
    for t in terms:
        key = (t.size, t.dtype, t.region)
        merged[key] = merged.get(key, 0) + t.count
    return merged


def _without_profile(spec):
    policy = dataclasses.replace(spec.policy, activations=None)
    return dataclasses.replace(spec, policy=policy)


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("llama", {}),
        # every layer sparse: the MoE block (masked attention: Gemma 3 in the memory test)
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    ],
)
def test_the_probe_finds_what_the_hand_written_profiles_say(tmp_path, model_type, extra):
    spec = _spec(tmp_path, model_type, **extra)
    hand = spec.policy.activations
    probed = probe_activations(_without_profile(spec))
    assert probed.probed and not hand.probed
    for part in ("attention", "final", "moe"):
        assert _counts(getattr(probed, part)) == _counts(getattr(hand, part)), part
    if probed.mlp:  # Mixtral has no dense layer to measure
        assert _counts(probed.mlp) == _counts(hand.mlp)
    assert probed.rotary_tables == hand.rotary_tables == 1


def test_widths_are_explained_by_the_fewest_sizes_or_refused():
    values = [
        {"one": 1, "q": q, "kv": kv, "hidden": h, "keys": s}
        for q, kv, h, s in [
            (96, 32, 80, 26),
            (192, 32, 80, 26),
            (96, 48, 80, 26),
            (96, 32, 128, 34),
        ]
    ]
    assert solve([v["q"] + 2 * v["kv"] for v in values], values, ("one", "q", "kv")) == {
        "q": 1,
        "kv": 2,
    }
    assert solve([v["keys"] for v in values], values, ("one", "q", "keys")) == {"keys": 1}
    assert solve([3, 3, 3, 3], values, ("one", "q")) == {"one": 3}
    # q x keys (eager scores of a size the names lack) is no whole-multiple sum of them
    assert solve([v["q"] * v["keys"] for v in values], values, ("one", "q", "kv", "keys")) == {}


def test_families_split_by_transformers_plan_are_planned(tmp_path):
    for model_type, extra in (("qwen3", {"head_dim": 16}), ("phi3", {"pad_token_id": None})):
        spec = _spec(tmp_path, model_type, **extra)
        assert spec.policy.activations is None, spec.policy.name
        result = plan(spec, seq_len=512, global_batch_tokens=8 * 512, hosts=1, per_host=4)
        assert result.best is not None, model_type
        assert result.best.memory.activations > 0


def test_a_family_the_probe_cannot_describe_is_refused_naming_why(tmp_path):
    # DiffLlama needs an even number of key/value heads, which the probe's run with three
    # of them breaks: the refusal names the reduced model and the error.
    spec = _spec(tmp_path, "diffllama")
    with pytest.raises(ProbeError, match="measuring it on a reduced model failed: cannot build"):
        probe_activations(spec)
    # (A width the sizes do not explain: test_widths_are_explained_by_the_fewest_sizes...)


def test_plans_without_sequence_parallelism_size_every_tp_rank_alike(tmp_path):
    # transformers' plans all-reduce region outputs: the residual stream stays whole, and a
    # rank other than 0 holds as much as rank 0 (a dimension split over one part is whole).
    from torch_sagemaker.planner.activations import ActivationShape, activation_bytes
    from torch_sagemaker.policies import split_heads
    from torch_sagemaker.topology import resolve

    spec = _spec(tmp_path, "qwen3", head_dim=16)
    assert not spec.policy.sequence_parallel and spec.policy.mlp_split
    spec = dataclasses.replace(
        spec, policy=dataclasses.replace(spec.policy, activations=probe_activations(spec))
    )
    heads = split_heads(8, 4, 2)
    layout = resolve(2, tensor_parallel_degree=2)
    sizes = [
        activation_bytes(
            spec,
            ActivationShape(layout, heads, 1, 64, 2, tp_rank=rank),
            checkpointing=checkpointing,
            offload=False,
            horizon=0,
        ).saved
        for checkpointing in (False, True)
        for rank in (0, 1)
    ]
    assert sizes[0] == sizes[1] > 0 and sizes[2] == sizes[3] > 0, sizes


def test_a_gathered_output_embedding_leaves_the_mlp_split(tmp_path):
    spec = _spec(tmp_path, "qwen3", head_dim=16)
    policy = spec.policy
    assert policy.mlp_split and policy.vocab_parallel_logits
    gathered_head = dataclasses.replace(
        policy, tp_plan={**policy.tp_plan, "lm_head": "colwise_gather"}
    )
    assert gathered_head.mlp_split and not gathered_head.vocab_parallel_logits
    mlp = {p: s for p, s in policy.tp_plan.items() if p.endswith(("gate_proj", "up_proj"))}
    gathered_mlp = dataclasses.replace(
        policy, tp_plan={**policy.tp_plan, **dict.fromkeys(mlp, "colwise_gather")}
    )
    assert not gathered_mlp.mlp_split


def test_sizes_a_config_names_its_own_way_are_shrunk_and_a_constant_width_is_refused(tmp_path):
    # OPT's MLP is ffn_dim and its head reads word_embed_proj_dim (equal to the hidden size):
    # both shrink and change with the runs, so the MLP's widths are the MLP size.
    spec = _spec(tmp_path, "opt", ffn_dim=256, word_embed_proj_dim=128)
    assert spec.mlp_size == 256
    probed = probe_activations(spec)
    assert _counts(probed.mlp).get(("mlp", "compute", "split"), 0) >= 1
    # A width per token that no run changes is a size the probe did not vary: refused.
    from torch_sagemaker.planner.probe_runs import Record
    from torch_sagemaker.planner.probe_widths import solved_terms

    record = Record(0, False, "token", 64, "compute", True, False, False, False)
    values = [{"one": 1, "hidden": h} for h in (80, 128, 80)]
    with pytest.raises(ProbeError, match="64 wide per token in every run"):
        solved_terms([[record]] * 3, values, "layer 0's mlp")


def test_what_follows_a_row_parallel_projection_is_not_split_and_unused_parameters_are_found(
    tmp_path,
):
    # BERT's attention.output and output modules hold the row-parallel projection, then a
    # dropout and a LayerNorm over its all-reduced output: whole hidden-wide storages, which
    # the solve cannot tell from the query width (equal in BERT) unless their region says.
    spec = _spec(tmp_path, "bert", tie_word_embeddings=False)
    probed = probe_activations(spec)
    attention, mlp = _counts(probed.attention), _counts(probed.mlp)
    assert attention[("q", "compute", "split")] == 1  # the output projection's input
    assert attention[("hidden", "compute", "sequence")] == 2  # dropout mask, LayerNorm input
    assert mlp[("hidden", "compute", "sequence")] == 2
    assert ("q", "compute", "split") not in mlp
    # Untied, the head's decoder has its own bias and cls.predictions.bias is never used.
    assert probed.no_gradient == ("cls.predictions.bias",)
    tied = probe_activations(_spec(tmp_path, "bert", tie_word_embeddings=True))
    assert tied.no_gradient == ()


def test_fsdp2_gives_an_unused_parameter_no_gradient_nor_state_and_fsdp1_does(tmp_path):
    from torch_sagemaker.planner.candidates import Candidate, Checked, check
    from torch_sagemaker.planner.inputs import Cluster, Workload
    from torch_sagemaker.planner.memory import sharding
    from torch_sagemaker.planner.presets import accelerator
    from torch_sagemaker.planner.shards import state_bytes

    spec = _spec(tmp_path, "bert", tie_word_embeddings=False)
    spec = dataclasses.replace(
        spec, policy=dataclasses.replace(spec.policy, activations=probe_activations(spec))
    )
    assert spec.untrained == {"cls.predictions.bias"}
    all_trained = dataclasses.replace(
        spec,
        policy=dataclasses.replace(
            spec.policy, activations=dataclasses.replace(spec.policy.activations, no_gradient=())
        ),
    )
    cluster = Cluster(hosts=1, per_host=2, accelerator=accelerator("H100"))
    workload = Workload(512, 512 * 2)
    bias = SMALL["vocab_size"] // 2 * 4  # its half on each of 2 FSDP ranks, float32
    for fsdp in (1, 2):
        checked = check(Candidate(2, fsdp=fsdp), spec, cluster, workload)
        assert isinstance(checked, Checked), checked
        found, every = (state_bytes(s, sharding(s, checked, workload)) for s in (spec, all_trained))
        assert found.parameters == every.parameters
        if fsdp == 2:
            assert every.gradients - found.gradients == bias
            assert every.optimizer - found.optimizer == 2 * bias + 4  # moments and step
        else:  # its flat parameter's gradient covers the whole slice
            assert found == every


def test_a_locally_split_input_saved_before_and_float32_rotary_tables_are_found(tmp_path):
    # OLMo 2's plan gathers q/k/v and splits the output projection's whole input locally:
    # the projection saves its own slice under TP, even though on the CPU its input is the
    # attention kernel's saved output (the reshape between them copies nothing). Its rotary
    # tables stay float32 under bfloat16 compute: one pair, which a float32 run keeps too.
    from torch_sagemaker.planner.activations import rotary_bytes

    spec = _spec(tmp_path, "olmo2")
    assert spec.policy.tp_plan["model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    probed = probe_activations(spec)
    assert _counts(probed.attention)[("q", "compute", "local")] == 1
    assert (probed.rotary_tables, probed.rotary_dtype) == (1, "float32")
    spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, activations=probed))
    width = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    for compute_bytes in (2, 4):
        assert rotary_bytes(spec, 64, compute_bytes) == 2 * 64 * width * 4


def test_a_conv1d_row_projection_ends_its_region(tmp_path):
    # GPT-2 (its shipped plan, on transformers' Conv1D): the residual dropout after each
    # row-parallel Conv1D runs on the all-reduced, whole output, in the residual stream.
    path = tmp_path / "gpt2.json"
    path.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 8, "vocab_size": 512}
        )
    )
    probed = probe_activations(load_model(path))  # GPT-2's default dropout rates (0.1)
    attention, mlp = _counts(probed.attention), _counts(probed.mlp)
    assert attention[("hidden", "compute", "sequence")] == 2  # the dropout mask, the residual
    assert attention[("q", "compute", "split")] == 1  # the row projection's input
    assert mlp[("hidden", "compute", "sequence")] == 2


def test_a_text_config_without_a_causal_lm_of_its_model_type_finds_its_class():
    """Mllama's text config (``mllama_text_model``) has no entry of its own in transformers'
    causal-LM mapping; ``MllamaForCausalLM`` is built from it."""
    import transformers

    from torch_sagemaker.planner.model import model_class

    assert model_class(transformers.MllamaTextConfig()) is transformers.MllamaForCausalLM
    with pytest.raises(ValueError, match="has no causal LM class"):
        model_class(transformers.CLIPVisionConfig())


def test_a_multimodal_models_text_layers_are_measured_under_their_own_plan(tmp_path):
    """Fuyu's plan names ``model.language_model.layers``; the probe builds the causal LM of
    its text config (Persimmon's), whose layers are ``model.layers``: the plan is moved
    there, and Fuyu saves what Persimmon with the same sizes saves. (Before, no attention
    module matched and the split widths were counted whole: +29% at tp 2.)"""
    import transformers

    from tools.model_coverage.tiny import tiny_config

    fuyu = tiny_config("fuyu")
    text = {k: v for k, v in fuyu.get_text_config().to_dict().items() if k != "model_type"}
    specs = []
    for name, config in (("fuyu", fuyu), ("persimmon", transformers.PersimmonConfig(**text))):
        config.to_json_file(tmp_path / f"{name}.json")
        specs.append(_without_profile(load_model(tmp_path / f"{name}.json")))
    fuyu_profile, persimmon_profile = (probe_activations(s) for s in specs)
    assert fuyu_profile.attention and fuyu_profile.attention == persimmon_profile.attention
    assert fuyu_profile.mlp == persimmon_profile.mlp


@pytest.mark.parametrize("mask", ["causal", "bool", "none"])
def test_attention_with_narrower_values_saves_what_a_fused_kernel_saves(mask):
    # Note [Attention with unequal head sizes]: SDPA's CPU math path saves every head's
    # float32 scores for unequal query and value head sizes; the probe's stand-in saves the
    # inputs, the output and the per-query log-sum-exp, and computes SDPA's values.
    import torch

    from torch_sagemaker.planner.probe_attention import FusedAttention

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 24, dtype=torch.float64).unbind(0)
    q, k = q.requires_grad_(), k.requires_grad_()
    v = torch.randn(4, 10, 16, dtype=torch.float64, requires_grad=True)
    kwargs: dict = {"scale": 0.3}
    keep = torch.rand(10, 10) > 0.3
    keep.fill_diagonal_(True)
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "bool":
        kwargs["attn_mask"] = keep
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FusedAttention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    shapes = sorted(tuple(t.shape) for t in saved)
    expected = [(4, 10), (4, 10, 16), (4, 10, 16), (4, 10, 24), (4, 10, 24)]
    if mask == "bool":
        expected.append((10, 10))  # as an additive mask of the query's dtype, as SDPA saves it
        assert next(t for t in saved if t.shape == (10, 10)).dtype == torch.float64
    assert shapes == expected and not any(t.shape == (4, 10, 10) for t in saved)
    # The reference, written out: softmax(q k^T x scale, masked) v.
    scores = q @ k.transpose(-2, -1) * 0.3
    allowed = {"causal": torch.ones(10, 10, dtype=torch.bool).tril(), "bool": keep}.get(mask)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    reference = torch.softmax(scores, dim=-1) @ v
    lse = next(t for t in saved if t.shape == (4, 10))
    assert lse.dtype == torch.float32
    assert torch.allclose(lse.double(), torch.logsumexp(scores, dim=-1), atol=1e-5)
    assert torch.allclose(out, reference, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(reference, (q, k, v), grad)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, want, strict=True))


def test_a_router_and_a_shared_expert_the_plan_keeps_whole_are_sized_whole(tmp_path):
    # Note [Blocks a region leaves whole]: Qwen2-MoE's block is a parallel region (its experts
    # are split over the TP ranks), but transformers' plan keeps its router and its shared
    # expert whole on every rank. Without an explicit head size the router's input (hidden
    # wide) equals the query heads' width in every run; it was taken for split query heads.
    # At tp 2 x hybrid shard 2 the two made the prediction 2.1% low.
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48, "num_key_value_heads": 8}  # fmt: skip
    spec = _spec(tmp_path, "qwen2_moe", **moe)
    terms = probe_activations(spec).moe
    assert {t.size for t in terms if t.region == "split"} == set(), terms
    assert ("shared_mlp", "compute", "gathered") in {(t.size, t.dtype, t.region) for t in terms}
    assert ("hidden", "compute", "gathered") in {(t.size, t.dtype, t.region) for t in terms}


def test_half_width_rotary_tables_are_found(tmp_path):
    # GPT-OSS rotates a head's two halves with one cos and one sin per pair of channels:
    # its tables are half the rotary width, which full-width pairs do not divide (the probe
    # refused it before). Its memory against real steps: docs/planner_validation.md.
    from torch_sagemaker.planner.activations import rotary_bytes

    spec = _spec(
        tmp_path,
        "gpt_oss",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    probed = probe_activations(spec)
    assert (probed.rotary_tables, probed.rotary_half_width) == (1, True)
    spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, activations=probed))
    assert rotary_bytes(spec, 64, 2) == 2 * 64 * (16 // 2) * 2  # cos and sin, bfloat16
    # Llama's tables repeat each value over both halves: full width.
    llama = probe_activations(_without_profile(_spec(tmp_path, "llama")))
    assert (llama.rotary_tables, llama.rotary_half_width) == (1, False)


def _llama4(tmp_path, layers: int, no_rope: list[int], step: int = 2):
    return _spec(
        tmp_path,
        "llama4_text",
        num_hidden_layers=layers,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=64,  # the experts' (expert_mlp_attr)
        intermediate_size_mlp=192,  # the dense layers'
        interleave_moe_layer_step=step,
        no_rope_layers=no_rope,
        layer_types=["chunked_attention" if r else "full_attention" for r in no_rope],
    )


def test_llama4_layer_kinds_and_experts_on_every_token_are_measured(tmp_path):
    # Llama 4 (refused before): its every-fourth layer has no rotary embedding and no
    # query/key norm (Note [Layer kinds]), and its MoE block runs every expert on every token
    # (Note [Experts on every token]). Its memory against real steps: docs/planner.md.
    from torch_sagemaker.planner.activations import experts_on_every_token

    spec = _llama4(tmp_path, 4, [1, 1, 1, 0])
    assert (spec.mlp_size, spec.dim("intermediate_size")) == (192, 64)
    probed = probe_activations(spec)
    kinds = dict(probed.attention_by_kind)
    rope = kinds[(("layer_types", "chunked_attention"), ("no_rope_layers", 1))]
    nope = kinds[(("layer_types", "full_attention"), ("no_rope_layers", 0))]
    assert ("q", "float32", "split") in _counts(rope)  # the float32 query norm
    assert ("q", "float32", "split") not in _counts(nope)
    moe = _counts(probed.moe)
    assert moe[("hidden", "compute", "every_expert")] == 2  # the repeated input, scaled
    assert moe[("expert_mlp", "compute", "own_experts")] == 4  # gate/up, activation, product
    assert _counts(probed.mlp)[("mlp", "compute", "split")] == 4  # dense layers, their size
    spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, activations=probed))
    assert experts_on_every_token(spec)


def test_a_layer_kind_beyond_the_reduced_copy_is_measured(tmp_path):
    # A pattern longer than the copy's 6 layers: the copy takes the rotary-free layer 7.
    spec = _llama4(tmp_path, 8, [1] * 7 + [0], step=1)
    kinds = dict(probe_activations(spec).attention_by_kind)
    assert len(kinds) == 2


def test_experts_on_every_token_compute_every_token(tmp_path, monkeypatch):
    # The time model gives each of Llama 4's experts every token's rows, not its share of
    # the picks: the matmul FLOPs grow by the experts' weights times the tokens not routed.
    from torch_sagemaker.planner import timing

    spec = _llama4(tmp_path, 4, [1, 1, 1, 0])
    one = {"tensor_parallel_degree": [1], "hybrid_shard_degree": [2], "fsdp": [2]}
    one |= {"activation_checkpointing": [False], "gradient_accumulation_steps": [1]}

    def flops() -> float:
        result = plan(spec, seq_len=64, global_batch_tokens=2 * 64, hosts=1, per_host=2, limits=one)
        (row,) = result.ranked
        return row.time.flops

    every = flops()
    monkeypatch.setattr(timing, "experts_on_every_token", lambda _spec: False)
    routed = flops()
    tokens, top_k, experts = 64, 1, 4  # one sequence a rank
    expert_elements = sum(p.numel for p in spec.params if p.expert)
    expected = 3 * 2 * tokens * (1 - top_k / experts) * expert_elements
    assert every - routed == pytest.approx(expected, rel=1e-9)


def test_layers_that_are_not_softmax_attention_are_refused(tmp_path):
    # MiniMax's lightning attention works in blocks of 256 tokens, which the probe's short
    # sequences never fill: its layers save different tensors, but sizing them by kind
    # would scale a block's scores with the whole sequence. Refused, naming the type.
    spec = _spec(
        tmp_path,
        "minimax",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
    )
    with pytest.raises(ProbeError, match="'linear_attention' \\(layers \\[0\\]\\)"):
        probe_activations(spec)


def test_dbrx_sizes_are_read_from_its_nested_configs_and_its_expert_loop_is_refused(tmp_path):
    # DBRX keeps its experts, their width, the experts per token (ffn_config) and its
    # key/value heads (attn_config) in nested configs; the probe writes its sizes there
    # too (its router reads ffn_config.hidden_size, which follows the hidden size).
    path = tmp_path / "dbrx.json"
    config = {
        "model_type": "dbrx",  # as DBRX's config.json names its sizes
        **{"d_model": 128, "n_heads": 8, "n_layers": 2, "vocab_size": 512},
        "attn_config": {"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 192, "moe_num_experts": 4, "moe_top_k": 2},
    }
    path.write_text(json.dumps(config))
    spec = load_model(path)
    ffn = spec.config.ffn_config
    assert (spec.num_experts, spec.mlp_size, spec.heads) == (4, 192, (8, 4))
    assert spec.num_experts == ffn.moe_num_experts
    assert spec.mlp_size == ffn.ffn_hidden_size
    assert spec.policy.moe is not None
    assert spec.policy.moe.top_k(spec.config) == ffn.moe_top_k
    assert spec.heads[1] == spec.config.attn_config.kv_n_heads
    # Its experts run one by one over those the tokens chose: what it saves grows with the
    # experts, which the probe's per-storage terms cannot size.
    with pytest.raises(ProbeError, match=r"in run \d+ \(experts \d+\): the number of tensors"):
        probe_activations(spec)
