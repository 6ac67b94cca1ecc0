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
