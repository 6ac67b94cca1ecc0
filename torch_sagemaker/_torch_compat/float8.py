"""The FP8 matrix product: ``torch._scaled_mm``.

Checked on torch 2.13 (CPU build). The schema is the same from 2.5 through 2.13, 2.11
included: ``_scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None,
out_dtype=None, use_fast_accum=False) -> Tensor`` (2.4 returned ``(out, amax)``). torch 2.13
also has a public ``torch.nn.functional.scaled_mm`` whose scales take recipe enums; it was
not checked on 2.11, so the package stays on the op every supported version has. The GPU
check (``make gpu-check``, torch 2.11) calls this function through the FP8 tests.

What each device does with it (Note [FP8 matmul on CPU and CUDA] in
``torch_sagemaker/fp8/numerics.py``): on a CPU without AMX the op is emulated, bit for bit
``matmul(mat_a.float() * scale_a, mat_b.contiguous().float() * scale_b)`` in fp32, any
shape and layout; on CUDA (sm_89 and later) it runs cuBLASLt's FP8 GEMM and requires
``mat_a`` row-major, ``mat_b`` column-major, both inner dimensions divisible by 16, and not
both operands e5m2. On the CPU the op is far slower than its arithmetic, and the FP8
layers write its definition out instead of calling it (``numerics.scaled_matmul``).
"""

from __future__ import annotations

import torch


def scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(mat_a * scale_a) @ (mat_b * scale_b)`` in ``out_dtype``, FP8 operands, fp32 accumulation.

    Args:
        mat_a: ``[M, K]`` float8 matrix.
        mat_b: ``[K, N]`` float8 matrix (column-major on CUDA).
        scale_a: fp32 scalar tensor multiplying ``mat_a`` (the inverse of its quantization scale).
        scale_b: fp32 scalar tensor multiplying ``mat_b``.
        out_dtype: dtype of the result.

    Returns:
        The ``[M, N]`` product.
    """
    return torch._scaled_mm(
        mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=False
    )


__all__ = ["scaled_mm"]
