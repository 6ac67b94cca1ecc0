"""DBRX's shipped plan: grouped-query [q | k | v] computed by rows, experts split whole.

transformers ships no plan for DBRX's layers (its class declares only the head's entry),
its ``Wqkv`` packs 4 query and 2 key/value heads (which is also two query widths: the
layout must be read as [q | k | v]), and its experts keep ``(experts x ffn, hidden)``
weights on a child module and index every expert they are given. Parity on 4 ranks:
tests/distributed/test_model_coverage.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sagemaker.policies import lookup_policy
from torch_sagemaker.policies.module_layout import expert_count, packed_blocks


def _dbrx(kv_heads: int = 2):
    import transformers
    from transformers import AutoModelForCausalLM

    from tools.model_coverage.tiny import tiny_config

    config = tiny_config("dbrx").to_dict()
    config["attn_config"]["kv_n_heads"] = config["num_key_value_heads"] = kv_heads
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(transformers.DbrxConfig(**config))


def test_dbrx_gets_its_shipped_plan_though_its_class_declares_the_heads_entry():
    model = _dbrx()
    assert model.tp_plan == {"lm_head": "colwise_gather_output"}  # transformers' own
    policy = lookup_policy(model)
    assert policy.name == "dbrx (shipped plan)", policy.name
    attn = "transformer.blocks.*.norm_attn_norm.attn"
    assert policy.tp_plan[f"{attn}.Wqkv"] == "linear_packed_colwise"
    assert policy.tp_plan[f"{attn}.out_proj"] == "rowwise_allreduce"
    assert policy.tp_plan["transformer.blocks.*.ffn.experts"] == "experts_allreduce_local_slots"
    assert policy.tp_plan["transformer.blocks.*.ffn.router"] == "replicate_local"
    assert ("hidden_size", "head_dim") in policy.width_attrs

    mine = _dbrx()  # a plan the user sets is taken as written
    mine.tp_plan = {"lm_head": "colwise_gather_output", "transformer.wte": "embedding_rowwise"}
    policy = lookup_policy(mine)
    assert policy.name == "dbrx (transformers plan)" and not policy.heads_split


def test_dbrx_with_one_key_value_head_shares_it_on_every_rank():
    policy = lookup_policy(_dbrx(kv_heads=1))  # DbrxConfig's default attn_config
    wqkv = "transformer.blocks.*.norm_attn_norm.attn.Wqkv"
    assert policy.tp_plan[wqkv] == "shared_kv_colwise", policy.tp_plan


def test_a_plan_for_the_layers_in_the_config_keeps_a_head_only_plan_the_users(monkeypatch):
    """Only a class's own head entry, with no plan in the config, gives way to a shipped one."""
    import transformers
    from transformers import AutoModelForCausalLM

    from torch_sagemaker.policies import shipped_plans

    monkeypatch.setitem(shipped_plans.SHIPPED_PLANS, "qwen3", {"layers.*.mlp.up_proj": "colwise"})
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.tp_plan = dict(type(model)._tp_plan)  # the class's head entry alone
    policy = lookup_policy(model)
    assert policy.name == "qwen3 (transformers plan)" and not policy.heads_split, policy.name


def test_grouped_query_qkv_is_read_as_q_k_v_before_equal_blocks():
    model = _dbrx()  # 4 query heads, 2 key/value heads of 16: 128 features
    attention = [n for n, m in model.named_modules() if type(m).__name__ == "DbrxAttention"]
    name = f"{attention[0]}.Wqkv"
    assert packed_blocks(model, name, attention) == (64, 32, 32)


