"""``cp_comm_type="all_gather"``: gather every rank's keys and values, then attend locally.

Forward: one all-gather of the local keys and values over the context parallel group,
reordered from rank layout into sequence order; each local query chunk ``k`` then attends
to the keys of chunks ``0 .. k-1`` (one unmasked block) and to chunk ``k`` (causal), merged
exactly (``blocks``). Nothing runs while the gather is in flight (synchronous, as SMP
documents this variant).

Backward: the keys and values are gathered again rather than kept from the forward pass
(keeping them would cost the whole sequence's keys and values per layer, the memory that
context parallelism exists to save). The gradients of the whole sequence's keys and
values are then summed onto their owners with one reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker.context_parallel.blocks import (
    autocast_off,
    block_backward,
    block_forward,
    merge_into,
)
from torch_sagemaker.context_parallel.comm import all_gather_stacked, reduce_scatter_stacked
from torch_sagemaker.context_parallel.layout import chunks_of_rank, merge_locals, split_local

_SEQ_DIM = 3  # of the packed (2, b, kv_h, n, d) key/value tensor


def _gather_sequence(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keys and values of the whole sequence, in sequence order: ``(2, b, kv_h, S, d)``."""
    gathered = all_gather_stacked(torch.stack([k, v]), group)
    return merge_locals(list(gathered.unbind(0)), dim=_SEQ_DIM)


def _query_chunks(q: torch.Tensor, group: dist.ProcessGroup) -> list[tuple[slice, int, int]]:
    """``(local rows, chunk index, chunk length)`` of each of the two local query chunks."""
    c = q.shape[2] // 2
    chunks = chunks_of_rank(dist.get_rank(group), dist.get_world_size(group))
    return [(slice(half * c, (half + 1) * c), chunk, c) for half, chunk in enumerate(chunks)]


def allgather_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the local queries over the gathered sequence.

    Returns:
        ``(out, lse)`` as ``ring.ring_forward``.
    """
    full = _gather_sequence(k, v, group)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows, chunk, c in _query_chunks(q, group):
        diag = slice(chunk * c, (chunk + 1) * c)
        blk_out, blk_lse = block_forward(
            q[:, :, rows], full[0, :, :, diag], full[1, :, :, diag], causal=True, scale=scale
        )
        out[:, :, rows], lse[:, :, rows] = blk_out.float(), blk_lse
        if chunk:
            prefix = slice(0, chunk * c)
            blk_out, blk_lse = block_forward(
                q[:, :, rows],
                full[0, :, :, prefix],
                full[1, :, :, prefix],
                causal=False,
                scale=scale,
            )
            merge_into(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)
    return out.to(q.dtype), lse


def allgather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``allgather_forward``.

    Returns:
        ``(dq, dk, dv)`` in the dtypes and shapes of ``q``, ``k`` and ``v``.
    """
    full = _gather_sequence(k, v, group)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dfull = torch.zeros(full.shape, dtype=torch.float32, device=full.device)
    for rows, chunk, c in _query_chunks(q, group):
        args = (dout[:, :, rows], q[:, :, rows])
        stats = (out[:, :, rows], lse[:, :, rows])
        diag = slice(chunk * c, (chunk + 1) * c)
        g = block_backward(
            *args, full[0, :, :, diag], full[1, :, :, diag], *stats, causal=True, scale=scale
        )
        dq[:, :, rows] = g[0]
        dfull[0, :, :, diag] += g[1]
        dfull[1, :, :, diag] += g[2]
        if chunk:
            prefix = slice(0, chunk * c)
            g = block_backward(
                *args,
                full[0, :, :, prefix],
                full[1, :, :, prefix],
                *stats,
                causal=False,
                scale=scale,
            )
            dq[:, :, rows] += g[0]
            dfull[0, :, :, prefix] += g[1]
            dfull[1, :, :, prefix] += g[2]
    cp = dist.get_world_size(group)
    by_rank = torch.stack([split_local(dfull, r, cp, dim=_SEQ_DIM) for r in range(cp)])
    own = reduce_scatter_stacked(by_rank, group)
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class AllGatherAttention(torch.autograd.Function):
    """Autograd wrapper of ``allgather_forward``/``allgather_backward``.

    Returns ``(b, h, 2c, d)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        scale: float,
    ) -> torch.Tensor:
        """Attention output of the local queries; saves what backward needs.

        ``q``, ``k`` and ``v`` share one dtype (``blocks.attention_inputs``); autocast is off
        inside (Note [Context parallel attention under autocast]).
        """
        with autocast_off(q.device.type):
            out, lse = allgather_forward(q, k, v, group, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        """Gradients of ``q``, ``k``, ``v`` (none for ``group`` and ``scale``)."""
        q, k, v, out, lse = ctx.saved_tensors
        with autocast_off(q.device.type):
            dq, dk, dv = allgather_backward(
                dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.scale
            )
        return dq, dk, dv, None, None


__all__ = ["AllGatherAttention", "allgather_backward", "allgather_forward"]
