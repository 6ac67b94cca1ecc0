"""An FP8 linear layer emulated from first principles, to check torch_sagemaker.fp8 against.

Nothing here imports the package. The formats are rebuilt from their bit layouts (every
representable value enumerated), rounding is done on that grid (nearest, ties to the even
code), and the delayed-scaling rule is replayed on plain Python lists of amaxes, as
Transformer Engine's documentation and its update behave: a window of the last
``amax_history_len`` step amaxes including the current one, ``amax`` its maximum (or the
newest), scale ``(fp8_max / amax) / 2**margin`` in fp32, kept where amax is 0 or not
finite, fp32's largest value where the ratio overflows; a step whose amax is 0 leaves the
window and the scale as they were.

The products follow what the FP8 layer is defined to compute (docs/fp8.md, "Numerics"):
operands dequantized in fp32 (value times ``1 / scale``), the second operand laid out
row-major ``[K, N]``, one fp32 ``matmul``. That is also what ``torch._scaled_mm`` does on
the CPUs the package is developed on, hence bit-for-bit comparisons there; ``magnitude``
and ``differences`` bound the comparison where a kernel sums in its own order.
"""

from __future__ import annotations

import numpy as np
import torch

# (exponent bits, mantissa bits, bias, whether the all-ones exponent holds finite values)
_LAYOUT = {
    "e4m3": (4, 3, 7, True),  # e4m3fn: only S.1111.111 is NaN, no infinities
    "e5m2": (5, 2, 15, False),  # IEEE-like: the all-ones exponent is inf/NaN
}


def grid(fmt: str) -> np.ndarray:
    """Every non-negative finite value of ``fmt``, in code order (float64)."""
    exp_bits, man_bits, bias, top_finite = _LAYOUT[fmt]
    values = []
    for e in range(2**exp_bits):
        for m in range(2**man_bits):
            if e == 2**exp_bits - 1 and (not top_finite or m == 2**man_bits - 1):
                continue  # inf / NaN codes
            if e == 0:
                values.append(m / 2**man_bits * 2.0 ** (1 - bias))
            else:
                values.append((1 + m / 2**man_bits) * 2.0 ** (e - bias))
    return np.array(values)


def fmax(fmt: str) -> float:
    return float(grid(fmt)[-1])


