"""FP8 linear layers on a CUDA device (sm_89+), against the CPU emulation.

NOT RUN where the package is developed (no GPU); ``make gpu-check`` runs it (step
``fp8_cuda``). Skipped without CUDA or on a GPU older than sm_89 (no FP8 tensor cores).

What must hold on the device, with the same inputs and weights as the emulation
(tests/unit/fp8_reference.py):

- quantization is elementwise fp32 arithmetic and a rounding cast, and amaxes are exact, so
  the FP8 values and every scale of every step are bit-identical to the emulation's;
- the products come from cuBLASLt's FP8 GEMM, whose fp32 sums run in another order than the
  CPU's ``matmul``: results agree to fp32 rounding of the sums (fp32 outputs) or to one
  bf16 rounding (bf16 outputs);
- a layer whose inner dimension is not a multiple of 16 (cuBLASLt refuses it) still matches,
  through the fp32 fallback;
- a tiny Llama whose linear layers ``prepare_linears`` made FP8 trains 3 steps on the GPU
  with losses within 1e-3 of the same model on the CPU (attention kernels differ too).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit import fp8_reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="FP8 matrix products need an sm_89+ CUDA GPU",
    ),
]

# (rtol, atol) for outputs and gradients by dtype: fp32 sums in another order; one bf16 step.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (8e-3, 1e-5)}


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
    rtol, atol = TOL[dtype]
    for step in range(4):
        x_cpu = (torch.randn(m, k, generator=gen) * (1 + 3 * step)).to(dtype)
        gy_cpu = (torch.randn(m, n, generator=gen) * 1e-3).to(dtype)
        x = x_cpu.cuda().requires_grad_()
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
            used = layer.fp8_scaling.scale.cpu()
        y.backward(gy_cpu.cuda())
        w_cpu = layer.weight.detach().cpu()
        e = emu.step(x_cpu, w_cpu, layer.bias.detach().cpu(), gy_cpu)
        assert [np.float32(v) for v in used.tolist()] == [e["scales"][c] for c in "xwg"], step
        for role, t, s, fmt in (("x", x_cpu, used[0], "e4m3"), ("w", w_cpu, used[1], "e4m3")):
            q = quantize(t.cuda(), s.cuda(), torch.float8_e4m3fn).float().cpu().numpy()
            assert np.array_equal(q, ref.quantize(t, np.float32(s), fmt)), (step, role)
        torch.testing.assert_close(y.cpu(), e["y"], rtol=rtol, atol=atol)
        torch.testing.assert_close(x.grad.cpu(), e["dx"], rtol=rtol, atol=atol)
        torch.testing.assert_close(layer.weight.grad.cpu(), e["dw"], rtol=rtol, atol=atol)
        with torch.no_grad():
            layer.weight -= 0.5 * layer.weight.grad
        layer.weight.grad = layer.bias.grad = None


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
