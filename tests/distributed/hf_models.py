"""Tiny Hugging Face models and data shared by the distributed parity tests (no downloads)."""

from __future__ import annotations

import torch

SEQ = 16
VOCAB = 256


def tiny_llama(seed: int = 0, **overrides):
    """A 2-layer Llama (GQA) in fp32, identical for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               tie_word_embeddings=False, attn_implementation="eager")
    cfg.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg)).float()


def global_batches(steps: int, global_batch: int, seed: int = 1) -> list[torch.Tensor]:
    """``steps`` batches of token ids, shape (global_batch, SEQ)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen) for _ in range(steps)]


def rank_slice(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """The rows of ``batch`` that data-parallel rank ``dp_rank`` trains on."""
    per_rank = batch.shape[0] // dp_size
    return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def reference_run(steps: int, global_batch: int, lr: float = 0.1, max_norm: float = 1.0):
    """Single-process training on the global batches: losses, grad norms, final parameters."""
    model = tiny_llama()
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for batch in global_batches(steps, global_batch):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}
