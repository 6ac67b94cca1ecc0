"""Communication over the context parallel group.

The ring shift, a stacked all-gather and its inverse reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_sagemaker._torch_compat import c10d as c10d_compat


class Ring:
    """The context parallel group as a ring: this rank sends to ``next``, receives from ``prev``.

    Args:
        group: The context parallel process group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, tag: int) -> Transfer:
        """Posts ``send -> next`` and a receive of a tensor like ``send`` from ``prev``."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return Transfer(dist.batch_isend_irecv(ops), send, recv)


class Transfer:
    """One posted ring shift. Holds the send buffer until ``wait`` (a backend's work need not)."""

    _send: torch.Tensor | None  # released by wait

    def __init__(self, works: list[dist.Work], send: torch.Tensor, recv: torch.Tensor) -> None:
        self._works, self._send, self._recv = works, send, recv

    def wait(self) -> torch.Tensor:
        """Waits for both directions; returns the received tensor."""
        for work in self._works:
            work.wait()
        self._works, self._send = [], None
        return self._recv


def all_gather_stacked(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in group-rank order: ``(group size, *tensor.shape)``.

    Gathered into a flat buffer (``all_gather_into_tensor`` concatenates along dim 0, and
    gloo checks that shape exactly).
    """
    size = dist.get_world_size(group)
    flat = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    c10d_compat.all_gather_single(flat, tensor.contiguous().reshape(-1), group=group)
    return flat.view(size, *tensor.shape)


def reduce_scatter_stacked(stacked: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of ``all_gather_stacked``: rank ``r`` gets ``sum over ranks of stacked[r]``.

    Args:
        stacked: ``(group size, *shape)``, one slice per destination rank.
        group: The process group.

    Returns:
        ``(*shape)``, this rank's summed slice.
    """
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    c10d_compat.reduce_scatter_single(out.view(-1), stacked.contiguous().view(-1), group=group)
    return out


__all__ = ["Ring", "Transfer", "all_gather_stacked", "reduce_scatter_stacked"]
