"""FP8 arithmetic: quantization, the two scale rules, and the scaled matrix product.

Every function here is elementwise or a matrix product on plain tensors; the state that
decides *which* scale a tensor gets lives in ``scaling.py``.

Note [FP8 numerics]: a tensor ``x`` with scale ``s`` (fp32 scalar) is stored as
``q = fp8(clamp(float32(x) * s, -max, max))``: the product in fp32, values beyond the
format's largest finite value saturate to it (Transformer Engine documents the same
clipping), and the cast rounds to nearest, ties to even (``Tensor.to``). NaN stays NaN.
Dequantization multiplies by ``scale_inv = 1 / s`` (computed once in fp32, as Transformer
Engine keeps ``scale_inv``). A product of two FP8 tensors is
``(qa * inv_a) @ (qb * inv_b)`` accumulated in fp32 and returned in the activation dtype.

Note [FP8 passes over memory]: without fused kernels each elementwise step reads and writes
the whole tensor, and on a GPU the FP8 layer's time beside its matrix products is these
passes. Per element of a bf16 tensor: ``amax`` reads 2 bytes and writes 2 (NaNs zeroed),
then reads 2 (the infinity norm); ``quantize`` reads 2 and writes 4 (the fp32 product),
reads 4 and writes 4 (clamp), reads 4 and writes 1 (cast): 25 bytes, where a fused
amax-and-cast would move 5. Each pass here is kept because it changes a result bit for
bit otherwise (the product in fp32 before the clamp, NaNs out of the amax).
docs/fp8.md, "On the GPU", has the measured cost.

Note [FP8 matmul on CPU and CUDA]: ``torch._scaled_mm`` on a CPU without AMX is emulated:
both operands are converted to fp32, multiplied by their scale, ``mat_b`` made contiguous,
and one fp32 ``matmul`` follows. That is the definition above, so a quantize-dequantize
emulation that does the same steps matches it bit for bit (tests/unit/test_fp8_numerics.py).
But the op itself is slow there, far beyond its arithmetic: on torch 2.13's CPU build, one
thread, a 128 x 64 x 128 product took 95 ms against 0.15 ms for the same steps written
out, and 512 x 512 x 512 took 11.9 s against 5.6 ms, with equal results. So on the CPU
``scaled_matmul`` writes the steps out itself (outside ``torch.autocast``, which the op
ignores): for the layers' output dtypes (fp32, bf16, fp16) the same bits where the op is
the definition, and the definition everywhere (a CPU whose oneDNN kernel sums in its own
order gets the definition's order instead). An FP8 output is not one the layers ask for:
there the cast saturates where the op gives NaN. A 4-step FP8 run of examples/train.py
on 4 ranks spent 11.6 of its 17.7 s in the op before.
On CUDA it is cuBLASLt's FP8 GEMM (sm_89+): same products, exact in fp32, summed in the
kernel's own order, so results agree with the CPU to fp32 rounding of the sums. cuBLASLt
needs ``mat_a`` row-major, ``mat_b`` column-major and the inner dimensions divisible by 16;
a product whose shapes miss that is computed by the definition in fp32 instead (same
values, no FP8 speed), and a warning names the shape once.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_sagemaker._torch_compat import float8
from torch_sagemaker.logger import warn_once


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def amax(t: torch.Tensor) -> torch.Tensor:
    """The largest absolute value of ``t`` as an fp32 scalar tensor, outside autograd.

    NaN elements are left out (0 for a tensor of NaNs), as Transformer Engine's amax kernels
    do (``fmaxf`` returns the other operand of a NaN): ``amax`` propagates NaN, and a NaN
    in the MAX all-reduce of amaxes gives backend- and order-dependent results, so ranks
    could end with different scales. Infinities count (amax inf).
    """
    # Two passes over ``t`` (Note [FP8 passes over memory]): NaNs zeroed into a copy, then
    # the infinity norm, max |t|, which is exact in any order and needs no |t| copy.
    with torch.no_grad():
        if t.numel() == 0:  # an empty batch: nothing to scale (the inf norm has no identity)
            return torch.zeros((), dtype=torch.float32, device=t.device)
        inf = float("inf")
        clean = torch.nan_to_num(t.detach(), nan=0.0, posinf=inf, neginf=-inf)
        return torch.linalg.vector_norm(clean, ord=inf).float()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` scaled, saturated and cast to ``dtype`` (Note [FP8 numerics]).

    Three passes (Note [FP8 passes over memory]): the fp32 product, the clamp in place, the
    cast. ``scale`` as a 1-element tensor takes part in type promotion, so a bf16 ``x``
    times it is computed in fp32 by one kernel, with no fp32 copy of ``x`` first.
    """
    limit = fp8_max(dtype)
    return torch.mul(x, scale.reshape(1)).clamp_(-limit, limit).to(dtype)


