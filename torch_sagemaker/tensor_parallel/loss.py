"""Cross entropy on vocabulary-sharded logits, without gathering them.

The LM head of a tensor parallel model returns logits as a DTensor sharded on the last
(vocabulary) dimension. ``vocab_parallel_cross_entropy`` computes the loss from each rank's
slice with three small all-reduces over the TP group (the row maximum, the sum of
exponentials, the target logit; latency-bound, so through ``all_reduce_direct``) and, in
backward, each rank's slice of ``softmax - one_hot(target)`` with no communication. It works
for any vocabulary size,
including sizes the degree does not divide (DTensor's uneven shards: the first ranks hold
``ceil(V / tp)`` entries). Unlike ``torch.distributed.tensor.parallel.loss_parallel`` it
needs no context manager around ``backward()``, so unchanged training loops work.

``causal_lm_loss`` has the signature of Hugging Face's ``ForCausalLMLoss``; ``tsm.transform``
installs it as the model's ``loss_function``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from torch_sagemaker.smddp.direct import all_reduce_direct


def vocab_shard_offset(vocab_size: int, num_shards: int, shard: int) -> int:
    """First vocabulary index of ``shard`` under DTensor's ``Shard`` (``torch.chunk``) split."""
    chunk = -(-vocab_size // num_shards)
    return min(shard * chunk, vocab_size)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy of logits split over the vocabulary (rows x local vocab)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        offset: int,
        ignore_index: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.input_dtype = logits.dtype
        logits = logits.float()  # softmax statistics in fp32, as Hugging Face's loss does
        row_max = (
            logits.max(dim=-1).values
            if logits.shape[-1]
            else torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        )
        all_reduce_direct(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce_direct(sum_exp, group=group)
        local_target = target - offset
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        safe = local_target.masked_fill(~mine, 0)
        picked = (
            shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
            if logits.shape[-1]
            else torch.zeros_like(sum_exp)
        )
        picked = picked.masked_fill(~mine, 0.0)
        all_reduce_direct(picked, group=group)
        ignored = target == ignore_index
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), safe, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        # The saved softmax becomes the gradient in place: one (rows x local vocab) buffer
        # fewer than F.cross_entropy's backward holds, as Megatron's loss does. So a second
        # backward through the same graph (retain_graph=True) has nothing left to read.
        if getattr(ctx, "softmax_used", False):
            raise RuntimeError(
                "the vocabulary-parallel cross entropy was back-propagated twice "
                "(retain_graph=True): its backward turns the saved softmax into the gradient "
                "in place to save memory. Compute the loss again for each backward pass, or "
                "sum the losses and call backward once."
            )
        ctx.softmax_used = True
        softmax, safe, mine, ignored = ctx.saved_tensors
        grad = softmax
        if grad.shape[-1]:
            grad.scatter_add_(-1, safe.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Cross entropy of vocabulary-sharded logits.

    Args:
        logits: DTensor of shape ``(N, V)`` sharded on dim 1 over a 1-D (TP) mesh.
        target: Class indices, shape ``(N,)``, the same on every TP rank.
        ignore_index: Target value that contributes no loss.
        reduction: ``"none"``, ``"sum"`` or ``"mean"`` (over non-ignored targets).

    Returns:
        The loss as a plain tensor, identical on every TP rank.

    Raises:
        ValueError: If ``logits`` is not sharded on its last dim over one mesh axis, a target
            is outside the vocabulary (and not ``ignore_index``), or the reduction is unknown.
    """
    placements = logits.placements
    if len(placements) != 1 or placements[0] != Shard(logits.ndim - 1):
        raise ValueError(
            f"vocab_parallel_cross_entropy expects logits sharded on the last dim over a "
            f"1-D mesh, got placements {placements}."
        )
    mesh = logits.device_mesh
    offset = vocab_shard_offset(logits.shape[-1], mesh.size(), mesh.get_local_rank())
    vocab = logits.shape[-1]
    # A target outside [0, V) would be "mine" on no rank: a finite, wrong loss, where
    # F.cross_entropy raises. One reduction of the targets (a sync on an accelerator).
    outside = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(outside.any()):
        bad = int(target[outside][0])
        raise ValueError(
            f"cross entropy target {bad} is outside the vocabulary [0, {vocab}) and is not "
            f"ignore_index={ignore_index}: label padding with {ignore_index} (or check that "
            "the tokenizer's vocabulary matches the model's)."
        )
    local = logits.to_local()
    loss = _VocabParallelCrossEntropy.apply(local, target, offset, ignore_index, mesh.get_group())
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    raise ValueError(f"reduction={reduction!r}; use 'none', 'sum' or 'mean'.")


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Next-token loss with Hugging Face's ``ForCausalLMLoss`` semantics, on sharded logits.

    Plain-tensor logits fall back to ``F.cross_entropy`` (same result as Hugging Face).

    Args:
        logits: ``(batch, seq, vocab)`` DTensor sharded on the vocabulary, or a tensor.
        labels: ``(batch, seq)`` token ids; shifted left by one unless ``shift_labels``.
        vocab_size: Vocabulary size (checked against the logits).
        num_items_in_batch: If given, the loss is the sum divided by it; else the mean.
        ignore_index: Label value that contributes no loss.
        shift_labels: Already-shifted labels.
        **kwargs: Ignored (Hugging Face passes extra keys).

    Returns:
        The scalar loss.
    """
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} classes but vocab_size={vocab_size}.")
    flat = logits.reshape(-1, vocab_size)
    reduction = "mean" if num_items_in_batch is None else "sum"
    if isinstance(flat, DTensor):
        loss = vocab_parallel_cross_entropy(
            flat, target, ignore_index=ignore_index, reduction=reduction
        )
    else:
        loss = F.cross_entropy(flat.float(), target, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


__all__ = ["causal_lm_loss", "vocab_parallel_cross_entropy", "vocab_shard_offset"]
