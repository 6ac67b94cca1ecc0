"""Tiny Hugging Face models and data shared by the distributed parity tests (no downloads)."""

from __future__ import annotations

import torch

SEQ = 16
VOCAB = 256


def tiny_llama(seed: int = 0, **overrides):
    """A 2-layer Llama (GQA) in fp32, identical for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
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


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter of a (wrapped) model, unsharded, under its Hugging Face name.

    Works for FSDP1 (gathered with ``summon_full_params``), FSDP2 / DTensor (``full_tensor``),
    DDP and plain modules; wrapper prefixes are dropped.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    def clean(name: str) -> str:
        name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        return name[len("module.") :] if name.startswith("module.") else name

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {clean(n): p.detach().clone() for n, p in model.named_parameters()}
    return {
        clean(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def bf16_reference_run(
    steps: int, global_batch: int, dp_size: int, lr: float = 0.1, max_norm: float = 1.0
):
    """One process replaying data-parallel bf16 mixed precision on the global batches.

    The recipe of FSDP's ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32,
    buffer_dtype=fp32)``: for each data-parallel rank's rows, a bf16 copy of the fp32 master
    weights (buffers stay fp32) runs forward and backward; the bf16 gradients are averaged
    over the ranks in fp32, clipped and applied to the fp32 masters.

    Returns:
        Losses (mean over ranks), grad norms and final (fp32) parameters, as ``reference_run``.
    """
    master, compute = tiny_llama(), tiny_llama()
    optim = torch.optim.SGD(master.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for batch in global_batches(steps, global_batch):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                c.data = m.detach().to(torch.bfloat16)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        step_loss = 0.0
        for rank in range(dp_size):
            rows = rank_slice(batch, rank, dp_size)
            loss = compute(input_ids=rows, labels=rows, use_cache=False).loss
            loss.backward()
            for g, c in zip(grads, compute.parameters()):
                g += c.grad.float()
                c.grad = None
            step_loss += loss.item() / dp_size
        for m, g in zip(master.parameters(), grads):
            m.grad = g / dp_size
        norms.append(torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm).item())
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses, norms, {n: p.detach().clone() for n, p in master.named_parameters()}
