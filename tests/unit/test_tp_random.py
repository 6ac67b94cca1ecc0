"""RNGStatesTracker in one process: forking, seeding rules and checkpoint replay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torch_sagemaker.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker


def test_for_state_seeds_random_seed_plus_tp_rank():
    a = RNGStatesTracker.for_state(SimpleNamespace(random_seed=7, tp_rank=0, device_type="cpu"))
    b = RNGStatesTracker.for_state(SimpleNamespace(random_seed=7, tp_rank=1, device_type="cpu"))
    c = RNGStatesTracker.for_state(SimpleNamespace(random_seed=6, tp_rank=1, device_type="cpu"))
    draws = []
    for tracker in (a, b, c):
        with tracker.fork():
            draws.append(torch.rand(5))
    assert not torch.equal(draws[0], draws[1])
    torch.manual_seed(8)  # seed 8 is what tp_rank 1 of random_seed 7 uses
    assert torch.equal(draws[1], torch.rand(5))
    torch.manual_seed(7)
    assert torch.equal(draws[2], torch.rand(5))


def test_fork_leaves_the_default_stream_alone_and_continues_its_own():
    tracker = RNGStatesTracker("cpu")
    tracker.add("s", 1)
    torch.manual_seed(0)
    with tracker.fork("s"):
        first = torch.rand(3)
    outside = torch.rand(3)
    with tracker.fork("s"):
        second = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(3))
    torch.manual_seed(1)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))


def test_seed_and_name_rules():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 3)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 4)
    with pytest.raises(ValueError, match="already used"):
        tracker.add("b", 3)
    with pytest.raises(KeyError), tracker.fork("missing"):
        pass
    tracker.reset()
    tracker.add("a", 3)


def test_get_set_states_round_trip():
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 5)
    saved = tracker.get_states()
    with tracker.fork():
        x = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(x, torch.rand(4))


def test_checkpoint_context_fn_replays_forked_dropout():
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 9)
    w = torch.randn(16, requires_grad=True)

    def block(x):
        with tracker.fork():
            return torch.nn.functional.dropout(x * w, p=0.5, training=True).sum()

    saved = tracker.get_states()
    block(torch.ones(16)).backward()
    expected = w.grad.clone()
    w.grad = None
    tracker.set_states(saved)
    checkpoint(
        block, torch.ones(16), use_reentrant=False, context_fn=tracker.checkpoint_context_fn
    ).backward()
    assert torch.equal(w.grad, expected)
    w.grad = None
    tracker.set_states(saved)
    # Without replay the recompute would draw a new mask: Note [Unreplayed TP-region draws].
    with pytest.raises(RuntimeError, match="without replaying the stream"):
        checkpoint(block, torch.ones(16), use_reentrant=False).backward()
