"""FP8 linear layers on a CUDA device (sm_89+), against the CPU emulation.

NOT RUN where the package is developed (no GPU); ``make gpu-check`` runs it (step
``fp8_cuda``). Skipped without CUDA or on a GPU older than sm_89 (no FP8 tensor cores).

What must hold on the device, with the same inputs and weights as the emulation
(tests/unit/fp8_reference.py):

- quantization is elementwise fp32 arithmetic and a rounding cast, and amaxes are exact, so
  the FP8 values and every scale of every step are bit-identical to the emulation's;
- the products come from cuBLASLt's FP8 GEMM: given the emulation's FP8 values and the
  layer's scales, the layer's outputs and gradients are bit-identical to ``torch._scaled_mm``
  called on them directly (so the layer feeds the kernel the right operands, layouts and
  scales); against the CPU emulation they agree to ``KERNEL_BOUND`` of the terms'
  magnitudes, and the largest departure seen is reported as a warning;
- a product whose inner dimensions are not multiples of 16 (cuBLASLt refuses them) goes
  through the fp32 fallback and agrees with the emulation to fp32 rounding of the sums;
- a tiny Llama whose linear layers ``prepare_linears`` made FP8 trains 3 steps on the GPU
  with losses within 1e-3 of the same model on the CPU (attention kernels differ too).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit import fp8_reference as ref
from torch_sagemaker._torch_compat import float8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="FP8 matrix products need an sm_89+ CUDA GPU",
    ),
]

# How far cuBLASLt's FP8 GEMM may fall from the fp32 definition, over the sum of the terms'
# magnitudes (fp8_reference.magnitude). Hopper's FP8 tensor cores add products in an
# accumulator narrower than fp32 (about 14 bits, DeepSeek-V3's report measured) and cuBLASLt
# moves partial sums into fp32 at intervals (use_fast_accum=False). The H200 gave about
# 2**-13 on K=128 (2026-11-30), so this leaves room; a wrong scale, operand or layout misses
# by a large fraction of the magnitudes.
KERNEL_BOUND = 2.0**-8
FORMATS = {  # each product's operand formats (HYBRID: e5m2 for output gradients)
    "y": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "dx": (torch.float8_e5m2, torch.float8_e4m3fn),
    "dw": (torch.float8_e5m2, torch.float8_e4m3fn),
}


def _scaled_mm_on_device(a, inv_a, b, inv_b, formats, out_dtype):
    """``torch._scaled_mm`` of FP8 values ``a [M, K]``, ``b [K, N]`` (float32 arrays)."""
    ta = torch.from_numpy(np.ascontiguousarray(a)).cuda().to(formats[0])  # row-major
    tb = torch.from_numpy(np.ascontiguousarray(b.T)).cuda().to(formats[1]).t()  # column-major
    return float8.scaled_mm(ta, tb, inv_a, inv_b, out_dtype)  # torch._scaled_mm, no fast accum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128, 256), (48, 20, 24)])
def test_fp8_linear_on_cuda_matches_the_cpu_emulation(dtype, shape):
    from torch_sagemaker.fp8 import DelayedScaling, fp8_autocast, to_fp8_linear
    from torch_sagemaker.fp8.numerics import quantize

    m, k, n = shape
    torch.manual_seed(0)
    layer = to_fp8_linear(nn.Linear(k, n).to(dtype).cuda())
    emu = ref.EmulatedLinear(4)
    recipe = DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(4):
        x_cpu = (torch.randn(m, k, generator=gen) * (1 + 3 * step)).to(dtype)
        gy_cpu = (torch.randn(m, n, generator=gen) * 1e-3).to(dtype)
        x = x_cpu.cuda().requires_grad_()
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
            used = layer.fp8_scaling.scale.clone()
        y.backward(gy_cpu.cuda())
        w_cpu = layer.weight.detach().cpu()
        e = emu.step(x_cpu, w_cpu, layer.bias.detach().cpu(), gy_cpu)
        assert [np.float32(v) for v in used.tolist()] == [e["scales"][c] for c in "xwg"], step
        for role, t, s, fmt in (("x", x_cpu, used[0], "e4m3"), ("w", w_cpu, used[1], "e4m3")):
            q = quantize(t.cuda(), s, torch.float8_e4m3fn).float().cpu().numpy()
            assert np.array_equal(q, ref.quantize(t, np.float32(s.item()), fmt)), (step, role)
        # The layer's own op on the same scales, each its own tensor: cuBLASLt refuses a scale
        # that is a view at an offset into another tensor (CUBLAS_STATUS_NOT_SUPPORTED).
        inv = {c: used[i].reciprocal() for i, c in enumerate("xwg")}
        got = {"y": y, "dx": x.grad, "dw": layer.weight.grad}
        for name, device_inv, bias in (
            ("y", (inv["x"], inv["w"]), layer.bias.detach()),
            ("dx", (inv["g"], inv["w"]), None),
            ("dw", (inv["g"], inv["x"]), None),
        ):
            a, ia, b, ib = e["operands"][name]
            size = ref.magnitude(a, ia, b, ib)
            ratio = ref.differences(got[name], e[name], size).max()
            if a.shape[1] % 16 or b.shape[1] % 16:  # the fp32 fallback: sums in another order
                assert ratio <= 2 * (a.shape[1] + 3) * ref.U32, (step, name, ratio)
                continue
            want = _scaled_mm_on_device(a, device_inv[0], b, device_inv[1], FORMATS[name], dtype)
            if bias is not None:
                want = want + bias
            assert torch.equal(got[name], want.reshape(got[name].shape)), (step, name)
            assert ratio <= KERNEL_BOUND, (step, name, ratio)
            worst = max(worst, float(ratio))
        with torch.no_grad():
            layer.weight -= 0.5 * layer.weight.grad
        layer.weight.grad = layer.bias.grad = None
    if worst:
        warnings.warn(
            f"FP8 GEMM {m}x{k}x{n} {dtype}: largest departure from the fp32 definition "
            f"{worst:.3g} of the terms' magnitudes (2**{np.log2(worst):.1f})",
            stacklevel=1,
        )


def test_fp8_llama_trains_on_cuda_like_on_cpu():
    from tests.distributed.hf_models import tiny_llama
    from torch_sagemaker.fp8 import DelayedScaling, fp8_autocast
    from torch_sagemaker.fp8.prepare import prepare_linears
    from torch_sagemaker.policies import lookup_policy

    base = tiny_llama()
    prepare_linears(base, lookup_policy(base), backend="dtensor", tp=1)
    recipe = DelayedScaling(amax_history_len=8)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[device] = []
        for _ in range(3):
            batch = ids.to(device)
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[device].append(float(loss))
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-3)
