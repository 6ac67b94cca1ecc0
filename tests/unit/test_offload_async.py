"""The engine's handling of asynchronous copies, on CPU, with a transfer that behaves like CUDA.

``LazyTransfer`` has the semantics of ``CudaStreamTransfer`` without a GPU: an offload copy
happens only when the engine observes it finished (after a few polls) or waits for it, and
a fetched buffer holds garbage until the engine calls ``make_ready``. If the engine dropped
a source too early, read a host block before its copy, or used a fetched buffer without
ordering, the gradients would differ (or the transfer's own checks would raise).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sagemaker.offload import PrefetchOffloadWrapper, get_stats
from torch_sagemaker.offload.buffers import HostBufferPool
from torch_sagemaker.offload.streams import FetchTicket, OffloadTicket

GARBAGE = 0xAB


class LazyTransfer:
    """Copies that complete late, like copies on CUDA side streams."""

    def __init__(self, pool: HostBufferPool, polls_until_done: int) -> None:
        self.pool = pool
        self.polls_until_done = polls_until_done
        self.pending: dict[int, int] = {}  # id(ticket) -> polls left
        self.unordered_uses = 0
        self.early_drops = 0

    def start_offload(self, source: torch.Tensor) -> OffloadTicket:
        block = self.pool.acquire(source.numel())
        block.data.fill_(GARBAGE)  # a reused block must be overwritten by the copy
        ticket = OffloadTicket(block=block, source=source, done=False)
        self.pending[id(ticket)] = self.polls_until_done
        return ticket

    def _complete(self, ticket: OffloadTicket) -> None:
        if ticket.done:
            return
        if ticket.source is None:
            self.early_drops += 1  # the engine let go of the source before the copy ran
            return
        ticket.block.data.copy_(ticket.source)
        ticket.done = True

    def offload_finished(self, ticket: OffloadTicket) -> bool:
        self.pending[id(ticket)] -= 1
        if self.pending[id(ticket)] <= 0:
            self._complete(ticket)
        return bool(ticket.done)

    def wait_offload(self, ticket: OffloadTicket) -> None:
        self._complete(ticket)

    def start_fetch(self, block, device) -> FetchTicket:
        data = torch.full((block.nbytes,), GARBAGE, dtype=torch.uint8)
        return FetchTicket(data=data, done=block)  # ``done`` remembers the source block

    def make_ready(self, ticket: FetchTicket) -> bool:
        if not ticket.ready:
            ticket.data.copy_(ticket.done.data)
            ticket.ready = True
        return True

    def retire_fetch(self, ticket: FetchTicket) -> None:
        ticket.ready = True


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(x).tanh()  # saves the input, the weight, and tanh's output


class Stack(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


def step(model, steps: int = 2):
    grads = []
    for i in range(steps):
        model.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        model(x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


@pytest.mark.parametrize("horizon", [1, 2, 5])
@pytest.mark.parametrize("polls", [1, 3, 100])
@pytest.mark.parametrize("stash_bytes", [0, 1 << 30])
def test_late_copies_are_waited_for_and_ordered(horizon, polls, stash_bytes):
    ref = step(Stack())
    model = PrefetchOffloadWrapper(
        Stack(),
        horizon=horizon,
        min_offload_bytes=0,
        max_stash_bytes=stash_bytes,
        layers=lambda m: isinstance(m, Layer),
    )
    engine = model._offload_engine
    pool = HostBufferPool(pin_memory=False)
    transfer = LazyTransfer(pool, polls)
    engine._transfers[torch.device("cpu")] = transfer
    got = step(model)
    for got_step, ref_step in zip(got, ref):
        for g, r in zip(got_step, ref_step):
            assert torch.equal(g, r)
    assert transfer.early_drops == 0
    stats = get_stats(model)
    assert stats.bytes_offloaded > 0 and stats.resident_bytes >= 0
    if stash_bytes == 0:
        assert not engine._stash  # a zero-byte stash waits for every copy at once
    if polls == 100 and stash_bytes:
        # Copies still in flight at the end of forward: the prefetch reuses the sources.
        assert stats.bytes_prefetched < stats.bytes_offloaded
    # Once every copy is observed finished, nothing stays resident and the pool is whole.
    engine.max_stash_bytes = 0
    engine._poll_stash()
    assert get_stats(model).resident_bytes == 0
    assert pool.in_use_bytes == 0 and pool.allocated_bytes > 0
