"""The attention function a context parallel model runs, registered with Hugging Face.

Note [Context parallel attention dispatch]
Hugging Face attention modules (all five supported families) compute q/k/v and RoPE
themselves and then call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``
with ``(module, q, k, v, mask, scaling=..., dropout=..., **kwargs)``. ``tsm.transform``
registers ``context_parallel_attention`` there under ``ATTENTION_NAME`` and points the
model's config at it, whatever implementation the model was built with ("eager", "sdpa",
...). That is the library's documented extension point: the families' own projection and
RoPE code runs unchanged (no forward is replaced, no model code is copied) and the
transformed model always runs our path. The alternative, swapping each attention module's
forward, would have meant re-implementing every family's projections. A side benefit: mask
creation is skipped for implementations the mask registry does not know, so no
``S x S`` mask is built; causality is implied by the zigzag layout.

Which group and which communication a module uses is stored on the module itself
(``CP_ATTR``, set by ``tsm.transform`` on the policy's attention modules), so the function
is stateless and a module that was not transformed fails loudly instead of running local
attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_sagemaker.context_parallel.allgather import AllGatherAttention
from torch_sagemaker.context_parallel.blocks import attention_inputs
from torch_sagemaker.context_parallel.comm import Ring
from torch_sagemaker.context_parallel.ring import RingAttention

#: The name under which the attention function is registered with Hugging Face.
ATTENTION_NAME = "tsm_context_parallel"
#: Attribute holding a module's ``ContextParallelAttention``.
CP_ATTR = "_tsm_context_parallel"
COMM_TYPES = ("p2p", "all_gather")


@dataclass
class ContextParallelAttention:
    """How one attention module attends across the context parallel group.

    Attributes:
        group: The context parallel process group.
        comm_type: ``"p2p"`` (ring of key/value blocks) or ``"all_gather"``.
    """

    group: dist.ProcessGroup
    comm_type: str

    def __post_init__(self) -> None:
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"cp_comm_type={self.comm_type!r}; use one of {COMM_TYPES}.")
        self._ring = Ring(self.group) if self.comm_type == "p2p" else None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Causal attention of local ``(b, h, 2c, d)`` queries over the whole sequence.

        The inputs are first brought to the dtype the model's own attention would compute in
        (Note [Context parallel attention under autocast] in ``blocks``), which is also the
        dtype of the output.
        """
        q, k, v = attention_inputs(q, k, v)
        if self._ring is not None:
            return RingAttention.apply(q, k, v, self._ring, scale)
        return AllGatherAttention.apply(q, k, v, self.group, scale)


#: Keywords of Hugging Face's attention interface that change the scores or the softmax
#: (Gemma 2's logit soft-cap, gpt-oss's attention sinks); the others (positions, causality
#: flags) this attention has no use for.
_SCORE_KEYWORDS = ("softcap", "s_aux")


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention interface: causal attention over the context parallel group.

    Args:
        module: The calling attention module (carries ``CP_ATTR``).
        query: ``(b, heads, local_len, d)``, already rotated with the global positions.
        key: ``(b, kv_heads, local_len, d)``.
        value: ``(b, kv_heads, local_len, d)``.
        attention_mask: Must be ``None`` (the pre-forward check turns an all-ones mask into
            ``None`` and refuses any other).
        scaling: Score scale; default ``1 / sqrt(d)``.
        dropout: Attention dropout; only 0 is supported.
        sliding_window: Must be ``None``.
        **kwargs: Other Hugging Face keywords (``position_ids``, ...), ignored; a soft-cap
            or attention sinks (``_SCORE_KEYWORDS``) are refused.

    Returns:
        ``(output (b, local_len, heads, d), None)``; attention weights are never formed.

    Raises:
        RuntimeError: If ``module`` was not prepared by ``tsm.transform``.
        ValueError: For a mask, dropout, a sliding window, non-causal attention, a soft-cap
            or attention sinks.
    """
    plan: ContextParallelAttention | None = getattr(module, CP_ATTR, None)
    if plan is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the {ATTENTION_NAME!r} attention but was not prepared "
            "by tsm.transform; context parallel attention needs the model to go through "
            "tsm.transform(model) after tsm.init(context_parallel_degree > 1)."
        )
    if attention_mask is not None:
        raise ValueError(
            "context parallel attention is causal over the whole sequence and takes "
            "no attention mask; pass attention_mask=None (mask padding with label "
            "-100)."
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported with context parallelism; "
            "set the config's attention_dropout to 0."
        )
    if sliding_window is not None:
        raise ValueError(
            f"sliding-window attention (window {sliding_window}) is not supported "
            "with context parallelism; set config.sliding_window = None."
        )
    if kwargs.get("is_causal") is False:
        raise ValueError("context parallel attention is causal; is_causal=False is not supported.")
    changing = {k: kwargs[k] for k in _SCORE_KEYWORDS if kwargs.get(k) is not None}
    if changing:
        raise ValueError(
            f"context parallel attention does not apply {sorted(changing)}: it computes plain "
            "softmax attention. Models whose attention uses a logit soft-cap (softcap) or "
            "attention sinks (s_aux) are not supported with context_parallel_degree > 1."
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = plan.attend(query, key, value, scale)
    return out.transpose(1, 2), None


def register() -> None:
    """Registers ``context_parallel_attention`` with Hugging Face (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)


__all__ = [
    "ATTENTION_NAME",
    "COMM_TYPES",
    "CP_ATTR",
    "ContextParallelAttention",
    "context_parallel_attention",
    "register",
]