def delayed_scales(
    history: torch.Tensor,
    old_scale: torch.Tensor,
    max_value: torch.Tensor,
    recipe: Any,
) -> torch.Tensor:
    """New scales from amax histories by the delayed-scaling rule (Note [Delayed scaling rule]).

    Args:
        history: ``[amax_history_len, n]``, row 0 the current step's amaxes.
        old_scale: ``[n]`` scales in use.
        max_value: ``[n]`` largest value of each tensor's FP8 format.
        recipe: The ``DelayedScaling`` recipe.

    Returns:
        ``[n]`` scales; where the amax is 0 or not finite (a tensor that was all zeros, or
        overflowed) the old scale is kept, and where the scale would be infinite (amax
        below fp32's smallest normal ratio) it is fp32's largest value, as in Transformer
        Engine. A ``scaling_factor_compute_algo`` decides alone.
    """
    algo = recipe.amax_compute_algo
    if callable(algo):
        current = algo(history)
    elif algo == "max":
        current = history.amax(dim=0)
    else:  # "most_recent"
        current = history[0]
    if recipe.scaling_factor_compute_algo is not None:
        return recipe.scaling_factor_compute_algo(current, old_scale, max_value, recipe)
    new = (max_value / current) / (2.0**recipe.margin)
    new = torch.where((current > 0) & torch.isfinite(current), new, old_scale)
    return _finite(new)


_FP32_MAX = torch.finfo(torch.float32).max


def _finite(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with infinities replaced by fp32's largest value (Transformer Engine's rule)."""
    return torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)


def current_scale(t_amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """The current-scaling scale of a tensor whose amax is ``t_amax``.

    ``fp8_max / amax``; 1 where amax is 0 or infinite (no scale maps it into range), fp32's
    largest value where the ratio overflows, as Transformer Engine computes it. With
    ``power_of_2`` rounded down to a power of two, from the exponent bits (``log2`` in fp32
    rounds values just below a power of two up to it).
    """
    usable = (t_amax > 0) & torch.isfinite(t_amax)
    scale = torch.where(usable, _finite(fp8_max(dtype) / t_amax), torch.ones_like(t_amax))
    if power_of_2:
        _, exponent = torch.frexp(scale)  # scale = m * 2**exponent, 0.5 <= m < 1
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def _cuda_shapes_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


def _definition(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * inv_a) @ (b * inv_b)`` in fp32, as the CPU's ``torch._scaled_mm`` computes it.

    Outside any ``torch.autocast`` region, which would round the fp32 operands of the
    ``matmul`` to its lower precision (the op itself is not autocast).
    """
    with torch.autocast(a.device.type, enabled=False):
        product = torch.matmul(a.float() * inv_a, (b.float() * inv_b).contiguous())
    return product.to(out_dtype)


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * inv_a) @ (b * inv_b)`` in ``out_dtype`` for FP8 ``a`` ``[M, K]``, ``b`` ``[K, N]``.

    On CUDA, ``b`` is laid out column-major first (a copy unless it already is); shapes that
    cuBLASLt refuses go through the fp32 definition, as every CPU product does (Note [FP8
    matmul on CPU and CUDA]).
    """
    a = a.contiguous()
    if a.device.type == "cpu":
        return _definition(a, b, inv_a, inv_b, out_dtype)
    if a.is_cuda:
        if not _cuda_shapes_ok(a, b):
            warn_once(
                f"FP8 matmul {tuple(a.shape)} x {tuple(b.shape)}: cuBLASLt needs the inner "
                "dimensions divisible by 16; computed in fp32 from the FP8 values instead (no "
                "FP8 speed-up for this layer)."
            )
            return _definition(a, b, inv_a, inv_b, out_dtype)
        if b.stride(0) != 1:  # not column-major
            b = b.t().contiguous().t()
    return float8.scaled_mm(a, b, inv_a, inv_b, out_dtype)


__all__ = [
    "amax",
    "current_scale",
    "delayed_scales",
    "fp8_max",
    "quantize",
    "scaled_matmul",
]
