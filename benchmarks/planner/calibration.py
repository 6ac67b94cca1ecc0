"""This machine's compute rates, measured for the time model's validation.

On ``n`` processes at once, one thread each (as the benchmarks' ranks run, sharing the
machine's cores), each measures its matrix-multiply rate on the model's own GEMM shapes (a
linear layer's forward and both backward products, laid out as autograd lays them out), its
elementwise memory bandwidth (``a + b`` on 32 MiB operands) and AdamW's time per element over
tensors of the model's parameter shapes; medians of a few calls, and the slowest process's
figures count. Each also measures the framework's fixed overhead (Note [Fixed overhead] in
torch_sagemaker/planner/timing.py) on a model of the same family shrunk to hidden 64 and 8
tokens: a step (forward, backward, AdamW) of one layer and of three, plain and wrapped in
FSDP2 over a group of its own. Together, on more than one process, they time each backend's
all_gather_into_tensor, reduce_scatter_tensor and all_reduce at 1 and 16 MiB (nccl-tests'
S, fp32, the slowest rank's median) and fit a line through the two: the cost per call and
per byte that prices one-host collectives (``one_host_lines``). ``machine_of`` turns the
rates into the planner's ``Machine``.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
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


#: The shrunk models of the overhead measurement (Note [Fixed overhead]): narrow for the
#: fixed costs, wide for FSDP2's cost per parameter byte.
TINY = {"hidden_size": 64, "intermediate_size": 176, "vocab_size": 64}
WIDE = {"hidden_size": 512, "intermediate_size": 1408, "vocab_size": 64}
TINY_TOKENS = 8
#: The two sizes (bytes, nccl-tests' S) the one-host collective lines go through.
LINE_SIZES = (1 << 20, 16 << 20)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _tiny_step(
    config: Any, layers: int, fsdp_group: Any | None, sizes: dict[str, int] = TINY
) -> tuple[float, int]:
    """A training step of ``config`` shrunk to ``sizes`` and ``layers``.

    Returns:
        The step's median seconds and the elements of one layer's parameters.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    tiny = copy.deepcopy(config)
    for key, value in sizes.items():
        setattr(tiny, key, value)
    tiny.num_hidden_layers = layers
    tiny.max_position_embeddings = TINY_TOKENS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny).float()
    if fsdp_group is not None:
        mesh = DeviceMesh.from_group(fsdp_group, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, TINY["vocab_size"], (1, TINY_TOKENS))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    elements = sum(p.numel() for p in model.model.layers[0].parameters())
    return _median_seconds(step, repeat=9), elements


def measure_overhead(config: Any, own_group: Any) -> dict[str, float]:
    """This process's fixed overheads and FSDP2's cost per byte (Note [Fixed overhead]).

    The fixed overheads are per step, per layer and per FSDP unit; the cost per byte is per
    byte of a unit's parameters and step.

    Args:
        config: The Hugging Face config whose family is measured (shrunk to ``TINY`` and
            ``WIDE``).
        own_group: A process group of this rank alone, for FSDP2.
    """

    def per_layer(sizes: dict[str, int], group: Any | None) -> tuple[float, float, int]:
        one, _ = _tiny_step(config, 1, group, sizes)
        three, elements = _tiny_step(config, 3, group, sizes)
        return one, (three - one) / 2, elements

    _, layer, _ = per_layer(TINY, None)
    one, wrapped, _ = per_layer(TINY, own_group)
    unit = wrapped - layer
    # Wide layers: what FSDP2 adds per layer beyond its fixed cost, per byte of the layer
    # (its parameters are gathered, copied out and their gradients copied in every step).
    _, wide, elements = per_layer(WIDE, None)
    _, wide_wrapped, _ = per_layer(WIDE, own_group)
    per_byte = (wide_wrapped - wide - unit) / (elements * 4)
    return {
        "layer_overhead": max(0.0, layer),
        "unit_overhead": max(0.0, unit),
        # One layer and two units (the layer's, the root's) are in the one-layer step.
        "step_overhead": max(0.0, one - layer - 2 * unit),
        "fsdp_byte_seconds": max(0.0, per_byte),
    }


