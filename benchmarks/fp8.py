"""``python -m benchmarks fp8``: FP8 against bf16 matrix products and linear layers.

For each layer shape (tokens M, in K, out N) of two models, one process on one device:

- ``example``: examples/train.py's default model (hidden 192, 6 heads of 32, 2 kv heads,
  MLP 512; batch 8 x 128 tokens);
- ``4096``: a 4096-wide layer (Llama 3 8B's: 32 heads of 128, 8 kv heads, MLP 14336;
  8192 tokens).

it times, as medians over ``--iters`` after ``--warmup`` (CUDA events on a GPU):

- ``bf16 mm``: ``x @ w.T`` in bf16 (the baseline, same run);
- ``fp8 mm``: ``torch._scaled_mm`` of operands already in FP8 (what the tensor cores do);
- ``fp8 fwd``: ``Fp8Linear`` forward under ``fp8_autocast`` (amax, quantization and the
  product), against ``bf16 fwd`` (``nn.Linear`` in bf16);
- ``fp8 fwd+bwd`` against ``bf16 fwd+bwd``: forward and backward of the layer.

and, for each tensor an FP8 linear layer quantizes (``--quantize``, on by default), where
the time beside the products goes (Note [FP8 passes over memory] in
``torch_sagemaker/fp8/numerics.py``):

- ``eager``: the layer's ``amax`` and ``quantize`` of the tensor, as it runs them;
- ``compiled``: the same two functions under ``torch.compile`` (fused by Inductor), and
  whether its FP8 values and amax are bit-identical to eager's;
- the floors: the bytes each moves (25 per bf16 element eager, 5 fused: read twice, write
  the FP8 byte once) at the device's copy bandwidth, measured in the same run.

Speed-ups are bf16 time / FP8 time of the same row. FP8 products need an sm_89+ GPU; on a
CPU the products are emulated in fp32 (Note [FP8 matmul on CPU and CUDA]) and the numbers
only check the plumbing (``--shapes tiny`` keeps that short).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

# name -> [(layer, tokens, in, out)]
SHAPES: dict[str, list[tuple[str, int, int, int]]] = {
    "example": [
        ("q_proj/o_proj", 1024, 192, 192),
        ("k_proj/v_proj", 1024, 192, 64),
        ("gate/up_proj", 1024, 192, 512),
        ("down_proj", 1024, 512, 192),
    ],
    "4096": [
        ("q_proj/o_proj", 8192, 4096, 4096),
        ("k_proj/v_proj", 8192, 4096, 1024),
        ("gate/up_proj", 8192, 4096, 14336),
        ("down_proj", 8192, 14336, 4096),
    ],
    "tiny": [("tiny", 32, 64, 48)],
}
EAGER_BYTES, FUSED_BYTES = 25, 5  # per bf16 element (Note [FP8 passes over memory])


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks fp8", description=__doc__)
    p.add_argument("--shapes", default="example,4096", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--quantize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time amax and quantization per tensor, eager and compiled (--no-quantize: not)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the quantization table's compiled column (--no-compile: eager only)",
    )
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown --shapes {unknown}; choose from {sorted(SHAPES)}")
    return args


def _median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _row(
    model: str, layer: str, m: int, k: int, n: int, device: torch.device, args: argparse.Namespace
) -> dict:
    # Imported here: benchmarks load the library lazily (docs/architecture.md, section 2).
    from torch_sagemaker._torch_compat import float8
    from torch_sagemaker.fp8 import DelayedScaling, fp8_autocast, to_fp8_linear

    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    plain = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    fp8_layer = to_fp8_linear(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    fp8_layer.load_state_dict(plain.state_dict())
    recipe = DelayedScaling()
    one = torch.ones((), device=device)
    xq, wq = x.to(torch.float8_e4m3fn), plain.weight.detach().to(torch.float8_e4m3fn)
    w = plain.weight.detach()
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()

    def fp8_fwd() -> object:
        with torch.no_grad(), fp8_autocast(enabled=True, fp8_recipe=recipe):
            return fp8_layer(x)

    def fp8_step() -> None:
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = fp8_layer(xg)
        y.backward(grad)

    def bf16_step() -> None:
        plain(xg).backward(grad)

    def time_it(fn: Callable[[], object]) -> float:
        return _median_ms(fn, device, args.iters, args.warmup)

    row = dict(model=model, layer=layer, m=m, k=k, n=n)
    row["bf16 mm"] = time_it(lambda: x @ w.t())
    row["fp8 mm"] = time_it(lambda: float8.scaled_mm(xq, wq.t(), one, one, torch.bfloat16))
    with torch.no_grad():
        row["bf16 fwd"] = time_it(lambda: plain(x))
    row["fp8 fwd"] = time_it(fp8_fwd)
    row["bf16 fwd+bwd"] = time_it(bf16_step)
    row["fp8 fwd+bwd"] = time_it(fp8_step)
    return row


def copy_bandwidth(device: torch.device, args: argparse.Namespace) -> float:
    """Bytes per second a device-to-device copy of 256 MiB moves (read plus written)."""
    src = torch.empty(128 * 2**20, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, args.iters, args.warmup)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def _tensors(model: str) -> dict[str, tuple[int, int]]:
    """The distinct shapes a model's FP8 layers quantize: inputs, weights, output gradients."""
    out: dict[str, tuple[int, int]] = {}
    for layer, m, k, n in SHAPES[model]:
        out.setdefault(f"x [{m} x {k}]", (m, k))
        out.setdefault(f"w {layer}", (n, k))
        out.setdefault(f"dy [{m} x {n}]", (m, n))
    return out


