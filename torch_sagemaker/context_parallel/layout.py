"""The load-balanced ("zigzag") sequence layout of context parallelism, as pure index arithmetic.

A sequence of length ``S`` is cut into ``2 * cp`` chunks of ``c = S / (2 * cp)`` tokens.
Context parallel rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, concatenated::

    cp = 2, S = 8, c = 2      chunks  0 1 | 2 3 | 4 5 | 6 7
                              rank 0: chunks 0 and 3 -> positions 0 1 6 7
                              rank 1: chunks 1 and 2 -> positions 2 3 4 5

Pairing an early chunk with a late one gives every rank the same causal-attention work
(chunk ``k`` attends to ``k + 1`` chunks). This is the layout SMP's example scripts produce
(``get_batch_for_cp_rank``) and the one the transformed model expects.

Nothing here communicates; ``torch_sagemaker.context_parallel.sequence`` builds the
distributed helpers on top.
"""

from __future__ import annotations

import torch


def check_degree(cp: int, rank: int) -> None:
    """Raises ``ValueError`` unless ``0 <= rank < cp``."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context parallel rank {rank} is not in [0, {cp}).")


def chunks_of_rank(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices rank ``rank`` holds: ``(rank, 2 * cp - 1 - rank)``."""
    check_degree(cp, rank)
    return rank, 2 * cp - 1 - rank


def owner_of_chunk(chunk: int, cp: int) -> tuple[int, int]:
    """``(rank, half)``: the rank holding ``chunk``; ``half`` is 0 (its first chunk) or 1."""
    if not 0 <= chunk < 2 * cp:
        raise ValueError(f"chunk {chunk} is not in [0, {2 * cp}).")
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def check_local_length(local_len: int, cp: int) -> int:
    """The chunk length ``c`` for a local sequence of ``local_len`` tokens.

    Raises:
        ValueError: If ``local_len`` is not even (the whole sequence, ``cp * local_len``,
            must split into ``2 * cp`` equal chunks).
    """
    if local_len <= 0 or local_len % 2:
        raise ValueError(
            f"context parallelism: a rank received {local_len} tokens per sequence, so the whole "
            f"sequence has {cp * local_len}, which is not divisible by 2 * context_parallel_degree "
            f"= {2 * cp}. Each sequence must split into {2 * cp} equal chunks, rank r keeping "
            "chunks r and 2*cp-1-r (torch_sagemaker.context_parallel.split_sequence does this): "
            f"pad or cut the sequence length to a multiple of {2 * cp}."
        )
    return local_len // 2


def local_positions(
    rank: int, cp: int, local_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens rank ``rank`` holds (1-D, int64)."""
    c = check_local_length(local_len, cp)
    first, second = chunks_of_rank(rank, cp)
    pos = torch.arange(c, device=device)
    return torch.cat([pos + first * c, pos + second * c])


def split_local(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of whole sequences: chunks ``r`` and ``2cp-1-r`` along ``dim``.

    Raises:
        ValueError: If the length along ``dim`` is not divisible by ``2 * cp``.
    """
    length = tensor.shape[dim]
    if length % (2 * cp):
        raise ValueError(
            f"context parallelism: sequence length {length} (dim {dim}) is not divisible by "
            f"2 * context_parallel_degree = {2 * cp}; pad or cut it to a multiple of {2 * cp}."
        )
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = chunks_of_rank(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def merge_locals(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``split_local``: the whole sequence from every rank's part (in rank order)."""
    cp = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[owner_of_chunk(k, cp)[0]][owner_of_chunk(k, cp)[1]] for k in range(2 * cp)]
    return torch.cat(ordered, dim=dim)


__all__ = [
    "check_local_length",
    "chunks_of_rank",
    "local_positions",
    "merge_locals",
    "owner_of_chunk",
    "split_local",
]
