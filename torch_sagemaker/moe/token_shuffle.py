"""``global_token_shuffle``: the tokens of an EP group dealt out randomly over its ranks.

Tokens of one sequence are correlated, so a rank's tokens are a biased sample for the
batch-level balancing methods (Sinkhorn, balanced assignment, the auxiliary loss). BASE
layers therefore send each token to a random worker before routing. Here every rank draws
a random permutation of its N tokens, sends an even share (sizes differ by at most one) to
each rank of the EP group by all-to-all, routes and computes the MoE layer on what it
received, and the outputs travel back the same way and are put back in order. The shuffle
changes no token's own result, only the sample each rank balances over.

Note [Token shuffle under recomputation]: activation checkpointing runs the layer's forward
again during backward; it must see the same permutation, or the recomputed tensors would
not belong to the tokens of the first pass. A draw made while autograd is executing a
backward (``torch._C._current_graph_task_id() != -1``, true for reentrant and non-reentrant
recomputation) reuses the layer's last forward permutation instead of drawing a new one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from torch_sagemaker._torch_compat import autograd as autograd_compat
from torch_sagemaker.moe import collectives as coll


class Shuffled(NamedTuple):
    """What ``TokenShuffle.unshuffle`` needs to undo a shuffle."""

    perm: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]


class TokenShuffle:
    """Random exchange of token rows within the EP group (one instance per MoE layer).

    Args:
        group: The expert parallel group.
        generator: Source of the permutations (seeded with ``random_seed + ep_rank``).
    """

    def __init__(self, group: dist.ProcessGroup, generator: torch.Generator) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.generator = generator
        self._last_perm: torch.Tensor | None = None

    def _permutation(self, n: int) -> torch.Tensor:
        recomputing = autograd_compat.current_graph_task_id() != -1
        if recomputing and self._last_perm is not None and self._last_perm.numel() == n:
            return self._last_perm
        self._last_perm = torch.randperm(n, generator=self.generator)
        return self._last_perm

    def shuffle(self, x: torch.Tensor) -> tuple[torch.Tensor, Shuffled]:
        """Rows of ``x`` (N, H) permuted and dealt to the group; returns the rows received."""
        n = x.shape[0]
        perm = self._permutation(n).to(x.device)
        base, extra = divmod(n, self.size)
        send_rows = [base + (j < extra) for j in range(self.size)]
        counts = torch.tensor(send_rows, dtype=torch.long, device=x.device)
        recv_rows = coll.checked_counts(
            coll.exchange_counts(counts, self.group), "shuffled token counts"
        )
        y = coll.all_to_all_rows(x[perm], recv_rows, send_rows, self.group)
        return y, Shuffled(perm, send_rows, recv_rows)

    def unshuffle(self, y: torch.Tensor, shuffled: Shuffled) -> torch.Tensor:
        """Inverse of ``shuffle`` for the outputs of the received rows."""
        back = coll.all_to_all_rows(y, shuffled.send_rows, shuffled.recv_rows, self.group)
        return back[torch.argsort(shuffled.perm)]


__all__ = ["Shuffled", "TokenShuffle"]
