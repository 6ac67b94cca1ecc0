"""Prefetching offload on a tiny Hugging Face Llama in one process (CPU, synchronous copies).

Every test compares against the same model without offloading: losses and every gradient
must be bit-identical (``torch.equal``), and the instrumented memory must obey the horizon.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from torch_sagemaker.offload import PrefetchOffloadWrapper, get_stats

N_LAYERS = 4
IMPLS = [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT]


def build(impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT, seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with every decoder layer activation-checkpointed."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(cfg)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    return model


def wrap(model: torch.nn.Module, horizon: int, **kwargs) -> PrefetchOffloadWrapper:
    kwargs.setdefault("min_offload_bytes", 0)
    return PrefetchOffloadWrapper(model, horizon=horizon, trace=True, **kwargs)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Checkpoint wrappers add a name segment below the root; the offload root removes it.
    return {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }


def assert_bit_identical(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    got, want = grads(model), grads(ref)
    assert got.keys() == want.keys()
    for name in want:
        assert want[name] is not None, name
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
@pytest.mark.parametrize("horizon", [1, 2, N_LAYERS])
def test_loss_and_gradients_bit_identical(impl, horizon):
    ref, model = build(impl), wrap(build(impl), horizon)
    ids = batch(0)
    expected, got = loss_of(ref, ids), loss_of(model, ids)
    expected.backward()
    got.backward()
    assert torch.equal(got, expected)
    assert_bit_identical(model, ref)
    stats = get_stats(model)
    assert stats.layers == N_LAYERS and stats.bytes_offloaded > 0
    assert stats.demand_fetches == 0
    assert stats.prefetch_lead_max == min(horizon, N_LAYERS - 1)
    assert stats.resident_bytes == 0  # everything released once backward is over


def test_bf16_autocast_bit_identical():
    ref, model = build(), wrap(build(), 2)
    ids = batch(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = loss_of(ref, ids), loss_of(model, ids)
    expected.backward()
    got.backward()
    assert torch.equal(got, expected)
    assert_bit_identical(model, ref)
    assert get_stats(model).bytes_offloaded > 0


@pytest.mark.parametrize("horizon", [1, 2, N_LAYERS])
def test_peak_resident_obeys_the_horizon(horizon):
    ids = batch(2)
    baseline = wrap(build(), horizon, offload=False)
    loss_of(baseline, ids).backward()
    base = get_stats(baseline)
    model = wrap(build(), horizon)
    loss_of(model, ids).backward()
    stats = get_stats(model)
    assert base.bytes_offloaded == 0 and base.peak_resident_bytes == base.bytes_saved > 0
    assert stats.bytes_saved == base.bytes_saved
    bound = (horizon + 1) / N_LAYERS * base.peak_resident_bytes + stats.bytes_kept
    assert stats.peak_resident_bytes <= bound, (stats, base)
    if horizon + 1 < N_LAYERS:
        assert stats.peak_resident_bytes < base.peak_resident_bytes


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_each_layer_is_requested_before_its_backward_and_freed_after(impl):
    model = wrap(build(impl), 1)
    loss_of(model, batch(3)).backward()
    trace = model.offload_trace
    pass_id = trace[0][1]
    assert trace.index(("forward_end", pass_id)) == N_LAYERS  # one "offload" per layer first
    for unit in range(N_LAYERS):
        fetched = trace.index(("fetch", pass_id, unit, "prefetch"))
        started = trace.index(("backward_start", pass_id, unit))
        assert fetched < started, trace
        if unit > 0:  # freed before the next layer's backward starts
            assert (
                started
                < trace.index(("release", pass_id, unit))
                < trace.index(("backward_start", pass_id, unit - 1))
            ), trace


def test_gradient_accumulation_and_interleaved_micro_batches():
    ids = [batch(10), batch(11)]
    ref, model = build(), wrap(build(), 1)
    # 1. forward/backward per micro-batch (gradient accumulation).
    for m in (ref, model):
        for x in ids:
            loss_of(m, x).backward()
    assert_bit_identical(model, ref)
    # 2. two forwards, then one backward through both graphs.
    for m in (ref, model):
        m.zero_grad()
        (loss_of(m, ids[0]) + loss_of(m, ids[1])).backward()
    assert_bit_identical(model, ref)
    stats = get_stats(model, reset=True)
    assert stats.forward_passes == 4 and stats.resident_bytes == 0
    # The second forward evicted the first pass's prefetched layer; the joint backward
    # reaches that pass after the second one and fetches its last layer on demand.
    assert stats.demand_fetches == 1
    # 3. two forwards, then the backwards in reverse order (pipeline style).
    for m in (ref, model):
        m.zero_grad()
        first, second = loss_of(m, ids[0]), loss_of(m, ids[1])
        second.backward()
        first.backward()
    assert_bit_identical(model, ref)
    stats = get_stats(model)
    assert stats.forward_passes == 2 and stats.resident_bytes == 0
    # Evicted by the second forward, the first pass's last layer was fetched again when
    # the second backward finished, so nothing waited.
    assert stats.demand_fetches == 0
    trace = model.offload_trace
    ends = [e[1] for e in trace if e[0] == "forward_end"]
    first_pass = ends[-2]
    assert ("evict", first_pass, N_LAYERS - 1) in trace
    finished = len(trace) - 1 - trace[::-1].index(("backward_finished",), 1)
    assert trace[finished + 1] == ("fetch", first_pass, N_LAYERS - 1, "prefetch"), trace


def test_host_buffers_are_reused_across_steps():
    model = wrap(build(), 2)
    loss_of(model, batch(4)).backward()
    first = get_stats(model, reset=True)
    loss_of(model, batch(5)).backward()
    second = get_stats(model)
    assert first.host_pool_bytes == second.host_pool_bytes > 0
    assert second.bytes_offloaded == first.bytes_offloaded
    assert first.host_pool_new_bytes == first.bytes_offloaded
    assert second.host_pool_new_bytes == 0  # every block of the second step was reused


def test_host_pool_stays_bounded_when_the_sequence_length_varies():
    """Note [Host pool trimming]: a new length every step used to add blocks for good."""
    model = wrap(build(), 2)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        ids = torch.randint(0, 128, (2, 8 + step), generator=g)
        loss_of(model, ids).backward()
        stats = get_stats(model, reset=True)
        # One pass is one cycle of the pool and its footprint is what it offloaded; the
        # lengths grow, so the largest recent footprint is this step's.
        assert 0 < stats.host_pool_bytes <= 2 * stats.bytes_offloaded, (step, stats)
    pool_bytes = stats.host_pool_bytes
    for _ in range(3):  # the same length again: reused, nothing new, nothing dropped
        loss_of(model, ids).backward()
        stats = get_stats(model, reset=True)
        assert stats.host_pool_new_bytes == 0 and stats.host_pool_bytes == pool_bytes, stats


def test_retained_graph_backward_twice():
    ref, model = build(), wrap(build(), 1)
    for m in (ref, model):
        loss = loss_of(m, batch(6))
        loss.backward(retain_graph=True)
        loss.backward()
    assert_bit_identical(model, ref)


def test_a_forward_without_backward_frees_its_pass():
    """Note [Saved tensors handed back without their graph]: a training forward whose loss
    is dropped (a step skipped on a non-finite loss) left its pass alive for good: the loss's
    saved ``log_softmax`` output held the graph that held it."""
    import gc

    for impl in IMPLS:
        inner = build(impl)
        inner.config.use_cache = False  # the KV cache would hold its own graph
        model = wrap(inner, 1)
        engine = model._offload_engine
        for step in range(3):
            loss = loss_of(model, batch(20 + step))
            del loss
            gc.collect()
            assert engine._live_passes() == [], (impl, step)
        pool = next(iter(engine._pools.values()))
        assert pool.in_use_bytes == 0, (impl, pool.in_use_bytes)
        loss_of(model, batch(30)).backward()  # a normal step after them still trains
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_no_grad_and_eval_are_untouched():
    model = wrap(build(), 1)
    ref = build()
    ids = batch(7)
    with torch.no_grad():
        assert torch.equal(loss_of(model, ids), loss_of(ref, ids))
    model.eval()
    ref.eval()
    assert torch.equal(loss_of(model, ids), loss_of(ref, ids))
    stats = get_stats(model)
    assert stats.forward_passes == 0 and stats.layers == 0 and stats.bytes_saved == 0
