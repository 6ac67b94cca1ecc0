"""Where an FP8 run of the example model departs from bf16: quantization statistics and variants.

    torchrun --standalone --nproc_per_node 2 scripts/fp8_diagnostics.py [options] \
        -- [examples/train.py flags]

Runs ``examples/train.py`` unchanged in one of these forms (docs/log/fp8.md, "2026-11-29: why
the 200-step runs part mid-training"):

- ``--stats FILE`` (with ``--fp8 1``): for every step, FP8 layer and tensor (input ``x``,
  weight ``w``, output gradient ``dy``) on rank 0, what its quantization did: the amax, the
  scale it used, the binades of the format left unused above the amax (the cost of a stale
  delayed scale), the fractions of elements saturated, flushed to zero and left subnormal,
  the relative error ``|dq(q(t)) - t| / |t|``, and the same error and flush fraction had the
  scale been the tensor's own (current scaling). The statistics are computed on copies: the
  run's numerics are those of a plain run.
- ``--fp8-layers attention|mlp``: only the attention projections, or only the MLPs, in FP8;
  the other plan layers compute as ``nn.Linear``.
- ``--recipe current``: ``Float8CurrentScaling(HYBRID)`` in place of the script's recipe.
- ``--calibrate``: before step 1, one FP8 forward and backward of step 1's batch whose
  gradients are dropped; its amaxes set the delayed scales, so no step quantizes at scale 1.
- ``--noise X,W,DY`` (with ``--fp8 0``): no FP8; each plan layer's input, weight and output
  gradient is multiplied elementwise by ``1 + sigma * N(0, 1)`` with these sigmas, then the
  products run in the activation dtype: unbiased noise of FP8's size (the relative errors
  the statistics measure), to see how far noise alone moves the run.

Compare the runs' ``metrics.json`` with ``scripts/fp8_loss_curve.py --reuse`` or
``compare_runs``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
ROLE_NAMES = ("x", "w", "dy")


def quantization_stats(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> dict:
    """What quantizing ``t`` with ``scale`` to ``dtype`` does (module docstring).

    Args:
        t: The tensor (any float dtype).
        scale: The fp32 scale it is quantized with.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        ``amax``, ``scale``, ``headroom`` (log2 of fp8_max over amax * scale: binades unused
        above the amax; negative where it saturates), ``saturated``, ``flushed`` (nonzero
        elements that become 0), ``subnormal`` (nonzero elements below the smallest normal,
        flushed ones included), ``rel_err``, and ``rel_err_current`` / ``flushed_current``
        with the scale fp8_max / amax.
    """
    from torch_sagemaker.fp8.numerics import current_scale, fp8_max, quantize

    with torch.no_grad():
        tf = t.detach().float()
        limit, tiny = fp8_max(dtype), float(torch.finfo(dtype).tiny)
        nonzero = tf != 0
        count = max(int(nonzero.sum()), 1)
        norm = float(tf.norm()) or 1.0
        t_amax = tf.abs().amax()

        def apply(s: torch.Tensor) -> tuple[float, float, float, float]:
            q = quantize(tf, s, dtype).float()
            err = float((q / s - tf).norm()) / norm
            flushed = float((nonzero & (q == 0)).sum()) / count
            subnormal = float((nonzero & (q.abs() < tiny)).sum()) / count
            saturated = float(((tf * s).abs() > limit).sum()) / tf.numel()
            return err, flushed, subnormal, saturated

        s = scale.float()
        err, flushed, subnormal, saturated = apply(s)
        current = current_scale(t_amax, dtype, False)
        err_cur, flushed_cur, _, _ = apply(current)
        used = float(t_amax * s)
        return dict(
            amax=float(t_amax),
            scale=float(s),
            headroom=math.log2(limit / used) if used > 0 else float("inf"),
            saturated=saturated,
            flushed=flushed,
            subnormal=subnormal,
            rel_err=err,
            rel_err_current=err_cur,
            flushed_current=flushed_cur,
        )


class _Stats:
    """Rows of ``quantization_stats`` by step, layer and role (rank 0 only)."""

    def __init__(self) -> None:
        self.enabled = int(os.environ.get("RANK", "0")) == 0
        self.step = 0
        self.names: dict[int, str] = {}  # id(LinearScaling) -> layer name
        self.rows: list[dict] = []
        self.model: nn.Module | None = None

    def add(self, state: Any, role: int, t: torch.Tensor, scale: torch.Tensor, dtype) -> None:
        if not self.enabled:
            return
        name = self.names.get(id(state), "?")
        row = quantization_stats(t, scale, dtype)
        self.rows.append(dict(step=self.step, layer=name, role=ROLE_NAMES[role], **row))


STATS = _Stats()


def _wants(name: str, which: str) -> bool:
    return which == "all" or (".self_attn." in f".{name}.") == (which == "attention")


def _patch_transform(tsm: Any, which: str) -> None:
    """After ``tsm.transform``: names the FP8 layers, and keeps FP8 on ``which`` of them only."""
    from torch_sagemaker.fp8 import Fp8Linear

    original = tsm.transform

    def transform(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        model = original(model, *args, **kwargs)
        STATS.model = model  # FSDP2 shards it in place: the same module trains
        kept = dropped = 0
        for name, module in model.named_modules():
            if isinstance(module, Fp8Linear):
                if _wants(name, which):
                    STATS.names[id(module.fp8_scaling)] = name
                    kept += 1
                else:
                    module.__class__ = nn.Linear
                    dropped += 1
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[diagnostics] FP8 layers kept: {kept} ({which}), back to nn.Linear: {dropped}")
        return model

    tsm.transform = transform


def _patch_stats() -> None:
    """Records ``quantization_stats`` of every FP8 quantization on rank 0 (not recomputation)."""
    from torch_sagemaker.fp8 import linear

    original = linear._Call.scale

    def scale(self: Any, role: int, t: torch.Tensor, record: bool) -> torch.Tensor:
        s = original(self, role, t, record)
        if not self.recomputing:
            STATS.add(self.state, role, t, s, self.dtype(role))
        return s

    linear._Call.scale = scale


def _patch_region(train: Any, recipe: str, calibrate: bool = False) -> None:
    """Counts steps (one region per step) and swaps the recipe for ``recipe="current"``.

    With ``calibrate``, before step 1 one FP8 forward and backward of step 1's batch runs and
    its gradients are dropped: its amaxes set the scales, so no training step uses scale 1.
    """
    from torch_sagemaker.fp8 import Float8CurrentScaling, Format

    original = train.fp8_autocast
    batches: list[torch.Tensor] = []
    batch_for_cp_rank = train.data.batch_for_cp_rank

    def keep(batch: torch.Tensor) -> torch.Tensor:
        batches[:] = [batch_for_cp_rank(batch)]
        return batches[0]

    train.data.batch_for_cp_rank = keep

    @contextlib.contextmanager
    def fp8_autocast(*args: Any, **kwargs: Any) -> Iterator[None]:
        STATS.step += 1
        if recipe == "current":
            kwargs["fp8_recipe"] = Float8CurrentScaling(fp8_format=Format.HYBRID)
        if calibrate and STATS.step == 1 and kwargs.get("enabled") and STATS.model is not None:
            with original(*args, **kwargs):
                b = batches[0]
                loss = STATS.model(input_ids=b, attention_mask=None, labels=b).loss
            loss.backward()
            STATS.model.zero_grad(set_to_none=True)
        with original(*args, **kwargs):
            yield

    train.fp8_autocast = fp8_autocast


class _NoisyLinear(torch.autograd.Function):
    """``x @ w^T`` with multiplicative noise on ``x``, ``w`` and the output gradient.

    The weight's noise comes from ``gens[0]``, seeded alike on every rank (as FP8 rounds the
    same weight alike everywhere); the input's and the gradient's from ``gens[1]``, per rank.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, sig: tuple, gens: tuple
    ) -> torch.Tensor:
        wn = _noisy(w.to(x.dtype), sig[1], gens[0])
        xn = _noisy(x, sig[0], gens[1])
        ctx.save_for_backward(xn, wn)
        ctx.sig, ctx.gens, ctx.w_dtype = sig, gens, w.dtype
        return xn @ wn.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        xn, wn = ctx.saved_tensors
        g = _noisy(grad, ctx.sig[2], ctx.gens[1])
        dx = g @ wn
        dw = g.reshape(-1, g.shape[-1]).t() @ xn.reshape(-1, xn.shape[-1])
        return dx, dw.to(ctx.w_dtype), None, None


