"""SMP's fused attention modules (``torch.sagemaker.nn.attn``), on ``scaled_dot_product_attention``.

SMP 2.x shipped these around FlashAttention kernels for scripts written before
transformers had ``attn_implementation="flash_attention_2"``; SMP's scripts still reach them
with transformers < 4.37.1. Here both run ``torch.nn.functional.scaled_dot_product_attention``
(PyTorch picks its flash, memory-efficient or math kernel for the device), with SMP's
signatures and tensor layouts:

- layout ``"b h s d"``: (batch, heads, sequence, head_dim);
- layout ``"b s h d"``: (batch, sequence, heads, head_dim).

The output has the layout of the input. SMP's Triton kernel (``triton_flash_attention``) and
ALiBi are not available: asking for them raises ``NotImplementedError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

_LAYOUTS = ("b h s d", "b s h d")


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {_LAYOUTS}.")


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "b h s d" else t.transpose(1, 2)


def _from_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "b h s d" else t.transpose(1, 2)


def _split_packed(
    packed: torch.Tensor | Sequence[torch.Tensor], parts: int, layout: str, name: str
) -> list[torch.Tensor]:
    """``parts`` tensors from a tuple, or from a tensor whose head dim holds them back to back."""
    if isinstance(packed, (tuple, list)):
        if len(packed) != parts:
            raise ValueError(f"{name} must hold {parts} tensors, got {len(packed)}.")
        return list(packed)
    packed = cast(torch.Tensor, packed)  # not a tuple or list: one packed tensor
    head_dim = 1 if layout == "b h s d" else 2
    if packed.dim() != 4 or packed.shape[head_dim] % parts:
        raise ValueError(
            f"{name} packed as one tensor must be 4-D with its head dimension "
            f"({head_dim}) a multiple of {parts}, got shape {tuple(packed.shape)}."
        )
    return list(packed.chunk(parts, dim=head_dim))


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    cast_dtype: torch.dtype | None,
    layout: str,
) -> torch.Tensor:
    out_dtype = q.dtype
    q, k, v = (_to_bhsd(t, layout) for t in (q, k, v))
    if cast_dtype is not None:
        q, k, v = (t.to(cast_dtype) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(
                f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads."
            )
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if attn_mask is not None and causal:
        # SDPA takes one of the two: fold the causal triangle into the mask.
        triangle = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        attn_mask = (
            (attn_mask & triangle)
            if attn_mask.dtype == torch.bool
            else attn_mask.masked_fill(~triangle, torch.finfo(attn_mask.dtype).min)
        )
        causal = False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal, scale=scale
    )
    return _from_bhsd(out.to(out_dtype), layout)


class FlashSelfAttention(nn.Module):
    """Self attention over packed or separate q, k, v (SMP's ``FlashSelfAttention``).

    Args:
        attention_dropout_prob: Dropout on the attention probabilities (training only).
        scale: Softmax scale; default ``1 / sqrt(head_dim)``.
        triton_flash_attention: SMP's Triton kernel; not available (must be ``False``).
        use_alibi: ALiBi biases; not available (must be ``False``).

    Raises:
        NotImplementedError: For ``triton_flash_attention`` or ``use_alibi``.
    """

    def __init__(
        self,
        attention_dropout_prob: float = 0.0,
        scale: float | None = None,
        triton_flash_attention: bool = False,
        use_alibi: bool = False,
    ) -> None:
        super().__init__()
        if triton_flash_attention or use_alibi:
            raise NotImplementedError(
                "FlashSelfAttention(triton_flash_attention=True / use_alibi=True): SMP's Triton "
                "FlashAttention-v1 kernel and ALiBi are not available here; leave both False "
                "(scaled_dot_product_attention is used)."
            )
        self.dropout_p = attention_dropout_prob
        self.scale = scale

    def forward(
        self,
        qkv: torch.Tensor | Sequence[torch.Tensor],
        attn_mask: torch.Tensor | None = None,
        causal: bool = False,
        cast_dtype: torch.dtype | None = None,
        layout: str = "b h s d",
    ) -> torch.Tensor:
        """Attention of ``qkv``.

        Args:
            qkv: ``(q, k, v)``, or one tensor with q, k and v back to back along the heads
                dimension (``(b, 3h, s, d)`` / ``(b, s, 3h, d)``).
            attn_mask: Optional boolean (True = attend) or additive mask broadcastable to
                ``(b, h, s, s)``.
            causal: Causal masking.
            cast_dtype: Compute in this dtype (the output keeps the input's dtype).
            layout: ``"b h s d"`` or ``"b s h d"``.

        Returns:
            The attention output in ``layout``.
        """
        _check_layout(layout)
        q, k, v = _split_packed(qkv, 3, layout, "qkv")
        return _attend(
            q,
            k,
            v,
            causal=causal,
            attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.scale,
            cast_dtype=cast_dtype,
            layout=layout,
        )


class FlashGroupedQueryAttention(nn.Module):
    """Grouped-query attention: fewer key/value heads than query heads (SMP's module).

    Args:
        attention_dropout_prob: Dropout on the attention probabilities (training only).
        scale: Softmax scale; default ``1 / sqrt(head_dim)``.
    """

    def __init__(self, attention_dropout_prob: float = 0.0, scale: float | None = None) -> None:
        super().__init__()
        self.dropout_p = attention_dropout_prob
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor | Sequence[torch.Tensor],
        causal: bool = False,
        cast_dtype: torch.dtype | None = None,
        layout: str = "b h s d",
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``q`` over ``kv``.

        Args:
            q: Queries, ``h_q`` heads.
            kv: ``(k, v)`` or one tensor with k and v back to back along the heads dimension;
                ``h_q`` must be a multiple of their ``h_kv`` heads.
            causal: Causal masking.
            cast_dtype: Compute in this dtype (the output keeps the input's dtype).
            layout: ``"b h s d"`` or ``"b s h d"``.
            attn_mask: Optional mask, as for ``FlashSelfAttention``.

        Returns:
            The attention output in ``layout``, ``h_q`` heads.
        """
        _check_layout(layout)
        k, v = _split_packed(kv, 2, layout, "kv")
        return _attend(
            q,
            k,
            v,
            causal=causal,
            attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.scale,
            cast_dtype=cast_dtype,
            layout=layout,
        )


__all__ = ["FlashGroupedQueryAttention", "FlashSelfAttention"]
