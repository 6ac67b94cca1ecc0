"""The CUDA path of activation offloading: side streams, events and the pinned host pool.

Skipped without CUDA. The same schedule and engine code runs in the CPU tests; these tests
cover what only a GPU has: asynchronous copies that overlap compute (``torch.cuda._sleep``
widens the windows in which a missing wait would read half-copied bytes) and the device
memory that offloading frees.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: covers the stream/event/pinned-memory offload path",
    ),
]

N_LAYERS = 4


def _llama(seed: int = 0, hidden: int = 256):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(cfg).cuda()
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )
    return model


def _step(model, seq: int = 64):
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(5)).cuda()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _wrap(model, horizon: int, **kwargs):
    from torch_sagemaker.offload import PrefetchOffloadWrapper

    return PrefetchOffloadWrapper(model, horizon=horizon, min_offload_bytes=0, trace=True, **kwargs)


@pytest.mark.parametrize("horizon", [1, 2, N_LAYERS])
def test_cuda_bit_identical_and_uses_side_streams(horizon):
    from torch_sagemaker.offload import get_stats
    from torch_sagemaker.offload.streams import CudaStreamTransfer

    ref_loss, ref_grads = _step(_llama())
    model = _wrap(_llama(), horizon)
    loss, grads = _step(model)
    torch.cuda.synchronize()
    assert torch.equal(loss, ref_loss)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    engine = model._offload_engine
    (transfer,) = engine._transfers.values()
    assert isinstance(transfer, CudaStreamTransfer)
    assert transfer.offload_stream != torch.cuda.current_stream()
    assert engine._pools[True].pin_memory
    stats = get_stats(model)
    assert stats.bytes_offloaded > 0 and stats.demand_fetches == 0


class _SlowLayer(nn.Module):
    """Saves its input, then keeps the compute stream busy while the copies run."""

    def forward(self, x):
        y = (x * 1.5).sin()
        torch.cuda._sleep(2_000_000)
        return y


def test_cuda_races_are_ordered_by_events():
    from torch_sagemaker.offload import get_stats

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(_SlowLayer() for _ in range(6))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.square().sum()

    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        x = torch.randn(1024, 1024, device="cuda").requires_grad_()
        model = Stack()
        if offload:
            model = _wrap(model, 1, layers=lambda m: isinstance(m, _SlowLayer))
        model(x).backward()
        results.append(x.grad.clone())
    torch.cuda.synchronize()
    assert torch.equal(results[0], results[1])
    assert get_stats(model).bytes_offloaded > 0


@pytest.mark.parametrize("horizon", [1, 2])
def test_cuda_device_memory_after_forward_shrinks(horizon):
    def allocated_after_forward(offload: bool) -> int:
        model = _llama(hidden=1024)
        if offload:
            model = _wrap(model, horizon)
        ids = torch.randint(0, 128, (4, 1024), device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        if offload:  # the copies are done: let the engine drop the device sources now
            model._offload_engine._poll_stash()
        used = torch.cuda.memory_allocated() - before
        loss.backward()
        return used

    without, with_offload = allocated_after_forward(False), allocated_after_forward(True)
    one_layer = 4 * 1024 * 1024 * 4  # (batch, seq, hidden) fp32 input of one layer
    # Without offloading every layer input is resident; with it, at most `horizon` are.
    assert without - with_offload >= (N_LAYERS - horizon) * one_layer * 0.9
