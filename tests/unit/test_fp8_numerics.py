"""The FP8 linear layer against an independent emulation, bit for bit on CPU.

``tests/unit/fp8_reference.py`` rebuilds e4m3/e5m2 from their bit layouts and replays
Transformer Engine's documented delayed-scaling rule on lists of amaxes. On the CPU the
layer's products are written out as their definition, one fp32 matmul of the dequantized
operands (Note [FP8 matmul on CPU and CUDA]), as the emulation computes them, so outputs,
input and weight gradients and scales must be equal, not close, on any CPU. torch's own
``torch._scaled_mm`` is checked against that product: equal where it is the definition
(``_EXACT``), within fp32 rounding of the sums where its kernel sums in its own order
(oneDNN's with AMX; the GPU machine's CPU under torch 2.11). Also: recomputation under
activation checkpointing, the layer outside ``fp8_autocast``, calibration, and the errors
for unsupported recipe options.
"""

from __future__ import annotations

import copy
import enum

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit import fp8_reference as ref
from torch_sagemaker._torch_compat import float8
from torch_sagemaker.fp8 import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    Fp8Linear,
    autocast,
    fp8_autocast,
    to_fp8_linear,
)
from torch_sagemaker.fp8.numerics import quantize
from torch_sagemaker.fp8.prepare import prepare_linears
from torch_sagemaker.fp8.recipe import resolve_recipe


def _scaled_mm_is_the_definition() -> bool:
    """Whether this machine's CPU ``torch._scaled_mm`` is the fp32 ``matmul`` of the definition.

    It is on the machines the package is developed on (torch 2.13, no AMX). Elsewhere a kernel
    may sum in its own order (oneDNN's with AMX; the GPU machine's CPU under torch 2.11 gave
    other last bits): probed on the products of this file's shapes, whose sums round.
    """
    gen = torch.Generator().manual_seed(7)
    for m, k, n in ((10, 32, 48), (10, 48, 32), (48, 10, 32), (3, 32, 48), (48, 3, 32)):
        a = (torch.randn(m, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        b = (torch.randn(k, n, generator=gen) * 50).to(torch.float8_e4m3fn)
        sa, sb = torch.tensor(0.37), torch.tensor(1.9e-3)
        got = float8.scaled_mm(a, b, sa, sb, torch.float32)
        if not torch.equal(got, torch.matmul(a.float() * sa, (b.float() * sb).contiguous())):
            return False
    return True


_EXACT = _scaled_mm_is_the_definition()


def _same_as_the_op(got: torch.Tensor, want: torch.Tensor, operands: tuple) -> bool:
    """``got`` equals ``torch._scaled_mm``'s ``want`` bit for bit, or where the op's kernel
    sums in its own order (``_EXACT`` false), to fp32 rounding of the sums
    (``fp8_reference.magnitude``)."""
    if _EXACT:
        return torch.equal(got, want)
    size = ref.magnitude(*operands)
    k = operands[0].shape[1]
    # each side within (K - 1) u of the exact sum; dequantizing each term rounds at most twice
    return bool((ref.differences(got, want, size) <= 2 * (k + 3) * ref.U32).all())


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_quantize_rounds_to_the_format_grid(fmt, dtype):
    g = ref.grid(fmt)
    mids = (g[:-1] + g[1:]) / 2  # exact ties: half go up, half down (to the even code)
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 18, (4000,), generator=gen).double()
    )
    values = np.concatenate([g, -g, mids, -mids, spread.numpy(), [1e9, -1e9, 0.0]])
    x = torch.from_numpy(values.astype(np.float32))
    scale = torch.tensor(1.0)
    expected = ref.quantize(x, np.float32(1.0), fmt)
    got = quantize(x, scale, dtype).float().numpy()
    assert np.array_equal(got, expected), np.flatnonzero(got != expected)[:10]
    # Saturation: beyond the largest value clips to it, in both signs.
    assert got[-3] == ref.fmax(fmt) and got[-2] == -ref.fmax(fmt)


