"""The causal LM loss of a context parallel rank: labels shifted across chunk boundaries.

Note [Context parallel loss]
Without context parallelism the loss of a sequence of ``S`` tokens is
``sum_{p < S-1} CE(logits_p, labels_{p+1}) / N`` with ``N`` the number of targets that are
not ``ignore_index``. Rank ``r`` holds the logits and labels of chunks ``r`` and
``2cp-1-r``. The target of the last token of chunk ``k`` is the first label of chunk
``k+1``, held by another rank (or by this rank's other chunk, for ``k = cp - 1``), and the
last token of chunk ``2cp-1`` (rank 0's end) predicts nothing. Shifting inside the local
concatenation, as Hugging Face's loss does, would pair chunk ``r``'s last token with chunk
``2cp-1-r``'s first and drop ``cp`` real targets.

So each rank contributes, in one ``all_gather`` over the context parallel group of
``2 * batch + 1`` integers, the first label of each of its chunks and its number of
counted targets (its non-ignored labels, minus global position 0, which is nobody's
target). Every rank then builds its correctly shifted labels and knows the global count
``N``, and returns

    loss_r = cp * (sum of its token losses) / N

so that the **mean over the context parallel group of the per-rank losses is exactly the
single-process loss** (what SMP's script logs) and, since FSDP averages gradients over its
shard group, which contains the context parallel ranks, **the averaged gradients are
exactly the single-process gradients** (the gradients of ``sum_r loss_r / cp``, with the
cross-rank attention terms returned by the attention backward).

``num_items_in_batch``, when the caller passes it (gradient accumulation), is taken to
count the targets of the whole, unsplit sequences, the value one would pass without
context parallelism, and replaces ``N``. ``shift_labels``, when passed, are taken to be
shifted on the whole sequence before splitting (then correct as given) and only the
normalisation is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker.context_parallel.comm import all_gather_stacked
from torch_sagemaker.context_parallel.layout import (
    check_local_length,
    chunks_of_rank,
    owner_of_chunk,
)


def shift_labels_across_ranks(
    labels: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's next-token targets and the group's target count (Note [Context parallel loss]).

    Args:
        labels: Local labels ``(b, 2c)`` (chunks ``r`` and ``2cp-1-r``).
        group: The context parallel group (a collective: every rank calls it).
        ignore_index: Label value that is no target.

    Returns:
        ``(shift_labels, count)``: targets ``(b, 2c)`` and the number of counted targets
        over the group (0-dim int64).
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n = labels.shape
    c = check_local_length(n, cp)
    counted = labels != ignore_index
    count = counted.sum()
    if rank == 0:
        count = count - counted[:, 0].sum()  # global position 0 is no token's target
    packet = torch.cat([labels[:, 0], labels[:, c], count.reshape(1)]).to(torch.int64)
    gathered = all_gather_stacked(packet, group)
    firsts = gathered[:, : 2 * b].reshape(cp, 2, b)  # [rank, half, row]
    shifted = torch.empty_like(labels)
    for half, chunk in enumerate(chunks_of_rank(rank, cp)):
        start = half * c
        shifted[:, start : start + c - 1] = labels[:, start + 1 : start + c]
        if chunk + 1 < 2 * cp:
            owner, owner_half = owner_of_chunk(chunk + 1, cp)
            shifted[:, start + c - 1] = firsts[owner, owner_half].to(labels.dtype)
        else:
            shifted[:, start + c - 1] = ignore_index
    return shifted, gathered[:, -1].sum()


def context_parallel_loss(
    inner: Callable[..., torch.Tensor], group: dist.ProcessGroup
) -> Callable[..., torch.Tensor]:
    """Wraps a causal LM loss function (``ForCausalLMLoss`` signature) for context parallelism.

    Args:
        inner: The model's loss function (Hugging Face's, or the vocabulary-parallel one).
        group: The context parallel group.

    Returns:
        A loss function with the same signature returning ``cp * local sum / N``.
    """
    cp = dist.get_world_size(group)

    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            assert labels is not None, "the loss needs labels or shift_labels"
            shift_labels, count = shift_labels_across_ranks(labels, group, ignore_index)
        else:
            count = (shift_labels != ignore_index).sum().to(torch.int64)
            dist.all_reduce(count, group=group)
        total = num_items_in_batch if num_items_in_batch is not None else count
        # inner returns (local sum) / N; times cp is this rank's share of the mean.
        return cp * inner(
            logits,
            labels,
            vocab_size,
            num_items_in_batch=total,
            ignore_index=ignore_index,
            shift_labels=shift_labels,
            **kwargs,
        )

    loss.__wrapped__ = inner  # type: ignore[attr-defined]
    return loss


__all__ = ["context_parallel_loss", "shift_labels_across_ranks"]
