"""``clip_grad_norm_`` on one process: PyTorch's values, half-precision gradients, bad input.

The sharded and tensor-parallel cases are checked against one process in
tests/distributed/test_hybrid_shard.py and the parity tests that clip.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sagemaker.grad_norm import clip_grad_norm_


def _model_with_grads(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)
    model(torch.randn(8, 16, dtype=dtype)).square().sum().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_matches_pytorch(norm_type):
    ours, theirs = _model_with_grads(), _model_with_grads()
    norm = clip_grad_norm_(ours, 0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type=norm_type)
    assert norm.dtype == torch.float64 and norm.device == torch.device("cpu")

    assert expected > 0.5  # it clips, so the scaled gradients are compared too
    torch.testing.assert_close(norm.float(), expected, rtol=1e-6, atol=0)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_bf16_gradients_are_summed_in_float32_at_least():
    # Each piece's norm in float32 (as PyTorch takes it), not bf16: bf16 would be ~1e-3 off.
    model = _model_with_grads(torch.bfloat16)
    exact = torch.linalg.vector_norm(
        torch.cat([p.grad.double().flatten() for p in model.parameters()])
    )
    norm = clip_grad_norm_(model, 1e9)  # no clipping: the gradients stay as they were
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, exact, rtol=1e-6, atol=0)


def test_a_model_without_gradients_has_norm_zero_on_its_parameters_device():
    # A rank whose shards hold no gradient (frozen weights) still reduces its buckets, on its
    # parameters' device (Note [Norm on the device]; only a GPU run shows the device part).
    model = _model_with_grads()
    for p in model.parameters():
        p.grad = None
    norm = clip_grad_norm_(model, 1.0)
    assert norm.device == next(model.parameters()).device and float(norm) == 0.0


@pytest.mark.parametrize("norm_type", [0.0, -1.0, float("nan")])
def test_refuses_a_norm_that_is_not_a_p_norm(norm_type):
    with pytest.raises(ValueError, match=r"norm_type=.*p > 0"):
        clip_grad_norm_(_model_with_grads(), 1.0, norm_type=norm_type)


def test_nonfinite_raises_when_asked():
    model = _model_with_grads()
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="nan or inf"):
        clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
