"""The probe's attention for value heads narrower or wider than query heads (latent attention).

Note [Attention with unequal head sizes]
    The probe measures what a family saves with the kernel it runs by default, SDPA, on the
    CPU, and takes that as what the GPU saves. That holds where the CPU has a fused kernel
    for the shapes: its flash kernel saves the inputs, the output and a float32 log-sum-exp
    per head and query, as the GPU's flash, memory-efficient and cuDNN kernels do. Multi-head
    latent attention (DeepSeek V2/V3) has query/key heads of ``nope + rope`` and value heads
    of ``v_head`` elements, and the CPU's flash kernel takes equal sizes only; SDPA then falls
    back to its math path, which saves the float32 scores of every head against every key.
    On a GPU, SDPA runs such shapes in its memory-efficient or cuDNN kernel, which saves no
    scores. So ``FusedAttention`` runs SDPA with unequal head sizes as a function that saves
    what the fused kernels save, computing the same output (SDPA over the values padded to
    the query's head size, the output cut back to the value's), and the memory validation
    runs the same function, so that both count one kernel. As the kernels do, it writes its
    output laid out by query and then head (the model's transpose back to one row per token
    is then a view, and the output projection saves that storage, not a copy), and saves a
    boolean mask as SDPA hands it to them, additive in the query's dtype. Equal head sizes
    run SDPA itself. Which kernel a GPU picks for these shapes was not checked on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, options: dict
) -> torch.Tensor:
    """SDPA's output for a value head size other than the query's (padded, then cut back)."""
    width = value.shape[-1]
    padded = F.pad(value, (0, query.shape[-1] - width)) if width < query.shape[-1] else value
    out = F.scaled_dot_product_attention(query, key, padded, attn_mask=mask, **options)
    return out[..., :width] if width < query.shape[-1] else out


def _log_sum_exp(query: torch.Tensor, key: torch.Tensor, mask: Any, options: dict) -> torch.Tensor:
    """The float32 log-sum-exp of each query's scaled scores (what fused kernels keep)."""
    if options.get("enable_gqa") and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    scale = options.get("scale")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = query.float() @ key.float().transpose(-2, -1) * scale
    if options.get("is_causal"):
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.to(scores.dtype)
    return torch.logsumexp(scores, dim=-1)


class _FusedKernel(torch.autograd.Function):
    """Attention that saves its inputs, output and log-sum-exp, as a fused GPU kernel does."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        options: dict,
    ) -> torch.Tensor:
        # Laid out (batch, query, head, feature), as the fused kernels write it: the model's
        # transpose back to (batch, query, features) is then a view, not a copy.
        out = _attend(query, key, value, mask, options)
        out = (
            out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 else out.contiguous()
        )
        lse = _log_sum_exp(query, key, mask, options)
        ctx.options = options
        ctx.has_mask = mask is not None
        ctx.save_for_backward(query, key, value, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, _out, _lse, *mask = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
            out = _attend(q, k, v, mask[0] if ctx.has_mask else None, ctx.options)
            grads = torch.autograd.grad(out, (q, k, v), grad)
        return (*grads, None, None)


class FusedAttention(torch.overrides.TorchFunctionMode):
    """Runs SDPA with unequal query and value head sizes as ``_FusedKernel`` (Note above)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = {**dict(zip(names, args)), **kwargs}
        query, key, value = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        if (
            query.shape[-1] == value.shape[-1]
            or bound.get("dropout_p", 0.0)
            or (mask is not None and mask.requires_grad)
        ):
            return func(*args, **kwargs)
        options = {
            k: bound[k] for k in ("is_causal", "scale", "enable_gqa") if bound.get(k) is not None
        }
        if mask is not None and mask.dtype == torch.bool:
            # SDPA turns a boolean mask into an additive one of the query's dtype, which is
            # what its kernels save.
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
                ~mask, float("-inf")
            )
        return _FusedKernel.apply(query, key, value, mask, options)


__all__ = ["FusedAttention"]