def quantize_rows(
    model: str, device: torch.device, bandwidth: float, args: argparse.Namespace
) -> list[dict]:
    """Eager and compiled amax-and-quantize of each tensor ``model``'s layers quantize."""
    from torch_sagemaker.fp8.numerics import amax, quantize

    def both(t: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return amax(t), quantize(t, scale, torch.float8_e4m3fn)

    compiled = torch.compile(both, dynamic=True) if args.compile else None
    rows = []
    for name, shape in _tensors(model).items():
        t = torch.randn(shape, device=device, dtype=torch.bfloat16)
        scale = torch.tensor(3.0, device=device)
        row = dict(model=model, tensor=name, elements=t.numel())
        row["eager"] = _median_ms(partial(both, t, scale), device, args.iters, args.warmup)
        if compiled is None:
            row["compiled"], row["same"] = None, "-"
        else:
            _time_compiled(row, compiled, both, t, scale, device, args)
        for what, per in (("eager floor", EAGER_BYTES), ("fused floor", FUSED_BYTES)):
            row[what] = per * t.numel() / bandwidth * 1e3
        rows.append(row)
    return rows


def _time_compiled(row: dict, compiled, both, t, scale, device, args) -> None:
    """Fills ``row``'s compiled time and whether its results equal eager's bit for bit."""
    try:
        a, q = compiled(t, scale)
        ea, eq = both(t, scale)
        same = torch.equal(a, ea) and torch.equal(q.view(torch.uint8), eq.view(torch.uint8))
        row["same"] = bool(same)
        row["compiled"] = _median_ms(partial(compiled, t, scale), device, args.iters, args.warmup)
    except Exception as e:  # a backend that cannot compile here: said in the table
        row["compiled"], row["same"] = None, f"{type(e).__name__}"


def quantize_table(rows: list[dict], bandwidth: float) -> str:
    """The quantization table: eager and compiled times against their bytes' floors."""
    lines = [
        f"amax + quantize of each tensor (bf16 to e4m3), ms; floors at the copy bandwidth "
        f"{bandwidth / 1e9:.3g} GB/s: {EAGER_BYTES} bytes per element eager, {FUSED_BYTES} fused",
        "| model | tensor | elements | eager | eager floor | eager / floor | compiled "
        "| same bits | fused floor | compiled / fused floor |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        c = r["compiled"]
        cells = [
            r["model"],
            r["tensor"],
            f"{r['elements']:,}",
            f"{r['eager']:.3f}",
            f"{r['eager floor']:.3f}",
            f"{r['eager'] / r['eager floor']:.2f}",
            "-" if c is None else f"{c:.3f}",
            str(r["same"]),
            f"{r['fused floor']:.3f}",
            "-" if c is None else f"{c / r['fused floor']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The printed table: times in ms and the bf16 / FP8 ratios of the same run."""
    head = "| model | layer | M x K x N | bf16 mm | fp8 mm | x | bf16 fwd | fp8 fwd | x |"
    head += " bf16 fwd+bwd | fp8 fwd+bwd | x |"
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        cells = [r["model"], r["layer"], f"{r['m']} x {r['k']} x {r['n']}"]
        for base, fp8 in (
            ("bf16 mm", "fp8 mm"),
            ("bf16 fwd", "fp8 fwd"),
            ("bf16 fwd+bwd", "fp8 fwd+bwd"),
        ):
            cells += [f"{r[base]:.3f}", f"{r[fp8]:.3f}", f"{r[base] / r[fp8]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints its table; returns 0."""
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        print(f"device: {torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})")
    else:
        print("device: CPU (FP8 products emulated in fp32: plumbing only, not a speed figure)")
    rows = [
        _row(model, *shape, device=device, args=args)
        for model in args.shapes
        for shape in SHAPES[model]
    ]
    print(f"median of {args.iters} after {args.warmup} warm-up, ms; x = bf16 / fp8")
    print(table(rows))
    if args.quantize:
        bandwidth = copy_bandwidth(device, args)
        q_rows = [r for model in args.shapes for r in quantize_rows(model, device, bandwidth, args)]
        print(quantize_table(q_rows, bandwidth))
    return 0


__all__ = ["SHAPES", "main", "table"]
