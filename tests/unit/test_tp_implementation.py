"""TP implementation choice without CUDA/Transformer Engine, and the vocabulary-shard arithmetic."""

from __future__ import annotations

import pytest

from torch_sagemaker.tensor_parallel import implementation
from torch_sagemaker.tensor_parallel.loss import vocab_shard_offset


def test_dtensor_backend_is_chosen_without_te_or_cuda():
    if implementation.te_available():
        pytest.skip("Transformer Engine and CUDA are available here")
    assert implementation.select_backend().name == "dtensor"
    with pytest.raises(ValueError, match="needs transformer_engine and CUDA"):
        implementation.use_backend("te")
    with pytest.raises(ValueError, match="use 'dtensor', 'te' or None"):
        implementation.use_backend("megatron")
    implementation.use_backend("dtensor")
    try:
        assert implementation.select_backend().name == "dtensor"
    finally:
        implementation.use_backend(None)


def test_automatic_choice_keeps_plan_driven_models_on_dtensor(monkeypatch):
    """With Transformer Engine available, a policy of TE's styles gets TE, a plan-built one
    (replicated-activation styles TE does not implement) gets DTensor; forcing still wins."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from torch_sagemaker.policies import LLAMA, lookup_policy

    monkeypatch.setattr(implementation, "te_available", lambda: True)
    with torch.device("meta"):
        qwen3 = AutoModelForCausalLM.from_config(
            Qwen3Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, head_dim=16)
        )
    assert implementation.select_backend(LLAMA).name == "te"
    assert implementation.select_backend(lookup_policy(qwen3)).name == "dtensor"
    implementation.use_backend("dtensor")
    try:
        assert implementation.select_backend(LLAMA).name == "dtensor"
    finally:
        implementation.use_backend(None)


@pytest.mark.parametrize(
    "vocab, shards, offsets",
    [
        (128, 2, [0, 64]),
        (127, 2, [0, 64]),
        (10, 4, [0, 3, 6, 9]),
        (5, 4, [0, 2, 4, 5]),
    ],
)
def test_vocab_shard_offsets_follow_torch_chunk(vocab, shards, offsets):
    import torch

    assert [vocab_shard_offset(vocab, shards, r) for r in range(shards)] == offsets
    sizes = [c.numel() for c in torch.arange(vocab).chunk(shards)]
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    assert starts == offsets[: len(sizes)]
