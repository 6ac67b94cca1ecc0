"""Edge cases of what gets offloaded, on small hand-written layers (no checkpointing).

Without activation checkpointing every tensor a layer saves reaches the offload hooks,
which makes the byte counters exact and easy to predict.
"""

from __future__ import annotations

import pytest
import torch
import torch.sagemaker as tsm
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

from torch_sagemaker.offload import (
    NativeOffloadWrapper,
    PrefetchOffloadWrapper,
    get_stats,
    offload_wrapper,
)

ALIASING_SEEN: list[bool] = []


class SaveBaseAndView(torch.autograd.Function):
    """y = sin(x); saves x and a strided view of x, and checks in backward that they alias."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x[:, 1:].t())
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        base, view = ctx.saved_tensors
        offset = base.stride(1) * base.element_size()
        ALIASING_SEEN.append(
            view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and view.data_ptr() == base.data_ptr() + offset
            and view.stride() == (1, 8)
        )
        out = grad * base.cos()
        out[:, 1:] += view.t() * 0.5
        return out


class Layer(nn.Module):
    """A layer whose forward is chosen per test; owns a Linear and a buffer."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x, shared=None):
        h = x * 2  # a fresh activation in every layer
        if self.kind == "view":
            return SaveBaseAndView.apply(h)
        if self.kind == "double":
            return h * h  # mul saves h twice
        if self.kind == "linear":
            return self.linear(h)  # saves h and the weight
        if self.kind == "buffer":
            return (h * self.scale).sin()  # mul saves the buffer, sin saves its input
        if self.kind == "shared":
            return h * shared  # saves `shared`, the same tensor in every layer
        raise ValueError(self.kind)


class Stack(nn.Module):
    def __init__(self, kind: str, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(kind) for _ in range(n))

    def forward(self, x, shared=None):
        for layer in self.layers:
            x = layer(x, shared) if shared is not None else layer(x)
        return x.square().sum()


def run(kind: str, offload: bool, min_offload_bytes: int = 0, **inputs):
    """Loss, gradients and stats of one step; ``offload=False`` runs the bare model."""
    model = Stack(kind)
    if offload:
        model = PrefetchOffloadWrapper(
            model,
            horizon=1,
            min_offload_bytes=min_offload_bytes,
            layers=lambda m: isinstance(m, Layer),
        )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = model(x, **inputs)
    loss.backward()
    grads = [p.grad for p in model.parameters()] + [x.grad]
    return loss, grads, (get_stats(model) if offload else None)


def assert_same(kind: str, **kwargs):
    loss, grads, stats = run(kind, True, **kwargs)
    ref_loss, ref_grads, _ = run(
        kind, False, **{k: v for k, v in kwargs.items() if k != "min_offload_bytes"}
    )
    assert torch.equal(loss, ref_loss)
    for got, want in zip(grads, ref_grads):
        assert (got is None and want is None) or torch.equal(got, want)
    return stats


ACT_BYTES = 4 * 8 * 4  # one (4, 8) fp32 activation


def test_views_of_one_storage_are_offloaded_once_and_alias_after_unpack():
    ALIASING_SEEN.clear()
    stats = assert_same("view")
    assert ALIASING_SEEN == [True] * 6  # 3 layers with offloading (run first), 3 without
    assert stats.bytes_offloaded == 3 * ACT_BYTES  # one copy per layer, not two


def test_a_tensor_saved_twice_is_offloaded_once():
    stats = assert_same("double")
    assert stats.bytes_offloaded == 3 * ACT_BYTES


def test_parameters_are_never_offloaded():
    stats = assert_same("linear")
    assert stats.bytes_offloaded == 3 * ACT_BYTES  # the inputs only, not the 8x8 weights


def test_buffers_are_never_offloaded():
    stats = assert_same("buffer")
    assert stats.bytes_offloaded == 3 * ACT_BYTES  # the sin inputs; the scale buffer stays


def test_small_storages_are_kept():
    stats = assert_same("double", min_offload_bytes=ACT_BYTES + 1)
    assert stats.bytes_offloaded == 0 and stats.bytes_kept == 3 * ACT_BYTES
    assert stats.peak_resident_bytes == stats.bytes_saved == stats.bytes_kept


def test_a_storage_saved_by_several_layers_is_kept_once():
    shared = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    stats = assert_same("shared", shared=shared)
    # `shared` is offloaded by the first layer, then kept once the second layer saves it.
    assert stats.bytes_kept == ACT_BYTES
    assert stats.bytes_saved == ACT_BYTES  # the only storage any layer saved


