"""This machine's compute rates, measured for the time model's validation.

On ``n`` processes at once, one thread each (as the benchmarks' ranks run, sharing the
machine's cores), each measures its matrix-multiply rate on the model's own GEMM shapes (a
linear layer's forward and both backward products, laid out as autograd lays them out), its
elementwise memory bandwidth (``a + b`` on 32 MiB operands) and AdamW's time per element over
tensors of the model's parameter shapes; medians of a few calls, and the slowest process's
figures count. ``machine_of`` turns them into the planner's ``Machine``.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import torch

from torch_sagemaker.planner.model import ModelSpec
from torch_sagemaker.planner.timing import Machine


def gemm_shapes(spec: ModelSpec, tokens: int) -> list[tuple[int, int, int]]:
    """(tokens, N, K) of each kind of 2-D weight (N, K) a step multiplies (not the embedding)."""
    kinds = {p.shape for p in spec.params if len(p.shape) == 2 and p.name != spec.embedding}
    return [(tokens, n, k) for n, k in sorted(kinds)]


def param_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """The model's parameter shapes (each tied parameter once), for AdamW's calibration."""
    return [p.shape for p in spec.params if p.tied_to is None]


def _median_seconds(fn: Any, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rates(shapes: list[tuple[int, int, int]], params: list[tuple[int, ...]]) -> dict:
    """This process's matmul FLOP/s, memory bandwidth and AdamW seconds per element.

    Args:
        shapes: ``(tokens, N, K)`` per weight kind: each is timed as a linear layer's three
            products are laid out (``x @ W.T``, ``dY @ W``, ``dY.T @ x``).
        params: Parameter shapes: AdamW steps over tensors of these shapes.
    """
    flops = seconds = 0.0
    for m, n, k in shapes:
        w, x, dy = torch.randn(n, k), torch.randn(m, k), torch.randn(m, n)
        seconds += _median_seconds(lambda w=w, x=x: x @ w.t())
        seconds += _median_seconds(lambda w=w, dy=dy: dy @ w)
        seconds += _median_seconds(lambda x=x, dy=dy: dy.t() @ x)
        flops += 3 * 2.0 * m * n * k
    a, b = torch.randn(1 << 23), torch.randn(1 << 23)
    out = torch.empty_like(a)
    bandwidth = 3 * a.numel() * 4 / _median_seconds(lambda: torch.add(a, b, out=out))
    tensors = [torch.nn.Parameter(torch.randn(shape)) for shape in params]
    for t in tensors:
        t.grad = torch.randn_like(t)
    adam = torch.optim.AdamW(tensors, lr=1e-4)
    elements = sum(t.numel() for t in tensors)
    adam_s = _median_seconds(adam.step, repeat=3) / elements
    return {"matmul_flops": flops / seconds, "bandwidth": bandwidth, "adam_seconds": adam_s}


def _calibration_rank(
    rank: int, world: int, port: int, shapes: list, params: list, queue: Any
) -> None:
    import torch.distributed as dist

    from benchmarks import end_rank, set_rank_environment

    set_rank_environment(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    dist.barrier()  # every process measures while the others do
    rates = measure_rates(shapes, params)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rates)
    if rank == 0:
        queue.put(
            {
                "matmul_flops": min(r["matmul_flops"] for r in gathered),
                "bandwidth": min(r["bandwidth"] for r in gathered),
                "adam_seconds": max(r["adam_seconds"] for r in gathered),
            }
        )
    end_rank(queue)


def calibrate(nprocs: int, spec: ModelSpec, tokens: int) -> dict[str, float]:
    """The slowest of ``nprocs`` concurrent processes' rates (module docstring, step 1)."""
    from benchmarks import run_ranks

    return run_ranks(_calibration_rank, nprocs, gemm_shapes(spec, tokens), param_shapes(spec))[0]


def machine_of(rates: dict[str, float]) -> Machine:
    """The planner's ``Machine`` for calibrated rates."""
    return Machine(rates["matmul_flops"], rates["bandwidth"], rates["adam_seconds"])


__all__ = ["calibrate", "gemm_shapes", "machine_of", "measure_rates", "param_shapes"]
