"""``global_token_shuffle``: the tokens of an EP group dealt out randomly over its ranks.

Tokens of one sequence are correlated, so a rank's tokens are a biased sample for the
batch-level balancing methods (Sinkhorn, balanced assignment, the auxiliary loss). BASE
layers therefore send each token to a random worker before routing. Here every rank draws
a random permutation of its N tokens, sends an even share (sizes differ by at most one) to
each rank of the EP group by all-to-all, routes and computes the MoE layer on what it
received, and the outputs travel back the same way and are put back in order. The shuffle
changes no token's own result, only the sample each rank balances over.

Note [Token shuffle under recomputation]: activation checkpointing runs the layer's forward
again during backward, and the recompute must deal out the tokens exactly as the first pass
did, or the recomputed tensors would not belong to the tokens of that pass. Several forwards
may run before one backward (micro-batches summed into one loss), so "the last permutation"
is not the right one to replay. The permutation is therefore a function of state that
``torch.utils.checkpoint`` itself saves and restores: each shuffle draws one number from
torch's global CPU generator, adds the rank's ``seed`` (``random_seed + ep_rank``, so the
ranks of a group, whose global generators are usually seeded alike, deal differently) and
draws the permutation from a generator seeded with the sum. Checkpointing (reentrant and
non-reentrant, with ``preserve_rng_state=True``, its default and what SMP's scripts use)
sets the global CPU generator back to its state at the start of the checkpointed region
before recomputing it, so the recompute draws the same number, whichever forward it
replays and in whatever order the backward reaches them. The cost is one draw from the
global CPU generator per MoE layer and forward: code that draws from it afterwards gets
other numbers than without the shuffle (GPU dropout uses the device's generator and is
unaffected). With ``preserve_rng_state=False`` the recompute draws a fresh number and deals
the tokens differently from the first pass: the gradients are then wrong, as they are for
dropout, so the shuffle needs the default.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from torch_sagemaker.moe import collectives as coll


class Shuffled(NamedTuple):
    """What ``TokenShuffle.unshuffle`` needs to undo a shuffle."""

    perm: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]


# Spreads consecutive rank seeds over the 64-bit range before they are added to the draw.
_SEED_SPREAD = 0x9E3779B97F4A7C15


def permutation(n: int, seed: int) -> torch.Tensor:
    """A random permutation of ``range(n)`` (Note [Token shuffle under recomputation]).

    Draws one number from torch's global CPU generator (advancing it) and seeds the
    permutation with it and ``seed``: the same global generator state and seed give the
    same permutation.

    Args:
        n: Number of rows.
        seed: The rank's seed (``random_seed + ep_rank``).

    Returns:
        A CPU ``int64`` tensor holding a permutation of ``range(n)``.
    """
    draw = int(torch.randint(0, 2**63 - 1, ()))
    generator = torch.Generator().manual_seed((draw + seed * _SEED_SPREAD) % 2**64)
    return torch.randperm(n, generator=generator)


class TokenShuffle:
    """Random exchange of token rows within the EP group (one instance per MoE layer).

    Args:
        group: The expert parallel group.
        seed: The rank's seed of the permutations (``random_seed + ep_rank``).
    """

    def __init__(self, group: dist.ProcessGroup, seed: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.seed = seed

    def shuffle(self, x: torch.Tensor) -> tuple[torch.Tensor, Shuffled]:
        """Rows of ``x`` (N, H) permuted and dealt to the group; returns the rows received."""
        n = x.shape[0]
        perm = permutation(n, self.seed).to(x.device)
        base, extra = divmod(n, self.size)
        send_rows = [base + (j < extra) for j in range(self.size)]
        counts = torch.tensor(send_rows, dtype=torch.long, device=x.device)
        recv_rows = coll.checked_counts(
            coll.exchange_counts(counts, self.group), "shuffled token counts"
        )
        shuffled = Shuffled(perm, send_rows, recv_rows)
        return self.move(x, shuffled), shuffled

    def move(self, t: torch.Tensor, shuffled: Shuffled) -> torch.Tensor:
        """Rows of ``t`` (N, ...) sent where ``shuffle`` sent the rows of its ``x``.

        Row ``i`` of the result belongs to the same token as row ``i`` of the rows that
        ``shuffle`` returned; the gradient goes back to ``t`` by the reverse exchange.
        """
        return coll.all_to_all_rows(
            t[shuffled.perm], shuffled.recv_rows, shuffled.send_rows, self.group
        )

    def unshuffle(self, y: torch.Tensor, shuffled: Shuffled) -> torch.Tensor:
        """Inverse of ``shuffle`` for the outputs of the received rows."""
        back = coll.all_to_all_rows(y, shuffled.send_rows, shuffled.recv_rows, self.group)
        return back[torch.argsort(shuffled.perm)]


__all__ = ["Shuffled", "TokenShuffle", "permutation"]
