"""Fused projections computed by rows (Note [Fused projections computed by rows]).

The rows each rank computes, and the product over them: the same values and gradients as
autograd through the selected rows, without keeping a copy of those rows for backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_sagemaker.tensor_parallel.fused_rows import _RowsLinear, fused_rows


def test_fused_rows_are_each_ranks_part_of_every_block_then_the_shared_ones():
    # [q | k | v] blocks of 4 over 2 ranks: rank 1 computes rows 2-3, 6-7, 10-11
    assert fused_rows(12, 3, 0, 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    # multi-query: 8 query rows split, the last 4 (one key and one value head) shared
    assert fused_rows(12, 1, 4, 0, 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert fused_rows(12, 1, 4, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="do not divide over tensor_parallel_degree=8"):
        fused_rows(12, 3, 0, 0, 8)


@pytest.mark.parametrize("bias", [True, False])
def test_the_rows_product_matches_autograd_and_saves_no_copy_of_the_rows(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    rows = fused_rows(24, 3, 0, 1, 2)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _RowsLinear.apply(x, weight, b, rows)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, [x, weight, *([b] if bias else [])], grad)
    expected_out = F.linear(x, weight[rows], b[rows] if bias else None)
    want = torch.autograd.grad(expected_out, [x, weight, *([b] if bias else [])], grad)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)
    # the whole weight, not a copy of its rows (autograd through ``weight[rows]`` keeps one,
    # transposed: torch.Size([16, 12]))
    assert all(shape.numel() != len(rows) * 16 for shape in saved), saved
