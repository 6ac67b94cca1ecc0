"""``torch_sagemaker.sharding.checkpoint_transformer_layers`` on a tiny Llama, in one process.

The distributed composition (FSDP1 / FSDP2, bf16, hybrid sharding) is tested in
tests/distributed/test_hybrid_mixed_precision.py; here: which modules get wrapped, the
errors, and that gradients are bit-identical to the model without checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from tests.distributed.hf_models import global_batches, tiny_llama
from torch_sagemaker.sharding import CheckpointImpl, checkpoint_transformer_layers


def _wrapped(model):
    return [
        m._checkpoint_wrapped_module for m in model.modules() if isinstance(m, CheckpointWrapper)
    ]


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_layers_wrapped_and_gradients_bit_identical(impl):
    ref = tiny_llama()
    model = checkpoint_transformer_layers(copy.deepcopy(ref), checkpoint_impl=impl)
    layers = _wrapped(model)
    assert len(layers) == 2 and all(isinstance(m, LlamaDecoderLayer) for m in layers)
    assert all(
        m.checkpoint_impl is impl for m in model.modules() if isinstance(m, CheckpointWrapper)
    )
    # The KV cache would be filled twice by the recomputation.
    assert model.config.use_cache is False and ref.config.use_cache is True
    calls = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, args: calls.append(m))
    ids = global_batches(1, 2)[0]
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 4  # each layer: forward, then recomputed in backward
    names = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        assert torch.equal(names[name].grad, p.grad), name


def test_idempotent_and_custom_units():
    model = tiny_llama()
    checkpoint_transformer_layers(model)
    checkpoint_transformer_layers(model)  # no layer is wrapped twice
    assert len(_wrapped(model)) == 2
    assert not any(
        isinstance(m._checkpoint_wrapped_module, CheckpointWrapper)
        for m in model.modules()
        if isinstance(m, CheckpointWrapper)
    )
    mlps = checkpoint_transformer_layers(tiny_llama(), layer_classes=(LlamaMLP,))
    assert [type(m) for m in _wrapped(mlps)] == [LlamaMLP, LlamaMLP]
    one = tiny_llama()
    first = one.model.layers[0]
    checkpoint_transformer_layers(one, check_fn=lambda m: m is first)
    assert _wrapped(one) == [first]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="no transformer layer class.*layer_classes="):
        checkpoint_transformer_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"found no module of class \['Conv1d'\].*layer_classes="):
        checkpoint_transformer_layers(tiny_llama(), layer_classes=(torch.nn.Conv1d,))
    with pytest.raises(ValueError, match="not both"):
        checkpoint_transformer_layers(tiny_llama(), layer_classes=(LlamaMLP,), check_fn=bool)
