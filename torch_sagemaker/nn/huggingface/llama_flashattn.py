"""``LlamaFlashAttention`` (``torch.sagemaker.nn.huggingface.llama_flashattn``).

SMP's example scripts (with transformers < 4.37.1) swap every ``LlamaAttention`` of a model
for ``LlamaFlashAttention(model.config)`` and copy the q/k/v/o weights over. Here it is
transformers' own ``LlamaAttention`` (same parameters, same call signature, same RoPE) whose
attention step runs ``FlashGroupedQueryAttention`` instead of the implementation the
model's config names. Key/value caches (generation) work as in ``LlamaAttention`` when the
module knows its ``layer_idx``; SMP's scripts build it without one and train with
``use_cache=False``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from torch_sagemaker.nn.attn import FlashGroupedQueryAttention


class LlamaFlashAttention(LlamaAttention):
    """Drop-in ``LlamaAttention`` running ``FlashGroupedQueryAttention``.

    Args:
        config: The model's ``LlamaConfig``.
        layer_idx: Index of the layer, needed only with a key/value cache (SMP's scripts do
            not pass it).
    """

    def __init__(self, config: Any, layer_idx: int | None = None) -> None:
        # transformers annotates layer_idx as an int; None serves models without a KV cache.
        super().__init__(config, layer_idx)  # type: ignore[arg-type]
        self.pretraining_tp = getattr(config, "pretraining_tp", 1)  # SMP's scripts set it
        self.flash = FlashGroupedQueryAttention(
            attention_dropout_prob=cast(float, self.attention_dropout), scale=self.scaling
        )

    # transformers up to 5.23 annotates the attention weights as a Tensor, though its own SDPA
    # and flash paths return None there too; later releases accept this override.
    def forward(  # type: ignore[override, unused-ignore]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Same inputs and outputs as ``LlamaAttention.forward`` (no attention weights).

        Raises:
            ValueError: With a key/value cache when the module was built without ``layer_idx``.
        """
        batch, seq = hidden_states.shape[:2]
        q = self.q_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        assert position_embeddings is not None  # Hugging Face's decoder layers pass them
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # transformers 5.24 renamed the decoder layers' ``past_key_values`` argument ``cache``.
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            if self.layer_idx is None:
                raise ValueError(
                    "LlamaFlashAttention(config) was built without layer_idx, so it "
                    "cannot use a key/value cache: set config.use_cache=False (as "
                    "SMP's scripts do) or build it with layer_idx=<layer number>."
                )
            k, v = cache.update(k, v, self.layer_idx)
        mask = attention_mask[..., :seq, : k.shape[2]] if attention_mask is not None else None
        # Without a mask Hugging Face relies on causal attention, or on a single new token
        # (decoding) that sees every cached one.
        causal = mask is None and seq > 1
        self.flash.dropout_p = cast(float, self.attention_dropout)  # a number from the config
        out = self.flash(q, (k, v), causal=causal, layout="b h s d", attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out), None


__all__ = ["LlamaFlashAttention"]
