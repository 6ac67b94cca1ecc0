"""Attention on one (query block, key/value block) pair, and the exact merge of partial results.

Context parallel attention computes softmax attention over key/value blocks that arrive
one at a time (ring) or are split by position (all-gather). Each block yields a partial
output ``o_b`` and the row-wise log-sum-exp ``lse_b`` of its scaled scores; two partials
combine exactly (online softmax)::

    lse = log(exp(lse_1) + exp(lse_2))
    o   = o_1 * exp(lse_1 - lse) + o_2 * exp(lse_2 - lse)

See Note [Block backward with the final statistics] for why the backward of a block only
needs the *final* ``o`` and ``lse``.

Shapes: queries ``(batch, heads, q_len, head_dim)``, keys and values
``(batch, kv_heads, k_len, head_dim)`` with ``heads`` a multiple of ``kv_heads``
(grouped-query attention: query head ``i`` uses kv head ``i // (heads / kv_heads)``, Hugging
Face's ``repeat_kv`` order). ``lse`` is ``(batch, heads, q_len)`` in fp32.

Two kernels:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, the flash
  kernel ``F.scaled_dot_product_attention`` runs on CPU. It returns the log-sum-exp, takes
  grouped kv heads natively, never materialises the score matrix and its backward accepts
  an output and log-sum-exp computed elsewhere, which is all that exact merging needs.
- Any other device (or an empty block): ``math``, the same computation with explicit
  fp32 score matrices. Exact, portable, memory ``O(q_len * k_len)`` per block.

Note [Block backward with the final statistics]
With ``P_b = exp(s_b - lse)`` the rows of block ``b`` of the *final* softmax (``lse`` the
final log-sum-exp), the gradients of the whole attention restricted to block ``b`` are
``dV_b = P_b^T dO``, ``dS_b = P_b * (dO V_b^T - D)`` with ``D = rowsum(dO * O)`` (``O`` the
final output), ``dQ += dS_b K_b * scale`` and ``dK_b = dS_b^T Q * scale``. These are exactly
what a flash-attention backward computes when it is given the final ``O`` and ``lse``
instead of the block's own, so each block's backward is one kernel call and the block
gradients simply add up. No block result needs to be kept from the forward pass.

Note [Context parallel attention under autocast]
Under ``torch.autocast`` the attention inputs a Hugging Face module produces have mixed
dtypes: the projections run in the autocast dtype, but RoPE multiplies queries and keys by
``cos``/``sin`` in the dtype of the hidden states, which autocast leaves in fp32, so ``q``
and ``k`` come out fp32 while ``v`` stays bf16. The model's own attention copes because
autocast handles it: ``F.scaled_dot_product_attention`` is on autocast's lower-precision
list (on CPU and CUDA), so all three are cast to the autocast dtype and the kernel runs in
it; the eager implementation runs both of its matmuls in that dtype too (with an fp32
softmax). The kernels here are called as ``aten`` ops inside an ``autograd.Function``, which
autocast does not rewrite, and the CPU flash kernel refuses mixed dtypes. So
``attention_inputs`` does what autocast does for SDPA, before the ``autograd.Function``: with
autocast enabled for the inputs' device, every input is cast to autocast's dtype; otherwise
the inputs are cast to their promoted dtype, which leaves inputs of one dtype untouched (the
fp32 path and FSDP's bf16 mixed precision are unchanged, bit for bit). The casts are
recorded by autograd, so the gradients reach q, k and v in their own dtypes. Inside the
forward and backward of the ``autograd.Function`` autocast is turned off (``autocast_off``):
the math kernel's explicit fp32 scores would otherwise be computed in bf16 by autocast's
``matmul``, and a backward run inside an autocast region would not use the dtypes the
forward used.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from torch_sagemaker._torch_compat import aten

_FLASH_CPU = aten.FLASH_ATTENTION_CPU
_FLASH_CPU_BACKWARD = aten.FLASH_ATTENTION_CPU_BACKWARD


def attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k`` and ``v`` in the one dtype the model's own attention would compute in.

    Note [Context parallel attention under autocast]: autocast's dtype for the inputs'
    device when autocast is enabled there, else the promoted dtype of the three. Inputs
    already in that dtype are returned as they are.
    """
    device_type = q.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = functools.reduce(torch.promote_types, (k.dtype, v.dtype), q.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context in which autocast leaves ``device_type``'s ops alone.

    Used around the block computations (Note [Context parallel attention under autocast]);
    a device type autocast does not know (``meta``) gets a no-op context.
    """
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _use_flash(q: torch.Tensor, k: torch.Tensor) -> bool:
    # The CPU kernel divides by zero on empty inputs; those go to the math kernel.
    return q.device.type == "cpu" and q.numel() > 0 and k.numel() > 0


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(b, heads, n, d)`` viewed as ``(b, kv_heads, heads / kv_heads, n, d)``."""
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """fp32 scaled scores ``(b, kv_heads, groups, q_len, k_len)``, causally masked if asked."""
    s = torch.matmul(_grouped(q.float(), k.shape[1]), k.float().unsqueeze(2).transpose(-1, -2))
    s = s * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one key/value block.

    Args:
        q: Queries ``(b, h, q_len, d)``.
        k: Keys ``(b, kv_h, k_len, d)``.
        v: Values ``(b, kv_h, k_len, d)``.
        causal: Mask key ``j`` for query ``i`` when ``j > i`` (only for square diagonal blocks).
        scale: Score scale (``1 / sqrt(d)`` for standard attention).

    Returns:
        ``(out, lse)``: ``out`` ``(b, h, q_len, d)`` in ``q.dtype``, ``lse`` ``(b, h, q_len)`` fp32.
    """
    if _use_flash(q, k):
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.float().unsqueeze(2))
    b, h, n, d = q.shape
    return out.reshape(b, h, n, d).to(q.dtype), lse.reshape(b, h, n)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the block's share of an attention whose final output is ``out``.

    ``out`` and ``lse`` are the *final* (merged) output and log-sum-exp of the rows of
    ``q`` (Note [Block backward with the final statistics]).

    Returns:
        ``(dq, dk, dv)`` in the shapes of ``q``, ``k`` and ``v`` (``dk``/``dv`` summed over
        the query heads sharing each kv head).
    """
    if _use_flash(q, k):
        return _FLASH_CPU_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    kv_heads = k.shape[1]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), kv_heads))
    do = _grouped(dout.float(), kv_heads)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
    delta = (do * _grouped(out.float(), kv_heads)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.float().unsqueeze(2)).reshape(q.shape)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.float(), kv_heads)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merges a block's partial result into the fp32 accumulators ``out`` and ``lse`` in place.

    Args:
        out: ``(b, h, n, d)`` fp32 accumulated output (rows may be a slice of a larger tensor).
        lse: ``(b, h, n)`` fp32 accumulated log-sum-exp.
        block_out: The block's output for the same rows.
        block_lse: The block's log-sum-exp for the same rows.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


__all__ = [
    "attention_inputs",
    "autocast_off",
    "block_backward",
    "block_forward",
    "merge_into",
]
