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


def _dbrx():
    from tools.model_coverage.tiny import build

    return build("dbrx", device="meta")


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
    listed = nn.Module()
    listed.num_experts = 4
    listed.experts = nn.ModuleList(nn.Linear(8, 16) for _ in range(4))  # 16 rows: 4 x 4
    assert expert_count(listed) is None


def test_a_kv_block_narrower_than_the_ranks_heads_is_refused_at_transform():
    from torch_sagemaker.tensor_parallel.fused_rows import fused_rows

    # [q | k | v] of widths 64, 32, 32 on rank 1 of 2: its half of each block
    rows = fused_rows(128, (64, 32, 32), 0, 1, 2).tolist()
    assert rows == [*range(32, 64), *range(80, 96), *range(112, 128)]
    with pytest.raises(ValueError, match=r"widths \[64, 32, 32\].*tensor_parallel_degree=64"):
        fused_rows(128, (64, 32, 32), 0, 0, 64)
    with pytest.raises(ValueError, match="do not hold the blocks"):
        fused_rows(128, (64, 32), 0, 0, 2)


def test_expert_parallelism_refuses_experts_kept_on_a_child_naming_tensor_parallelism():
    from types import SimpleNamespace

    from torch_sagemaker.moe.experts import split_experts

    experts = _dbrx().transformer.blocks[0].ffn.experts
    mesh = SimpleNamespace(size=lambda: 2)  # (refused before the mesh is used)
    with pytest.raises(ValueError, match=r"child module\(s\) \['mlp'\].*tensor_parallel_degree"):
        split_experts(experts, mesh, all_to_all=True)