def _collective_seconds(group: Any, op: str, size: int) -> float:
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if op == "all_gather":
        out, inp = torch.empty(size // 4), torch.ones(size // 4 // n)
        call = lambda: dist.all_gather_into_tensor(out, inp, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        out, inp = torch.empty(size // 4 // n), torch.ones(size // 4)
        call = lambda: dist.reduce_scatter_tensor(out, inp, group=group)  # noqa: E731
    else:
        buf = torch.ones(size // 4)
        call = lambda: dist.all_reduce(buf, group=group)  # noqa: E731

    def timed() -> None:
        dist.barrier(group=group)
        call()

    with warnings.catch_warnings():  # torch 2.13 deprecates the names; every backend has them
        warnings.simplefilter("ignore", FutureWarning)
        call()
        return _median_seconds(timed, repeat=5)


def measure_lines(backends: list[str]) -> dict[str, dict[str, list[float]]]:
    """Every backend's ``[seconds per call, seconds per byte]`` per collective, this rank."""
    import torch.distributed as dist

    lines: dict[str, dict[str, list[float]]] = {}
    for backend in backends:
        group = dist.new_group(backend=backend)
        lines[backend] = {}
        for op in COLLECTIVES:
            small, large = (_collective_seconds(group, op, size) for size in LINE_SIZES)
            per_byte = max(0.0, (large - small) / (LINE_SIZES[1] - LINE_SIZES[0]))
            lines[backend][op] = [max(0.0, small - per_byte * LINE_SIZES[0]), per_byte]
        dist.barrier()
    return lines


def one_host_lines(rates: dict, backend: str) -> tuple[tuple[str, int, float, float], ...]:
    """The planner's ``Fabric.one_host`` entries for ``backend`` from calibrated rates."""
    measured = rates.get("collectives", {}).get(backend, {})
    return tuple(
        (op, int(rates["processes"]), alpha, per_byte)
        for op, (alpha, per_byte) in sorted(measured.items())
    )


def _calibration_rank(
    rank: int,
    world: int,
    port: int,
    shapes: list,
    params: list,
    config: Any,
    backends: list[str],
    queue: Any,
) -> None:
    import torch.distributed as dist

    import torch_sagemaker  # noqa: F401  (registers the smddp backend)
    from benchmarks import end_rank, set_rank_environment

    set_rank_environment(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    own = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    dist.barrier()  # every process measures while the others do
    rates: dict[str, Any] = measure_rates(shapes, params)
    rates.update(measure_overhead(config, own))
    dist.barrier()
    lines = measure_lines(backends) if world > 1 else {}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (rates, lines))
    if rank == 0:
        slowest: dict[str, Any] = {
            "matmul_flops": min(r["matmul_flops"] for r, _ in gathered),
            "bandwidth": min(r["bandwidth"] for r, _ in gathered),
        }
        for key in (
            "adam_seconds",
            "step_overhead",
            "layer_overhead",
            "unit_overhead",
            "fsdp_byte_seconds",
        ):
            slowest[key] = max(r[key] for r, _ in gathered)
        slowest["processes"] = world
        slowest["collectives"] = {
            backend: {
                op: [max(got[backend][op][i] for _, got in gathered) for i in (0, 1)]
                for op in COLLECTIVES
            }
            for backend in lines
        }
        queue.put(slowest)
    end_rank(queue)


def calibrate(
    nprocs: int, spec: ModelSpec, tokens: int, config: Any, backends: list[str]
) -> dict[str, Any]:
    """The slowest of ``nprocs`` concurrent processes' rates (module docstring, step 1).

    Args:
        nprocs: Processes measuring at once.
        spec: The model (its GEMM and parameter shapes).
        tokens: Tokens per step and process.
        config: The model's Hugging Face config (the overhead's shrunk model).
        backends: Backends whose one-host collectives are measured (``nprocs`` > 1).
    """
    from benchmarks import run_ranks

    return run_ranks(
        _calibration_rank,
        nprocs,
        gemm_shapes(spec, tokens),
        param_shapes(spec),
        config,
        backends,
    )[0]


def machine_of(rates: dict[str, Any]) -> Machine:
    """The planner's ``Machine`` for calibrated rates (records before the overhead had none)."""
    return Machine(
        rates["matmul_flops"],
        rates["bandwidth"],
        rates["adam_seconds"],
        step_overhead=rates.get("step_overhead", 0.0),
        layer_overhead=rates.get("layer_overhead", 0.0),
        unit_overhead=rates.get("unit_overhead", 0.0),
        fsdp_byte_seconds=rates.get("fsdp_byte_seconds", 0.0),
    )


__all__ = [
    "calibrate",
    "gemm_shapes",
    "machine_of",
    "measure_lines",
    "measure_overhead",
    "measure_rates",
    "one_host_lines",
    "param_shapes",
]