def _noisy(t: torch.Tensor, sigma: float, gen: torch.Generator) -> torch.Tensor:
    """``t * (1 + sigma * N(0, 1))`` elementwise, in ``t``'s dtype."""
    n = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    return (t.float() * (1 + sigma * n)).to(t.dtype)


def _patch_noise(sigmas: tuple[float, float, float], seed: int) -> None:
    """Plan layers (``Fp8Linear``, FP8 off) compute with ``_NoisyLinear``."""
    from torch_sagemaker.fp8 import Fp8Linear

    rank = int(os.environ.get("RANK", "0"))
    base = 1000 * seed
    gens = (torch.Generator().manual_seed(base), torch.Generator().manual_seed(base + 1 + rank))

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = _NoisyLinear.apply(x, self.weight, sigmas, gens)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    Fp8Linear.forward = forward


def _curve_script() -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    import fp8_loss_curve

    return fp8_loss_curve


def _losses(folder: Path) -> list[float]:
    with open(folder / "metrics.json") as f:
        return json.load(f)["summary"]["losses"]


def compare_runs(bf16: Path, other: Path) -> dict:
    """``fp8_loss_curve.compare`` of two runs' ``metrics.json`` folders, without the curve."""
    out = _curve_script().compare(_losses(bf16), _losses(other))
    out.pop("smoothed")
    return out


LEVELS = (2.9, 2.8, 2.7, 2.6)  # losses the example model passes between steps 30 and 150


def first_below(losses: list[float], level: float) -> int | None:
    """The first step (from 1) whose 10-step mean loss is at or below ``level``, or None."""
    smoothed = _curve_script().moving_average(losses)
    return next((i + 1 for i, v in enumerate(smoothed) if v <= level), None)


