"""Per-head bias inputs cut to a rank's heads (Note [Head-indexed inputs]), without processes.

``HeadInputs`` reads only the mesh's size and this rank's place in it; the rank here is the
second of two, so it keeps heads 2 and 3 of 4. Parity on ranks: BLOOM, Falcon and MPT in
tests/distributed/test_tp_fused_qkv.py, CPM-Ant in docs/model_coverage.md.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torch_sagemaker.tensor_parallel.head_inputs import HeadInputs

MESH = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)


class _Attention(nn.Module):
    """Records what its forward got (CPM-Ant's signature: the bias by position)."""

    def forward(self, hidden, mask, position_bias, attention_mask=None):
        self.got = (mask, position_bias, attention_mask)
        return hidden


def _styled() -> _Attention:
    module = _Attention()
    return HeadInputs(4, name="attn")._apply(module, MESH)  # type: ignore[arg-type]


def test_a_bias_passed_by_position_is_cut_to_the_ranks_heads():
    module = _styled()
    hidden = torch.zeros(3, 5, 8)
    bias = torch.arange(3 * 4 * 5 * 5.0).reshape(3, 4, 5, 5)  # [batch, heads, q, k]
    mask = torch.ones(3, 5, 5, dtype=torch.bool)  # no head dimension: left alone
    module(hidden, mask, bias)
    got_mask, got_bias, _ = module.got
    assert got_mask is mask
    assert torch.equal(got_bias, bias[:, 2:4])


def test_by_keyword_too_with_a_mask_of_heads():
    module = _styled()
    bias = torch.randn(3, 4, 5, 5)
    heads_mask = torch.randn(3, 4, 5, 5)
    module(torch.zeros(3, 5, 8), None, position_bias=bias, attention_mask=heads_mask)
    _, got_bias, got_mask = module.got
    assert torch.equal(got_bias, bias[:, 2:4]) and torch.equal(got_mask, heads_mask[:, 2:4])


def test_a_bias_of_another_layout_is_refused_naming_it():
    module = _styled()
    with pytest.raises(ValueError, match=r"shape \(7, 5\).*4 heads"):
        module(torch.zeros(3, 5, 8), None, torch.randn(7, 5))