def _steps(layer, emu, recipe, dtype, steps=5):
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        # Magnitudes change from step to step, so each step's scales differ from the last.
        x = (torch.randn(2, 5, 32, generator=gen) * (1 + 3 * step)).to(dtype).requires_grad_()
        gy = (torch.randn(2, 5, 48, generator=gen) * 1e-3 / (1 + step)).to(dtype)
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
            got_scales = layer.fp8_scaling.scale.tolist()  # used by this forward and backward
        y.backward(gy)
        e = emu.step(x, layer.weight, layer.bias, gy)
        assert [np.float32(s) for s in got_scales] == [e["scales"][k] for k in "xwg"], step
        assert torch.equal(y, e["y"]), (step, "output")
        assert torch.equal(x.grad, e["dx"]), (step, "input gradient")
        assert torch.equal(layer.weight.grad, e["dw"]), (step, "weight gradient")
        assert torch.equal(layer.bias.grad, e["db"]), (step, "bias gradient")
        with torch.no_grad():
            layer.weight -= 0.5 * layer.weight.grad
        layer.weight.grad = layer.bias.grad = None
    return layer


@pytest.mark.parametrize(
    "history,margin,algo,fmt,dtype",
    [
        (3, 0, "max", Format.HYBRID, torch.float32),
        (1, 1, "most_recent", Format.E4M3, torch.float32),
        (1024, 0, "max", Format.HYBRID, torch.bfloat16),
    ],
)
def test_delayed_scaling_matches_emulation_over_steps(history, margin, algo, fmt, dtype):
    torch.manual_seed(0)
    layer = to_fp8_linear(nn.Linear(32, 48).to(dtype))
    bwd = "e5m2" if fmt is Format.HYBRID else "e4m3"
    emu = ref.EmulatedLinear(history, "e4m3", bwd, margin, algo)
    recipe = DelayedScaling(
        margin=margin, fp8_format=fmt, amax_history_len=history, amax_compute_algo=algo
    )
    layer = _steps(layer, emu, recipe, dtype)
    state = layer.fp8_scaling  # the last step is applied (region exit, end of backward)
    assert [np.float32(s) for s in state.scale.tolist()] == [emu.x.scale, emu.w.scale, emu.g.scale]
    # The documented history layout: row 0 zero (staging), then the last steps, oldest first.
    newest = min(history - 1, 5)
    assert torch.all(state.history[0] == 0)
    if newest:
        expected = torch.tensor([r.amaxes[-newest:] for r in (emu.x, emu.w, emu.g)]).T
        assert torch.equal(state.history[history - newest :], expected)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_product_is_torchs_scaled_mm(out_dtype):
    # Note [FP8 matmul on CPU and CUDA]: the CPU path writes out the definition, far faster
    # than torch's op there: equal to the op where it is the definition (_EXACT), within
    # fp32 rounding of the sums where its kernel sums in its own order (oneDNN's with AMX).
    # A row-major and a transposed (column-major) second operand.
    from torch_sagemaker.fp8.numerics import scaled_matmul

    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(24, 40, generator=gen) * 30).to(torch.float8_e4m3fn)
    w = (torch.randn(56, 40, generator=gen) * 30).to(torch.float8_e5m2)
    inv_a, inv_b = torch.tensor(0.013), torch.tensor(2.7)
    for b in (w.t(), w.t().contiguous()):
        got = scaled_matmul(a, b, inv_a, inv_b, out_dtype)
        fp32 = scaled_matmul(a, b, inv_a, inv_b, torch.float32)
        assert got.dtype == out_dtype and torch.equal(got, fp32.to(out_dtype))
        # torch.autocast does not round the product's fp32 operands, as it does not the op's.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(scaled_matmul(a, b, inv_a, inv_b, out_dtype), got)
        want = float8.scaled_mm(a, b, inv_a, inv_b, torch.float32)
        operands = (a.float().numpy(), float(inv_a), b.float().numpy(), float(inv_b))
        assert _same_as_the_op(fp32, want, operands)


def test_fp8_is_within_the_formats_precision_of_fp32():
    """An independent yardstick for the scales: against ``nn.Linear`` in fp32, the output
    carries e4m3's error (3 mantissa bits: ~3.6% relative, RMS) and the gradients e5m2's
    (2 bits: ~6%), not a wrong factor, and not zero (it does quantize)."""
    torch.manual_seed(0)
    plain = nn.Linear(256, 128)
    layer = to_fp8_linear(copy.deepcopy(plain))
    for _ in range(3):
        x = torch.randn(64, 256) * 2
        gy = torch.randn(64, 128) * 1e-3
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            y = layer(a)
        y.backward(gy)
        plain(b).backward(gy)
        with torch.no_grad():
            errors = [
                float((u - v).norm() / v.norm())
                for u, v in (
                    (y, plain(x)),
                    (a.grad, b.grad),
                    (layer.weight.grad, plain.weight.grad),
                )
            ]
        assert 0.02 < errors[0] < 0.05 and all(0.04 < e < 0.08 for e in errors[1:]), errors
        layer.weight.grad = plain.weight.grad = None


