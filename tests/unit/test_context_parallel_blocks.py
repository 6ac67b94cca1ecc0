"""Context parallel pieces that need no processes: the zigzag layout, block kernels, merging."""

import pytest
import torch
import torch.nn.functional as F

from torch_sagemaker.context_parallel.blocks import (
    attention_inputs,
    autocast_off,
    block_backward,
    block_forward,
    merge_into,
)
from torch_sagemaker.context_parallel.layout import (
    check_local_length,
    chunks_of_rank,
    local_positions,
    merge_locals,
    owner_of_chunk,
    split_local,
)


def test_layout_matches_smp_split_and_round_trips():
    x = torch.arange(3 * 24).reshape(3, 24)
    for cp in (1, 2, 3, 4):
        parts = []
        for rank in range(cp):
            # SMP's get_batch_for_cp_rank, written out: view as 2cp chunks, keep r and 2cp-1-r.
            smp = (
                x.view(3, 2 * cp, 24 // (2 * cp))
                .index_select(1, torch.tensor([rank, 2 * cp - 1 - rank]))
                .reshape(3, -1)
            )
            assert torch.equal(split_local(x, rank, cp), smp)
            assert torch.equal(local_positions(rank, cp, 24 // cp), smp[0])  # x[0] is 0..23
            parts.append(smp)
        assert torch.equal(merge_locals(parts), x)
        for chunk in range(2 * cp):
            rank, half = owner_of_chunk(chunk, cp)
            assert chunks_of_rank(rank, cp)[half] == chunk


def test_positions_of_the_documented_example():
    assert local_positions(0, 2, 4).tolist() == [0, 1, 6, 7]
    assert local_positions(1, 2, 4).tolist() == [2, 3, 4, 5]


def test_bad_lengths_name_the_rule():
    with pytest.raises(
        ValueError, match=r"has 6, which is not divisible by 2 \* context_parallel_degree = 4"
    ):
        check_local_length(3, 2)
    with pytest.raises(ValueError, match="sequence length 10 .* multiple of 4"):
        split_local(torch.zeros(1, 10), 0, 2)


def _qkv(b=2, h=4, kv=2, n=6, m=6, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, n, d, generator=g).to(dtype),
        torch.randn(b, kv, m, d, generator=g).to(dtype),
        torch.randn(b, kv, m, d, generator=g).to(dtype),
    )


def _reference(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_block_forward_and_backward_match_sdpa_with_gqa(causal, kernel, monkeypatch):
    if kernel == "math":
        monkeypatch.setattr(
            "torch_sagemaker.context_parallel.blocks._use_flash", lambda q, k: False
        )
    q, k, v = _qkv()
    scale = q.shape[-1] ** -0.5
    out, lse = block_forward(q, k, v, causal=causal, scale=scale)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qr, kr, vr, causal)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_merged_blocks_equal_whole_attention(kernel, monkeypatch):
    """Three key blocks merged online; backward per block with the final statistics."""
    if kernel == "math":
        monkeypatch.setattr(
            "torch_sagemaker.context_parallel.blocks._use_flash", lambda q, k: False
        )
    q, k, v = _qkv(n=5, m=12)
    scale = q.shape[-1] ** -0.5
    cuts = [slice(0, 3), slice(3, 8), slice(8, 12)]
    out = lse = None
    for cut in cuts:
        o, s = block_forward(q, k[:, :, cut], v[:, :, cut], causal=False, scale=scale)
        if out is None:
            out, lse = o.float(), s.clone()
        else:
            merge_into(out, lse, o, s)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qr, kr, vr, causal=False)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for cut in cuts:
        g = block_backward(dout, q, k[:, :, cut], v[:, :, cut], out, lse, causal=False, scale=scale)
        dq += g[0]
        dk[:, :, cut] += g[1]
        dv[:, :, cut] += g[2]
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_inputs_compute_as_sdpa_under_autocast():
    """Note [Context parallel attention under autocast]: RoPE leaves q and k in fp32, v bf16."""
    q, k, v = _qkv()
    v = v.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        cq, ck, cv = attention_inputs(q, k, v)
        with autocast_off("cpu"):
            assert not torch.is_autocast_enabled("cpu")
            out, _ = block_forward(cq, ck, cv, causal=True, scale=q.shape[-1] ** -0.5)
    assert {t.dtype for t in (cq, ck, cv)} == {torch.bfloat16} and out.dtype == want.dtype
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    # Outside autocast: inputs of one dtype are untouched, mixed ones promoted.
    q, k, v = _qkv()
    assert all(a is b for a, b in zip(attention_inputs(q, k, v), (q, k, v)))
    mixed = attention_inputs(q, k, v.to(torch.bfloat16))
    assert {t.dtype for t in mixed} == {torch.float32}
    with autocast_off("meta"):  # a device type autocast does not know: nothing to turn off
        pass


def test_sliding_window_config_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    from torch_sagemaker.context_parallel.prepare import check_supported
    from torch_sagemaker.policies import MISTRAL

    cfg = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(
        ValueError,
        match="sliding_window=8: sliding-window attention is not supported.*"
        "a multimodal model's text_config",
    ):
        check_supported(MistralForCausalLM(MistralConfig(**cfg, sliding_window=8)), MISTRAL)
    check_supported(MistralForCausalLM(MistralConfig(**cfg, sliding_window=None)), MISTRAL)


def test_benchmark_local_comm_keeps_shapes_and_restores():
    """The benchmark's no-communication mode: same shapes, originals restored."""
    from torch_sagemaker.context_parallel import allgather, comm

    originals = (comm.Ring.shift, allgather.all_gather_stacked, allgather.reduce_scatter_stacked)

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 1

    from benchmarks.context_parallel import local_attention_comm

    with local_attention_comm():
        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(comm.Ring.shift(None, x, 17).wait(), x)
        stacked = allgather.all_gather_stacked(x, Group())
        assert stacked.shape == (2, 2, 3) and torch.equal(stacked[1], x)
        assert torch.equal(allgather.reduce_scatter_stacked(stacked, Group()), x)
    assert (
        comm.Ring.shift,
        allgather.all_gather_stacked,
        allgather.reduce_scatter_stacked,
    ) == originals
