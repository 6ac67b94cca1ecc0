"""Which replicated subtrees a ``LocalParams`` owner's forward computes with locally."""

from __future__ import annotations

from torch import nn

from torch_sagemaker.tensor_parallel.replicated_styles import STYLE_ATTR, LocalParams


class Block(nn.Module):
    """Stands for a transformer layer: its own FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        setattr(self.norm, STYLE_ATTR, "replicate_local")


class FSDPBlock(Block):
    """What FSDP2's ``fully_shard`` makes of a ``Block``: a subclass named FSDP<class>."""


def _owner(layer: nn.Module) -> nn.Module:
    owner = nn.Module()
    owner.conv = nn.Conv1d(4, 4, 1)
    setattr(owner.conv, STYLE_ATTR, "replicate_local")
    owner.inner = nn.Sequential(nn.Linear(4, 4))
    setattr(owner.inner[0], STYLE_ATTR, "replicate_local")
    owner.layer = layer
    return owner


def test_walk_reaches_replicated_children_and_stops_at_layers():
    style = LocalParams(layer_class="Block")
    assert sorted(style._reachable(_owner(Block()))) == ["conv", "inner.0"]


def test_walk_stops_at_a_layer_that_fsdp2_renamed():
    style = LocalParams(layer_class="Block")
    assert sorted(style._reachable(_owner(FSDPBlock()))) == ["conv", "inner.0"]
    # Without a layer class nothing stops the walk: the layer's norm is reached.
    assert sorted(LocalParams()._reachable(_owner(FSDPBlock()))) == [
        "conv",
        "inner.0",
        "layer.norm",
    ]