def test_current_scaling_matches_emulation():
    torch.manual_seed(0)
    layer = to_fp8_linear(nn.Linear(32, 48))
    x = (torch.randn(3, 32) * 7).requires_grad_()
    gy = torch.randn(3, 48) * 1e-4
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = layer(x)
    y.backward(gy)
    scale = {
        k: np.float32(np.float32(ref.fmax(f)) / np.float32(t.abs().max()))
        for k, f, t in (
            ("x", "e4m3", x.detach()),
            ("w", "e4m3", layer.weight.detach()),
            ("g", "e5m2", gy),
        )
    }
    qx, qw = ref.quantize(x, scale["x"], "e4m3"), ref.quantize(layer.weight, scale["w"], "e4m3")
    qg = ref.quantize(gy, scale["g"], "e5m2")
    inv = {k: ref.inverse(v) for k, v in scale.items()}
    for got, (a, ia, b, ib), bias in (
        (y, (qx, inv["x"], qw.T, inv["w"]), layer.bias),
        (x.grad, (qg, inv["g"], qw, inv["w"]), 0),
        (layer.weight.grad, (qg.T, inv["g"], qx, inv["x"]), 0),
    ):
        assert torch.equal(got, ref.product(a, ia, b, ib, torch.float32) + bias)
    assert layer.fp8_scaling.history is None  # current scaling keeps no state


def test_outside_fp8_autocast_the_layer_is_nn_linear():
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    layer = to_fp8_linear(copy.deepcopy(plain))
    assert isinstance(layer, Fp8Linear) and repr(layer) == "Fp8" + repr(plain)
    assert list(layer.state_dict()) == list(plain.state_dict())
    x = torch.randn(4, 16)
    for ctx in (None, fp8_autocast(enabled=False), autocast(enabled=False)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        if ctx is None:
            out = layer(a)
        else:
            with ctx:
                out = layer(a)
        out.sum().backward()
        plain(b).sum().backward()
        assert torch.equal(out, plain(x)) and torch.equal(a.grad, b.grad)
    assert layer.fp8_scaling.history is None  # never ran in FP8: no state, nothing to reduce


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=repr)
def test_an_empty_batch_passes_as_through_nn_linear(recipe):
    """0 rows (a data-parallel rank's empty last batch): nothing to quantize, no crash."""
    layer = to_fp8_linear(nn.Linear(16, 8))
    x = torch.randn(0, 16, requires_grad=True)
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 16)
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))


def test_a_trained_layer_copies_without_its_groups():
    """``copy.deepcopy`` (and pickling) of a model after FP8 steps: the scaling state comes
    along, the process groups it last reduced over (which cannot be copied) do not."""
    import pickle
    import threading

    layer = to_fp8_linear(nn.Linear(16, 8))
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            y = layer(x)
        y.sum().backward()
    layer.fp8_scaling.reduce_group = threading.Lock()  # stands in for a ProcessGroup
    copied = copy.deepcopy(layer)
    assert copied.fp8_scaling.reduce_group is None
    assert torch.equal(copied.fp8_scaling.history, layer.fp8_scaling.history)
    assert copied.fp8_scaling.history is not layer.fp8_scaling.history
    assert torch.equal(pickle.loads(pickle.dumps(layer)).fp8_scaling.scale, layer.fp8_scaling.scale)


def test_calibrating_records_amaxes_without_fp8():
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    layer = to_fp8_linear(copy.deepcopy(plain))
    x = torch.randn(4, 16) * 3
    recipe = DelayedScaling(amax_history_len=2)
    with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
        out = layer(x)
    assert torch.equal(out, plain(x))
    scale = layer.fp8_scaling.scale  # applied when the region exited
    expected = np.float32(448.0) / np.float32(x.abs().max())
    assert np.float32(scale[0].item()) == expected
    assert scale[2].item() == 1.0  # no backward ran: the gradient's scale is untouched