def round_to(values: np.ndarray, fmt: str) -> np.ndarray:
    """``values`` (finite, within range) rounded to ``fmt``: nearest, ties to the even code."""
    g = grid(fmt)
    mag = np.abs(values)
    hi = np.clip(np.searchsorted(g, mag), 1, len(g) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - g[lo], g[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(values) * np.where(pick_hi, g[hi], g[lo])


def quantize(x: torch.Tensor, scale: np.float32, fmt: str) -> np.ndarray:
    """FP8 values of ``x * scale`` (the product in fp32), saturated to the format's range."""
    scaled = x.detach().float().numpy() * np.float32(scale)  # fp32 product
    limit = fmax(fmt)
    return round_to(np.clip(scaled.astype(np.float64), -limit, limit), fmt).astype(np.float32)


def inverse(scale: np.float32) -> np.float32:
    return np.float32(np.float32(1.0) / np.float32(scale))


def product(a: np.ndarray, inv_a, b: np.ndarray, inv_b, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * inv_a) @ (b * inv_b)``: both dequantized in fp32, ``b`` row-major, one matmul."""
    ta = torch.from_numpy(np.ascontiguousarray(a * np.float32(inv_a)))
    tb = torch.from_numpy(np.ascontiguousarray(b * np.float32(inv_b)))
    return torch.matmul(ta, tb).to(out_dtype)


U32 = 2.0**-24  # fp32's unit roundoff


def magnitude(a: np.ndarray, inv_a, b: np.ndarray, inv_b) -> np.ndarray:
    """``|a * inv_a| @ |b * inv_b|`` in float64: the sum of the terms' magnitudes.

    Two computations of the same fp32 sums in different orders differ by less than
    ``2 * (K - 1) * U32`` times this (each is within ``(K - 1) * U32`` of the exact sum),
    whatever the order.
    """
    return np.abs(a.astype(np.float64) * float(inv_a)) @ np.abs(b.astype(np.float64) * float(inv_b))


def differences(got: torch.Tensor, want: torch.Tensor, size: np.ndarray) -> np.ndarray:
    """``|got - want|`` over ``size`` (``magnitude``) elementwise, less one rounding of the output.

    For a bf16 output the two sides may round to neighbouring bf16 values: one unit in the
    last place of ``want`` (at most ``2**-7 * |want|``) is taken off first.
    """
    g = got.detach().double().cpu().numpy().reshape(size.shape)
    w = want.detach().double().cpu().numpy().reshape(size.shape)
    diff = np.abs(g - w)
    if got.dtype == torch.bfloat16:
        diff = np.maximum(diff - 2.0**-7 * np.abs(w), 0.0)
    return diff / np.maximum(size, np.finfo(np.float64).tiny)


class DelayedRule:
    """The delayed-scaling rule for one tensor, replayed on a list of past amaxes."""

    def __init__(self, history_len: int, fmt: str, margin: int = 0, algo: str = "max") -> None:
        self.history_len, self.fmt, self.margin, self.algo = history_len, fmt, margin, algo
        self.amaxes: list[np.float32] = []  # every step's amax, oldest first
        self.scale = np.float32(1.0)  # the first step quantizes with scale 1

    def step(self, step_amax: float) -> None:
        """One update with this step's amax (applied before the next step quantizes)."""
        if step_amax == 0:
            return  # nothing enters the window, the scale stays
        self.amaxes.append(np.float32(step_amax))
        window = self.amaxes[-self.history_len :]
        chosen = max(window) if self.algo == "max" else window[-1]
        if chosen > 0 and np.isfinite(chosen):
            with np.errstate(over="ignore"):
                ratio = np.float32(np.float32(fmax(self.fmt)) / chosen)
                scale = np.float32(ratio / np.float32(2.0**self.margin))
            self.scale = scale if np.isfinite(scale) else np.finfo(np.float32).max


class EmulatedLinear:
    """``y = x W^T + b``, FP8 forward (``fwd``) and backward (``bwd``) formats, delayed scaling."""

    def __init__(
        self, history_len: int, fwd: str = "e4m3", bwd: str = "e5m2", margin: int = 0, algo="max"
    ):
        self.x = DelayedRule(history_len, fwd, margin, algo)
        self.w = DelayedRule(history_len, fwd, margin, algo)
        self.g = DelayedRule(history_len, bwd, margin, algo)
        self.fwd, self.bwd = fwd, bwd

    def step(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gy: torch.Tensor
    ) -> dict:
        """Forward and backward of one step with the current scales, then the scale update.

        Returns ``y``, ``dx``, ``dw``, ``db``, the scales used and each product's operands.
        """
        k, n = x.shape[-1], w.shape[0]
        x2, g2 = x.reshape(-1, k), gy.reshape(-1, n)
        used = dict(x=self.x.scale, w=self.w.scale, g=self.g.scale)
        qx, qw = quantize(x2, used["x"], self.fwd), quantize(w, used["w"], self.fwd)
        qg = quantize(g2, used["g"], self.bwd)
        ix, iw, ig = inverse(used["x"]), inverse(used["w"]), inverse(used["g"])
        y = product(qx, ix, qw.T, iw, x.dtype).reshape(*x.shape[:-1], n)
        if b is not None:
            y = y + b.detach()
        dx = product(qg, ig, qw, iw, x.dtype).reshape(x.shape)
        dw = product(qg.T, ig, qx, ix, w.dtype)
        db = gy.sum(dim=tuple(range(gy.ndim - 1))) if b is not None else None
        for rule, t in ((self.x, x2), (self.w, w), (self.g, g2)):
            rule.step(float(t.detach().abs().max()))
        # Each product's FP8 operands and the factors that dequantize them.
        operands = dict(y=(qx, ix, qw.T, iw), dx=(qg, ig, qw, iw), dw=(qg.T, ig, qx, ix))
        return dict(y=y, dx=dx, dw=dw, db=db, scales=used, operands=operands)


__all__ = [
    "U32",
    "DelayedRule",
    "EmulatedLinear",
    "differences",
    "grid",
    "magnitude",
    "quantize",
    "round_to",
]
