"""Which recomputations of a TP region replay its random draws (one process, CPU).

Note [Unreplayed TP-region draws] in tensor_parallel/random.py: a region that draws during a
backward that does not replay the tracker's stream raises, also when non-reentrant
checkpointing stops the recompute early inside the region, and whichever other checkpoints
share the backward; the tracker's ``checkpoint_context_fn`` replays, as often as the block is
recomputed.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from torch_sagemaker.tensor_parallel.plan import install_rng_region
from torch_sagemaker.tensor_parallel.random import RNGStatesTracker


def _tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker(device_type="cpu")
    tracker.add("model-parallel-rng", 1234)
    return tracker


class _Region(nn.Module):
    """A layer whose whole forward is a TP region that drops out (hooks, as tsm installs)."""

    def __init__(self, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        install_rng_region(self, tracker)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x), 0.5, True)


def _checkpointed(layer, h, kind, tracker):
    if kind == "reentrant":
        return cp.checkpoint(layer, h, use_reentrant=True)
    if kind == "replayed":
        return cp.checkpoint(
            layer, h, use_reentrant=False, context_fn=tracker.checkpoint_context_fn
        )
    return cp.checkpoint(layer, h, use_reentrant=False)  # "unreplayed"


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize(
    "kinds",
    [["reentrant"], ["unreplayed"], ["reentrant", "replayed"], ["unreplayed", "replayed"]],
)
def test_an_unreplayed_recompute_raises(kinds, early_stop):
    tracker = _tracker()
    torch.manual_seed(0)
    h = torch.randn(4, 8, requires_grad=True)
    with cp.set_checkpoint_early_stop(early_stop):
        for kind in kinds:
            h = _checkpointed(_Region(tracker), h, kind, tracker)
        with pytest.raises(RuntimeError, match="without replaying the stream"):
            h.sum().backward()


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_replayed_recompute_gives_the_forwards_gradients_every_time(early_stop):
    tracker = _tracker()
    torch.manual_seed(0)
    layer, x = _Region(tracker), torch.randn(4, 8, requires_grad=True)
    start = tracker.get_states()
    layer(x).sum().backward()
    want = layer.linear.weight.grad.clone()
    layer.zero_grad()
    tracker.set_states(start)
    with cp.set_checkpoint_early_stop(early_stop):
        y = _checkpointed(layer, x, "replayed", tracker).sum()
        y.backward(retain_graph=True)  # recomputed twice: replayed twice
        y.backward()
    torch.testing.assert_close(layer.linear.weight.grad, 2 * want, rtol=0, atol=1e-6)