def _settled(states) -> bool:
    """Nothing pending after a step: each amax recorded once was applied, none recorded late."""
    return all(
        torch.all(s.pending == -1) and not s.dirty_forward and not s.dirty_backward for s in states
    )


def test_recomputation_reuses_the_forward_scales():
    """Non-reentrant checkpointing of a Llama's layer, and reentrant of a plain block: the
    same losses, gradients, amax histories and scales as without, bit for bit, and no amax
    recorded by the recomputation (it would be left pending after the backward)."""
    from tests.distributed.hf_models import tiny_llama
    from torch_sagemaker.policies import lookup_policy
    from torch_sagemaker.sharding import checkpoint_transformer_layers

    base = tiny_llama(num_hidden_layers=1)
    plain, ckpt = base, copy.deepcopy(base)
    for m in (plain, ckpt):
        report = prepare_linears(m, lookup_policy(m), backend="dtensor", tp=1)
    assert len(report.layers) == 7 and not report.skipped
    checkpoint_transformer_layers(ckpt)
    calls = []
    q_proj = next(m for n, m in ckpt.named_modules() if n.endswith("q_proj"))
    q_proj.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    recipe = DelayedScaling(amax_history_len=4)
    runs = {}
    for name, m in (("plain", plain), ("ckpt", ckpt)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        states = [x.fp8_scaling for x in m.modules() if isinstance(x, Fp8Linear)]
        losses, grads = [], []
        for _ in range(2):
            with fp8_autocast(fp8_recipe=recipe):
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            assert _settled(states), name
            losses.append(loss.item())
            grads.append([p.grad.clone() for p in m.parameters()])
            opt.step()
            opt.zero_grad()
        runs[name] = (losses, grads, states)
    assert len(calls) == 4  # forward and recomputation, two steps
    (l1, g1, s1), (l2, g2, s2) = runs["plain"], runs["ckpt"]
    assert l1 == l2 and len(s1) == len(s2) == 7
    assert all(torch.equal(a, b) for step1, step2 in zip(g1, g2) for a, b in zip(step1, step2))
    for a, b in zip(s1, s2):
        assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale)
        assert torch.count_nonzero(a.history[:, 0]) == 2  # one entry per step, not two

    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    copies = [copy.deepcopy(block) for _ in range(2)]
    for c in copies:
        to_fp8_linear(c[0]), to_fp8_linear(c[2])
    x = torch.randn(4, 16, requires_grad=True)
    outs = []
    for i, c in enumerate(copies):
        with fp8_autocast(fp8_recipe=recipe):
            y = c(x) if i == 0 else torch.utils.checkpoint.checkpoint(c, x, use_reentrant=True)
        y.pow(2).sum().backward()
        assert _settled([c[0].fp8_scaling, c[2].fp8_scaling]), i
        outs.append([p.grad.clone() for p in c.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert torch.equal(copies[0][0].fp8_scaling.history, copies[1][0].fp8_scaling.history)


def _forward_steps(layer, recipe, amaxes):
    """One forward per amax (the input's largest magnitude); the input column after each."""
    out = []
    for a in amaxes:
        x = torch.zeros(2, layer.in_features)
        x[0, 0] = a
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            layer(x)
        s = layer.fp8_scaling
        out.append((s.history[:, 0].tolist(), s.scale[0].item()))
    return out


def test_a_zero_amax_leaves_the_tensor_alone():
    """Note [Delayed scaling rule]: a step whose amax is 0 (an all-zero tensor) neither
    enters the history nor changes the scale with "max"/"most_recent" (Transformer Engine's
    fused update), so it cannot push a real amax out of the window early; a callable
    algorithm takes Transformer Engine's unfused path, which rotates the zero in."""
    f32 = np.float32
    for algo in ("max", "most_recent"):
        layer = to_fp8_linear(nn.Linear(16, 8))
        steps = _forward_steps(
            layer, DelayedScaling(amax_history_len=2, amax_compute_algo=algo), [10.0, 0.0, 1.0]
        )
        assert steps[0] == ([0.0, 10.0], f32(448) / f32(10)), algo
        assert steps[1] == steps[0], algo  # the zero step: nothing moved
        scale = f32(448) / f32(10) if algo == "max" else f32(448)
        assert steps[2] == ([0.0, 1.0], scale), algo  # the window still held 10
    layer = to_fp8_linear(nn.Linear(16, 8))
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(dim=0))
    steps = _forward_steps(layer, recipe, [10.0, 0.0, 1.0])
    assert steps[1] == ([0.0, 0.0], f32(448) / f32(10))  # rotated in; scale from {10, 0}
    assert steps[2] == ([0.0, 1.0], 448.0)  # 10 left the window with the zero


def test_callable_algorithms_see_the_history_and_decide_the_scale():
    """``amax_compute_algo(history)`` gets ``[amax_history_len, n]`` (row 0 this step's
    amaxes, then the earlier steps oldest first), ``scaling_factor_compute_algo(amax,
    old_scale, fp8_max, recipe)`` its result, and what it returns is the next scale."""
    histories, sf_calls = [], []

    def window_sum(history):
        histories.append(history.clone())
        return history.sum(dim=0)

    def quarter(amax, scale, fp8_max, recipe):
        sf_calls.append((amax.clone(), scale.clone(), fp8_max.clone(), recipe))
        return torch.where(amax > 0, fp8_max / amax / 4, scale)

    recipe = DelayedScaling(
        amax_history_len=3, amax_compute_algo=window_sum, scaling_factor_compute_algo=quarter
    )
    layer = to_fp8_linear(nn.Linear(16, 8, bias=False))
    steps = _forward_steps(layer, recipe, [1.0, 2.0, 4.0, 8.0])
    assert len(histories) == len(sf_calls) == 4
    assert histories[0].shape == (3, 3)  # one layer: input, weight, output-gradient columns
    assert histories[2][:, 0].tolist() == [4.0, 1.0, 2.0]  # this step, then oldest to newest
    amax, old, fp8_max, got_recipe = sf_calls[3]
    assert amax[0] == 2 + 4 + 8 and old[0] == np.float32(448) / np.float32(4 * 7)
    assert fp8_max.tolist() == [448.0, 448.0, 57344.0] and got_recipe is recipe
    for (_, scale), window in zip(steps, ([1], [1, 2], [1, 2, 4], [2, 4, 8])):
        assert scale == np.float32(448) / np.float32(sum(window)) / np.float32(4)


def test_delayed_scale_of_a_tiny_amax_is_fp32_max():
    """Transformer Engine: a scale that overflows fp32 becomes fp32's largest value (the old
    one is kept only for amax 0, inf or NaN)."""
    from torch_sagemaker.fp8.numerics import delayed_scales

    history = torch.tensor([[1e-37, 0.0, 5.0, float("inf")], [0.0, 0.0, 0.0, 0.0]])
    old = torch.tensor([2.0, 3.0, 4.0, 5.0])
    new = delayed_scales(history, old, torch.full((4,), 448.0), DelayedScaling(amax_history_len=2))
    fp32_max = torch.finfo(torch.float32).max
    assert new.tolist() == [fp32_max, 3.0, np.float32(448) / np.float32(5), 5.0]


def test_current_scale_edge_cases():
    """As Transformer Engine computes it: 1 for amax 0, inf or NaN; fp32's largest value
    where the ratio overflows; power-of-two scales rounded down from the exponent bits."""
    from torch_sagemaker.fp8.numerics import current_scale

    e4m3 = torch.float8_e4m3fn
    just_below_8 = torch.tensor(448.0) / torch.tensor(448.0 / 7.9999995)  # fp32: 8 - 2**-21
    assert 7.9 < just_below_8.item() < 8.0
    amaxes = torch.tensor([0.0, float("inf"), float("nan"), 1e-38, 448.0 / 7.9999995, 56.0])
    fp32_max = torch.finfo(torch.float32).max
    plain = [current_scale(a, e4m3, False).item() for a in amaxes]
    assert plain == [1.0, 1.0, 1.0, fp32_max, just_below_8.item(), 8.0]
    pow2 = [current_scale(a, e4m3, True).item() for a in amaxes]
    assert pow2 == [1.0, 1.0, 1.0, 2.0**127, 4.0, 8.0]


def test_inf_and_nan_inputs():
    """An inf saturates (current scaling: scale 1, output finite) instead of turning the
    scale to 0 and the output to NaN; NaNs are left out of amaxes (Transformer Engine's
    kernels use fmaxf), so no NaN reaches the all-reduce of amaxes or a history."""
    from torch_sagemaker.fp8.numerics import amax

    assert amax(torch.tensor([1.0, float("nan"), -3.0])).item() == 3.0
    assert amax(torch.full((4,), float("nan"))).item() == 0.0
    assert amax(torch.tensor([-float("inf"), 1.0])).item() == float("inf")
    layer = to_fp8_linear(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    x[1, 3] = float("inf")
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = layer(x)
    assert torch.isfinite(y).all()
    x = torch.zeros(4, 16)
    x[0, 0], x[2, 5] = float("nan"), -6.0
    with torch.no_grad(), fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        layer(x)
    assert layer.fp8_scaling.history[:, 0].tolist() == [0.0, 6.0]


def test_recipes_hash_with_a_list_option():
    """Recipes key the groups of layers updated together, so they must hash."""
    recipe = DelayedScaling(override_linear_precision=[False, False, False])
    assert recipe.override_linear_precision == (False, False, False)
    assert hash(recipe) == hash(DelayedScaling()) and recipe == DelayedScaling()


class _TEFormat(enum.Enum):  # stands in for transformer_engine.common.recipe.Format
    E4M3 = 1
    HYBRID = 3


def _te_like(name: str, **fields):
    return type(name, (), fields)()


def test_transformer_engine_recipe_objects_are_read():
    delayed = _te_like(
        "DelayedScaling",
        margin=1,
        fp8_format=_TEFormat.HYBRID,
        amax_history_len=16,
        amax_compute_algo="most_recent",
        scaling_factor_compute_algo=None,
        reduce_amax=False,
    )
    assert resolve_recipe(delayed) == DelayedScaling(
        margin=1, amax_history_len=16, amax_compute_algo="most_recent", reduce_amax=False
    )
    current = _te_like("Float8CurrentScaling", fp8_format=_TEFormat.E4M3)
    assert resolve_recipe(current) == Float8CurrentScaling(fp8_format=Format.E4M3)
    assert resolve_recipe(None) == DelayedScaling()
    with pytest.raises(ValueError, match="MXFP8BlockScaling"):
        resolve_recipe(_te_like("MXFP8BlockScaling", fp8_format=_TEFormat.E4M3))


@pytest.mark.parametrize(
    "make,named",
    [
        (lambda: DelayedScaling(fp8_dpa=True), "fp8_dpa"),
        (lambda: DelayedScaling(fp8_mha=True), "fp8_mha"),
        (lambda: DelayedScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: DelayedScaling(interval=2), "interval"),
        (lambda: DelayedScaling(override_linear_precision=(False, True, False)), "override_linear"),
        (lambda: DelayedScaling(backward_override="high_precision"), "backward_override"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: Float8CurrentScaling(fp8_mha=True), "fp8_mha"),
    ],
)
def test_unsupported_recipe_options_are_named(make, named):
    with pytest.raises(ValueError, match=named):
        make()


@pytest.mark.parametrize(
    "make,named",
    [
        (lambda: DelayedScaling(reduce_amax="no"), "reduce_amax='no'"),  # truthy: would reduce
        (lambda: DelayedScaling(scaling_factor_compute_algo=3), "scaling_factor_compute_algo=3"),
        (lambda: Float8CurrentScaling(use_power_2_scales="x"), "use_power_2_scales='x'"),
    ],
)
def test_recipe_options_of_the_wrong_type_are_named(make, named):
    with pytest.raises(TypeError, match=named):
        make()


def test_fp8_autocast_argument_errors():
    with pytest.raises(TypeError, match="fp8_group"), fp8_autocast(fp8_group="world"):
        pass
    with pytest.raises(TypeError, match="enabled"), fp8_autocast(enabled="yes"):
        pass
    with fp8_autocast(enabled=1):  # SMP's scripts pass their 0/1 argument
        from torch_sagemaker.fp8 import is_fp8_enabled

        assert is_fp8_enabled()
    with pytest.raises(ValueError, match="_graph"), fp8_autocast(_graph=True):
        pass
    with pytest.raises(TypeError, match="nn.Linear"):
        to_fp8_linear(nn.Conv1d(2, 2, 1))