def test_no_layers_found_names_the_fix():
    with pytest.raises(
        ValueError, match="found no checkpointed layers.*apply activation checkpointing first"
    ):
        PrefetchOffloadWrapper(Stack("double"), horizon=1)


def test_get_stats_needs_a_wrapper():
    with pytest.raises(ValueError, match="contains no PrefetchOffloadWrapper"):
        get_stats(Stack("double"))


def test_wrapper_keeps_state_dict_keys_and_attributes():
    model = Stack("linear")
    wrapped = PrefetchOffloadWrapper(
        Stack("linear"), horizon=1, layers=lambda m: isinstance(m, Layer)
    )
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert (
        isinstance(wrapped, OffloadWrapper)
        and wrapped.layers is wrapped._checkpoint_wrapped_module.layers
    )


def test_tsm_offload_wrapper_follows_sm_activation_offloading():
    layers = dict(layers=lambda m: isinstance(m, Layer))
    try:
        wrapped = tsm.offload_wrapper(Stack("linear"), activation_loading_horizon=3, **layers)
        assert isinstance(wrapped, PrefetchOffloadWrapper)
        assert wrapped._offload_engine.horizon == 3
        tsm.state.activation_loading_horizon = 5
        assert offload_wrapper(Stack("linear"), **layers)._offload_engine.horizon == 5
        tsm.state.sm_activation_offloading = False
        native = tsm.offload_wrapper(Stack("linear"))
        assert type(native) is NativeOffloadWrapper and isinstance(native, OffloadWrapper)
    finally:
        tsm.state.reset()


def test_torch_offload_wrapper_is_native_before_init():
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    from torch_sagemaker.offload import torch_patch

    assert torch_patch.is_installed()
    assert not tsm.is_initialized()
    assert type(cw.offload_wrapper(Stack("linear"))) is OffloadWrapper


@pytest.mark.parametrize("kind", ["view", "linear"])
def test_native_wrapper_offloads_plain_tensors_as_pytorchs_does(kind):
    """Without DTensors, ``NativeOffloadWrapper`` is PyTorch's ``OffloadWrapper``."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for wrap in (NativeOffloadWrapper, OffloadWrapper):
        model = wrap(Stack(kind))
        inp = x.clone().requires_grad_()
        loss = model(inp)
        loss.backward()
        results.append([loss] + [p.grad for p in model.parameters()] + [inp.grad])
    for got, want in zip(*results, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


class _FailingBlock(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.l1, self.l2, self.fail = nn.Linear(width, width), nn.Linear(width, width), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.l1(x))
        if self.fail:
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        return x + self.l2(h)


def test_a_backward_that_raised_does_not_stop_later_backwards_releasing_their_copies():
    """A backward that raises never runs its end-of-backward callback; the next backwards
    must still queue theirs (a training loop that skips a batch after an error goes on)."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(_FailingBlock() for _ in range(6)))
    model = PrefetchOffloadWrapper(blocks, horizon=1, layers=lambda m: isinstance(m, _FailingBlock))

    def resident_after_backward_keeping_the_graph() -> int:
        loss = model(torch.randn(8, 32, 64)).sum()  # an input without grad, as a batch
        loss.backward(retain_graph=True)
        return get_stats(model).resident_bytes

    assert resident_after_backward_keeping_the_graph() == 0
    blocks[2].fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(8, 32, 64)).sum().backward()
    blocks[2].fail = False
    assert resident_after_backward_keeping_the_graph() == 0


class WritesSavedInput(nn.Module):
    """Saves ``h`` (sin saves its input), then writes ``h`` in place: autograd must refuse.

    It keeps ``h`` alive (as a cache would): an offloaded tensor is held weakly, so a write
    to one freed before backward is not seen (Note [In-place writes to saved activations]).
    """

    def forward(self, x):
        h = x * 2
        y = h.sin()
        h.mul_(3)  # the saved input of sin changes before backward reads it
        self.kept = h
        return y


@pytest.mark.parametrize("min_offload_bytes", [0, 1 << 20], ids=["offloaded", "kept"])
def test_an_in_place_write_to_a_saved_activation_raises_as_in_autograd(min_offload_bytes):
    # Note [In-place writes to saved activations]: without the check, the kept tensor gave
    # backward the written values and the offloaded one the old ones, with no error.
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        WritesSavedInput()(x).sum().backward()  # autograd's own check
    model = PrefetchOffloadWrapper(
        nn.Sequential(WritesSavedInput()),
        horizon=1,
        min_offload_bytes=min_offload_bytes,
        layers=lambda m: isinstance(m, WritesSavedInput),
    )
    loss = model(x).sum()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*version 1; exp"):
        loss.backward()
