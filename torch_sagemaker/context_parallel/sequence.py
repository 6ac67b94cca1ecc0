"""Splitting whole sequences for the context parallel ranks, and gathering them back.

``split_sequence`` is what a training script applies to each batch when
``context_parallel_degree > 1`` (the same layout as SMP's ``get_batch_for_cp_rank``);
``gather_sequence`` reassembles per-rank tensors (logits, hidden states) in sequence
order, e.g. to inspect or compare them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_sagemaker.context_parallel.layout import merge_locals, split_local
from torch_sagemaker.state import state


def split_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's part of whole sequences: chunks ``r`` and ``2cp-1-r`` of ``2cp`` along ``dim``.

    Returns ``tensor`` itself when context parallelism is off.

    Args:
        tensor: Whole sequences, e.g. ``(batch, seq)`` token ids or labels.
        dim: The sequence dimension.

    Raises:
        ValueError: If the length along ``dim`` is not divisible by ``2 * cp``.

    Example:
        >>> input_ids = split_sequence(batch["input_ids"])
        >>> loss = model(input_ids=input_ids, attention_mask=None, labels=input_ids)["loss"]
    """
    cp = state.cp_size
    if cp == 1:
        return tensor
    return split_local(tensor, state.cp_rank, cp, dim=dim)


def gather_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Every context parallel rank's part of ``tensor``, reassembled in sequence order (no grad).

    A collective over ``tsm.state.cp_process_group``. A DTensor (e.g. vocabulary-sharded
    logits) is gathered to its full value first.

    Args:
        tensor: This rank's part (same shape on every rank of the group).
        dim: The sequence dimension.

    Returns:
        The whole-sequence tensor, the same on every rank of the group.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    tensor = tensor.detach().contiguous()
    cp = state.cp_size
    if cp == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(cp)]
    dist.all_gather(parts, tensor, group=state.cp_process_group)
    return merge_locals(parts, dim=dim)


__all__ = ["gather_sequence", "split_sequence"]
