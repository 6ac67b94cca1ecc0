"""``cp_comm_type="p2p"``: ring attention over the context parallel group, forward and backward.

Each rank holds queries, keys and values of its two chunks (``layout``). Key/value blocks
travel round the ring ``r -> r + 1``; at step ``i`` rank ``r`` holds the block of rank
``j = (r - i) mod cp`` and attends to it while the next block is already in flight
(Note [Ring attention schedule]). The backward pass is in Note [Ring attention backward].

Note [Ring attention schedule]
With rank ``r`` holding chunks ``r`` and ``2cp-1-r`` (zigzag) and ``j`` the block's owner:
- ``j == r`` (step 0): both local chunks against both, causal (positions increase along
  the local concatenation, so the plain causal mask of the local block is the global one);
- ``j < r``: chunk ``j`` precedes both local chunks and chunk ``2cp-1-j`` follows both, so
  every local query attends to the first half of the block, unmasked;
- ``j > r``: chunk ``r`` precedes both chunks of the block (nothing to do) and chunk
  ``2cp-1-r`` follows both, so the second half of the queries attends to the whole block.
Every step after the first is therefore a half-size unmasked block (``2c x c`` or
``c x 2c``): fully masked blocks are never computed and all ranks do the same work. The
send of the current block and the receive of the next are posted (``batch_isend_irecv``)
before the current block is computed, so communication overlaps the computation; the
ring needs ``cp - 1`` transfers of the local keys and values per layer.

Note [Ring attention backward]
The backward pass walks the same ring in the same order, recirculating the key/value
blocks (``cp - 1`` transfers) rather than keeping every rank's blocks from the forward
pass (which would cost the memory of the whole sequence's keys and values per layer).
The gradient of a key/value block is a sum over every rank that attended to it, so an
fp32 accumulator travels one hop behind its block: at step ``i`` rank ``r`` computes its
share for the block of rank ``j = (r - i) mod cp``, adds the accumulator it received
from ``r - 1`` (who held that block at step ``i - 1``), and sends the sum to ``r + 1``.
After the last step the accumulator is one hop from home: rank ``r`` sends the
accumulator of block ``r + 1`` to its owner and receives its own, complete, from
``r - 1``. Query gradients stay local. Each block's gradient uses the final output and
log-sum-exp (Note [Block backward with the final statistics] in ``blocks``). Key/value
blocks and gradient accumulators use different tags, so the two streams never mix.

Activation checkpointing re-runs the forward pass of a layer inside its backward pass.
The recomputation is a complete ring (every rank re-runs the same layer at the same
point, since backward is layer-synchronous across the group) and its messages are
matched in posting order per peer and tag, so recomputed and backward rings cannot
interleave wrongly.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_sagemaker.context_parallel.blocks import (
    autocast_off,
    block_backward,
    block_forward,
    merge_into,
)
from torch_sagemaker.context_parallel.comm import Ring, Transfer

_KV_TAG = 17
_DKV_TAG = 18


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the local queries over the whole sequence.

    Note [Ring attention schedule] describes the steps.

    Args:
        q: Local queries ``(b, h, 2c, d)`` (chunks ``r`` and ``2cp-1-r``).
        k: Local keys ``(b, kv_h, 2c, d)``.
        v: Local values ``(b, kv_h, 2c, d)``.
        ring: The context parallel ring.
        scale: Score scale.

    Returns:
        ``(out, lse)``: ``out`` ``(b, h, 2c, d)`` in ``q.dtype``, ``lse`` ``(b, h, 2c)`` fp32.
    """
    c = q.shape[2] // 2
    kv = torch.stack([k, v])  # one contiguous message per step
    out: torch.Tensor  # set at step 0 (ring.size >= 1)
    lse: torch.Tensor
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        transfer = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
        if step == 0:
            out, lse = block_forward(q, k, v, causal=True, scale=scale)
            out, lse = out.float(), lse.clone()
        elif owner < ring.rank:
            blk_out, blk_lse = block_forward(
                q, kv[0, :, :, :c], kv[1, :, :, :c], causal=False, scale=scale
            )
            merge_into(out, lse, blk_out, blk_lse)
        else:
            blk_out, blk_lse = block_forward(q[:, :, c:], kv[0], kv[1], causal=False, scale=scale)
            merge_into(out[:, :, c:], lse[:, :, c:], blk_out, blk_lse)
        if transfer is not None:
            kv = transfer.wait()
    return out.to(q.dtype), lse


def _block_grads(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    owner: int,
    rank: int,
    c: int,
    scale: float,
) -> torch.Tensor:
    """Adds this rank's query gradient for ``owner``'s block to ``dq``; returns its fp32 dK/dV."""
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if owner == rank:
        g = block_backward(dout, q, kv[0], kv[1], out, lse, causal=True, scale=scale)
        rows, cols = slice(None), slice(None)
    elif owner < rank:
        g = block_backward(
            dout, q, kv[0, :, :, :c], kv[1, :, :, :c], out, lse, causal=False, scale=scale
        )
        rows, cols = slice(None), slice(0, c)
    else:
        g = block_backward(
            dout[:, :, c:],
            q[:, :, c:],
            kv[0],
            kv[1],
            out[:, :, c:],
            lse[:, :, c:],
            causal=False,
            scale=scale,
        )
        rows, cols = slice(c, None), slice(None)
    dq[:, :, rows].add_(g[0])
    dkv[0, :, :, cols].add_(g[1])
    dkv[1, :, :, cols].add_(g[2])
    return dkv


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: Ring,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``ring_forward`` (Note [Ring attention backward]).

    Returns:
        ``(dq, dk, dv)`` in the dtypes and shapes of ``q``, ``k`` and ``v``.
    """
    c = q.shape[2] // 2
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    accumulator: Transfer | None = None  # the dK/dV sum of the block held now, in flight
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        kv_transfer = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
        dkv = _block_grads(dout, q, kv, out, lse, dq, owner, ring.rank, c, scale)
        if accumulator is not None:
            dkv.add_(accumulator.wait())
        if ring.size > 1:
            accumulator = ring.shift(dkv, _DKV_TAG)
        if kv_transfer is not None:
            kv = kv_transfer.wait()
    own = accumulator.wait() if accumulator is not None else dkv
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper of ``ring_forward``/``ring_backward``; returns ``(b, h, 2c, d)``."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float
    ) -> torch.Tensor:
        """Attention output of the local queries; saves what backward needs.

        ``q``, ``k`` and ``v`` share one dtype (``blocks.attention_inputs``); autocast is off
        inside (Note [Context parallel attention under autocast]).
        """
        with autocast_off(q.device.type):
            out, lse = ring_forward(q, k, v, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        """Gradients of ``q``, ``k``, ``v`` (none for ``ring`` and ``scale``)."""
        q, k, v, out, lse = ctx.saved_tensors
        with autocast_off(q.device.type):
            dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.ring, ctx.scale)
        return dq, dk, dv, None, None


__all__ = ["RingAttention", "ring_backward", "ring_forward"]