def test_expert_count_takes_expert_major_rows_and_refuses_a_list_of_experts():
    model = _dbrx()
    assert expert_count(model.transformer.blocks[0].ffn.experts) == 4

    class Experts(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.num_experts = 4
            self.mlp = nn.Module()
            self.mlp.w1 = nn.Parameter(torch.empty(rows, 8))

    assert expert_count(Experts(4 * 6)) == 4
    assert expert_count(Experts(4 * 6 + 2)) is None  # not whole experts
    assert expert_count(Experts(4)) is None  # one row an expert: a router's (E, hidden)
    listed = nn.Module()
    listed.num_experts = 4
    listed.experts = nn.ModuleList(nn.Linear(8, 16, bias=False) for _ in range(4))  # 4 x 4
    assert expert_count(listed) is None
    block = nn.Module()  # a whole MoE block: its own (E, hidden) router weight is fine,
    block.num_experts = 4  # the child's fused (E, ...) experts are not rows
    block.weight = nn.Parameter(torch.empty(4, 8))
    block.experts = nn.Module()
    block.experts.gate_up_proj = nn.Parameter(torch.empty(4, 16, 8))
    assert expert_count(block) is None
    fused = nn.Module()  # transformers 5's fused experts: their own (E, ...) parameters
    fused.num_experts = 4
    fused.gate_up_proj = nn.Parameter(torch.empty(4, 16, 8))
    fused.down_proj = nn.Parameter(torch.empty(4, 8, 8))
    assert expert_count(fused) == 4
    fused.bias = nn.Parameter(torch.empty(8, 8))  # 8 rows on the module itself: not it
    assert expert_count(fused) is None


def test_each_rank_computes_whole_heads_of_each_block():
    from torch_sagemaker.tensor_parallel.fused_rows import fused_rows

    # [q | k | v] of widths 64, 32, 32 on rank 1 of 2: its half of each block
    rows = fused_rows(128, (64, 32, 32), 0, 1, 2).tolist()
    assert rows == [*range(32, 64), *range(80, 96), *range(112, 128)]
    with pytest.raises(ValueError, match=r"widths \[64, 32, 32\].*tensor_parallel_degree=64"):
        fused_rows(128, (64, 32, 32), 0, 0, 64)
    with pytest.raises(ValueError, match="do not hold the blocks"):
        fused_rows(128, (64, 32), 0, 0, 2)
    # 2 key/value heads of 16 over 4 ranks: half a head each, refused
    assert len(fused_rows(128, (64, 32, 32), 0, 3, 2, head_dim=16)) == 64
    with pytest.raises(ValueError, match=r"heads of 16 of widths \[64, 32, 32\]"):
        fused_rows(128, (64, 32, 32), 0, 0, 4, head_dim=16)


def test_expert_parallelism_refuses_experts_kept_on_a_child_naming_tensor_parallelism():
    from types import SimpleNamespace

    from torch_sagemaker.moe.experts import split_experts

    experts = _dbrx().transformer.blocks[0].ffn.experts
    mesh = SimpleNamespace(size=lambda: 2)  # (refused before the mesh is used)
    with pytest.raises(ValueError, match=r"child module\(s\) \['mlp'\].*tensor_parallel_degree"):
        split_experts(experts, mesh, all_to_all=True)


def _experts_and_choices():
    import transformers

    from tools.model_coverage.tiny import tiny_config

    torch.manual_seed(0)
    experts = transformers.DbrxForCausalLM(tiny_config("dbrx")).transformer.blocks[0].ffn.experts
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    hidden = torch.randn(2, 5, 64, requires_grad=True)
    index = torch.tensor([[0, 1], [1, 1], [2, 3], [3, 0], [1, 2]] * 2)  # (tokens, top-k)
    weights = torch.rand(10, 2, requires_grad=True)
    return experts, hidden, index, weights


def test_experts_on_this_ranks_choices_alone_compute_what_the_module_does():
    """One rank holding every expert: the local-slots path against the module's own forward."""
    from torch_sagemaker.tensor_parallel.styles import _LocalExpertsView, _run_local_slots

    experts, hidden, index, weights = _experts_and_choices()
    want = type(experts).forward(experts, hidden, index, weights)
    want.square().sum().backward()
    expected = [t.grad.clone() for t in (hidden, weights, *experts.parameters())]
    for t in (hidden, weights, *experts.parameters()):
        t.grad = None
    view = _LocalExpertsView(experts, 4)
    got = _run_local_slots(type(experts).forward, view, hidden, index, weights, index < 0)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    got.square().sum().backward()
    for g, e in zip((hidden.grad, weights.grad, *(p.grad for p in experts.parameters())), expected):
        assert torch.allclose(g, e, atol=1e-5)


def test_a_rank_without_choices_still_gives_its_experts_zero_gradients():
    from torch_sagemaker.tensor_parallel.styles import _LocalExpertsView, _run_local_slots

    experts, hidden, index, weights = _experts_and_choices()
    view = _LocalExpertsView(experts, 4)
    out = _run_local_slots(type(experts).forward, view, hidden, index, weights, index >= 0)
    assert not out.any()
    out.sum().backward()
    # Note [Experts without a token on this rank]: FSDP reduces the same parameters on every
    # rank, and the TP ranks sum the inputs' gradients together.
    for t in (*experts.parameters(), hidden, weights):
        assert t.grad is not None and not t.grad.any()
