"""Benchmark of prefetching activation offloading: step time and saved-activation memory.

``python -m benchmarks offload [--layers 8 --hidden 128 ...]`` trains a tiny
Hugging Face Llama with every decoder layer activation-checkpointed and compares, in the
same run, a plain step (no offloading, the baseline), the prefetching offloader at several
horizons, and PyTorch's native ``offload_wrapper``. The configurations take turns step by
step so that load from other processes spreads evenly; the table reports medians.

On CPU the "device" and the host are the same memory: the offload copies are pure
overhead and the memory column is the engine's instrumented count of saved activations
resident on the compute device, which is what offloading reduces on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Config:
    """One row of the table: how to wrap the checkpointed model."""

    name: str
    wrap: Callable[[nn.Module], nn.Module]
    horizon: int | None = None


def build_model(args: argparse.Namespace) -> nn.Module:
    """The checkpointed tiny Llama (same weights for every configuration)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from torch_sagemaker._torch_compat.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=args.vocab,
    )
    model = LlamaForCausalLM(cfg)
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )
    return model


def configs(args: argparse.Namespace) -> list[Config]:
    """The configurations to compare, baselines first.

    The plain model (the baseline), the same with the offload hooks only counting (the
    memory baseline), the prefetching offloader per horizon, and PyTorch's wrapper.
    """
    from torch_sagemaker._torch_compat.checkpoint_wrapper import OffloadWrapper
    from torch_sagemaker.offload import PrefetchOffloadWrapper

    rows = [
        Config("no offload (baseline)", lambda m: m),
        Config(
            "no offload, instrumented (hooks only)",
            lambda m: PrefetchOffloadWrapper(m, horizon=1, offload=False),
        ),
    ]
    for h in args.horizons:
        rows.append(
            Config(
                f"prefetch offload, horizon {h}",
                functools.partial(_prefetching, horizon=h),
                horizon=h,
            )
        )
    rows.append(Config("PyTorch offload_wrapper (no prefetch)", OffloadWrapper))
    return rows


def _prefetching(model: nn.Module, horizon: int) -> nn.Module:
    from torch_sagemaker.offload import PrefetchOffloadWrapper

    return PrefetchOffloadWrapper(model, horizon=horizon)


def run(args: argparse.Namespace) -> list[dict]:
    """Times every configuration, interleaved, and collects the offload counters."""
    from torch_sagemaker.offload import PrefetchOffloadWrapper, get_stats

    rows = configs(args)
    models = [row.wrap(build_model(args)) for row in rows]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    times: list[list[float]] = [[] for _ in rows]
    for step in range(args.warmup + args.steps):
        for i, model in enumerate(models):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[i].append(elapsed)
            if isinstance(model, PrefetchOffloadWrapper) and step < args.warmup + args.steps - 1:
                get_stats(model, reset=True)  # keep the counters of the last step
    results = []
    for row, model, samples in zip(rows, models, times):
        stats = get_stats(model) if isinstance(model, PrefetchOffloadWrapper) else None
        results.append(
            dict(
                name=row.name,
                horizon=row.horizon,
                median_ms=statistics.median(samples) * 1e3,
                stats=stats,
            )
        )
    return results


def format_table(results: list[dict], args: argparse.Namespace) -> str:
    """A Markdown table of the results.

    Step time is compared with the plain model (row 1), memory with the instrumented no-offload
    run (row 2).
    """
    base_ms = results[0]["median_ms"]
    base_peak = results[1]["stats"].peak_resident_bytes
    kib = 1024
    lines = [
        f"Llama: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq "
        f"{args.seq}, fp32, CPU, {torch.get_num_threads()} threads; median of {args.steps} "
        f"steps after {args.warmup} warm-up, configurations interleaved.",
        "",
        "| configuration | step ms (median) | overhead vs baseline | peak resident saved "
        "activations KiB | of no-offload peak | offloaded KiB/step | copy ms/step | "
        "host pool KiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["stats"]
        overhead = (r["median_ms"] / base_ms - 1) * 100
        if s is None:
            cols = ["n/a"] * 5
        else:
            cols = [
                f"{s.peak_resident_bytes / kib:.0f}",
                f"{s.peak_resident_bytes / base_peak:.2f}",
                f"{s.bytes_offloaded / kib:.0f}",
                f"{s.copy_seconds * 1e3:.2f}",
                f"{s.host_pool_bytes / kib:.0f}",
            ]
        lines.append(
            f"| {r['name']} | {r['median_ms']:.1f} | {overhead:+.1f}% | " + " | ".join(cols) + " |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The benchmark's command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks offload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--horizons", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: leave as is)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark and prints the table.

    Args:
        argv: Command-line arguments without the program name (``None``: ``sys.argv``).

    Returns:
        The process exit code.
    """
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(args)
    print(format_table(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