def compare_variants(
    bf16: Path, variants: list[str], plot: Path | None, levels: tuple = LEVELS
) -> str:
    """Markdown table (and a plot) of each ``name=folder`` run against the bf16 run's folder.

    Besides the differences of ``fp8_loss_curve.compare``, the steps each run reaches the
    10-step mean losses ``levels`` earlier (-) or later (+) than the bf16 run: whether a run
    follows the bf16 curve shifted in time.
    """
    curve = _curve_script()
    runs = {"bf16": _losses(bf16)}
    for item in variants:
        name, _, folder = item.partition("=")
        runs[name] = _losses(Path(folder))
    results = {n: curve.compare(runs["bf16"], v) for n, v in runs.items() if n != "bf16"}
    base = [first_below(runs["bf16"], level) for level in levels]
    shown = " / ".join(f"{level:g}" for level in levels)
    lines = [
        "| run | largest difference of 10-step means | at step | last 20 steps | "
        f"steps to reach {shown} vs bf16 ({' / '.join(str(b) for b in base)}) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        shifts = []
        for level, b in zip(levels, base):
            step = first_below(runs[name], level)
            shifts.append("-" if step is None or b is None else f"{step - b:+d}")
        lines.append(
            f"| {name} | {100 * r['max_smoothed']:.2f}% | {r['max_smoothed_step']} | "
            f"{100 * r['tail']:.2f}% | {' / '.join(shifts)} |"
        )
    if plot is not None:
        curve.plot(runs, results, plot, "examples/train.py, 2 ranks: variants against bf16")
    return "\n".join(lines)


WINDOWS = ((1, 1), (2, 10), (11, 40), (41, 120), (121, 200))


def summarize(rows: list[dict], windows: tuple = WINDOWS) -> str:
    """Markdown: per tensor role and layer kind, the statistics' means over step windows.

    ``headroom`` and the fractions are means over the window's rows; ``max flushed`` is the
    largest single tensor's flushed fraction.
    """
    lines = [
        "| tensor | layers | steps | headroom (binades) | saturated | flushed to 0 | max flushed "
        "| subnormal | rel. error | rel. error, current scale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for role in ROLE_NAMES:
        for kind in ("attention", "mlp"):
            for lo, hi in windows:
                sel = [
                    r
                    for r in rows
                    if r["role"] == role
                    and lo <= r["step"] <= hi
                    and (".self_attn." in f".{r['layer']}.") == (kind == "attention")
                ]
                if not sel:
                    continue

                def mean(key: str, sel: list[dict] = sel) -> float:
                    return sum(r[key] for r in sel) / len(sel)

                lines.append(
                    f"| {role} | {kind} | {lo}-{hi} | {mean('headroom'):.2f} | "
                    f"{100 * mean('saturated'):.3f}% | {100 * mean('flushed'):.3f}% | "
                    f"{100 * max(r['flushed'] for r in sel):.2f}% | "
                    f"{100 * mean('subnormal'):.3f}% | {100 * mean('rel_err'):.2f}% | "
                    f"{100 * mean('rel_err_current'):.2f}% |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parses the options, patches, runs ``examples/train.py``'s ``main``, writes the stats."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stats", type=Path, default=None)
    p.add_argument("--fp8-layers", choices=("all", "attention", "mlp"), default="all")
    p.add_argument("--recipe", choices=("script", "current"), default="script")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="one FP8 forward and backward of the first batch before step 1 sets the scales",
    )
    p.add_argument("--noise", default=None, help="sigmas of x, w, dy, e.g. 0.025,0.025,0.05")
    p.add_argument("--noise-seed", type=int, default=0)
    p.add_argument("--summarize", type=Path, default=None, help="print a stats file's table")
    p.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="DIR",
        help="BF16_DIR NAME=DIR...: print each run's differences from the bf16 run",
    )
    p.add_argument("--plot", type=Path, default=None, help="with --compare: the PNG")
    args = p.parse_args(argv)
    if args.summarize is not None:
        with open(args.summarize) as f:
            print(summarize(json.load(f)))
        return
    if args.compare is not None:
        print(compare_variants(Path(args.compare[0]), args.compare[1:], args.plot))
        return
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    _patch_transform(train.tsm, args.fp8_layers)
    _patch_region(train, args.recipe, args.calibrate)
    if args.stats is not None:
        _patch_stats()
    if args.noise is not None:
        sigmas = tuple(float(v) for v in args.noise.split(","))
        if len(sigmas) != 3:
            raise ValueError(f"--noise {args.noise!r}: expected three sigmas, x,w,dy")
        _patch_noise(sigmas, args.noise_seed)
    train.main(extra)
    if args.stats is not None and int(os.environ.get("RANK", "0")) == 0:
        args.stats.parent.mkdir(parents=True, exist_ok=True)
        with open(args.stats, "w") as f:
            json.dump(STATS.rows, f)
        print(f"[diagnostics] {len(STATS.rows)} rows: {args.stats}")


if __name__ == "__main__":
    main()
