"""The time model against measured steps on this machine: calibrate, measure, compare.

1. Calibration (``calibrate``): on ``n`` processes at once, one thread each (as the
   benchmarks' ranks run, sharing the machine's cores), each measures its matrix-multiply
   rate on the model's own GEMM shapes (forward and both backward products of every weight),
   its elementwise memory bandwidth (``a + b`` on 32 MiB operands) and AdamW's time per
   parameter element; the slowest process's figures count. These become the planner's
   ``Machine`` for that many ranks.
2. Measurement: ``bench training``'s rows (1 rank alone, N ranks alone, FSDP2 full and hybrid
   sharding, DDP; smddp and gloo) and ``bench multihost --train``'s layouts (FSDP2 over H
   simulated hosts of L ranks, each host's NIC shaped to a rate, and one host of as many
   ranks), each ``runs`` times.
3. Prediction: the planner's time model for the same model, layout and batch, with the
   calibrated ``Machine`` and the collective costs fitted on the recorded ``bench multihost``
   runs (``tests/data/multihost``), no overlap (the ranks' collectives take the cores the
   compute needs).

``record`` holds everything (calibration, costs, measurements, the machine's load) so that
``predict_rows`` reproduces the predictions from a record alone:
tests/unit/test_planner_time.py checks every recorded row against ``TIME_TOLERANCE``.

The benchmark runners come from ``torch_sagemaker.bench`` (imported where used, as the
cost model comes through ``comm``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch

from torch_sagemaker.planner import comm
from torch_sagemaker.planner.candidates import Candidate, Rejected, check
from torch_sagemaker.planner.inputs import Cluster, Workload
from torch_sagemaker.planner.model import ModelSpec, describe
from torch_sagemaker.planner.presets import Accelerator
from torch_sagemaker.planner.search import evaluate
from torch_sagemaker.planner.timing import Machine
from torch_sagemaker.policies import lookup_policy

#: How far a predicted step time may be from the measured one (relative, median of the runs).
TIME_TOLERANCE = 0.20
#: bench training's sharding modes, as the planner's hybrid_shard_degree for ``n`` ranks.
TRAINING_MODES = {
    "fsdp2_full": lambda n: n,
    "fsdp2_plain": lambda n: n,
    "fsdp2_hybrid": lambda n: max(1, n // 2),
    "ddp": lambda n: 1,
}
#: A CPU as an accelerator: only what the memory model reads; rates come from calibration.
CPU = Accelerator("cpu", 1 << 40, 1.0, 1.0, 1.0, 0.0)


def meta_spec(config: Any) -> ModelSpec:
    """The ``ModelSpec`` of a Hugging Face config (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return describe(model, lookup_policy(model))


def gemm_shapes(spec: ModelSpec, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every matrix product of one training step's linears, once per kind.

    For each 2-D weight (not the embedding) of shape (N, K): forward (tokens, K) x (K, N),
    input gradient (tokens, N) x (N, K), weight gradient (N, tokens) x (tokens, K).
    """
    kinds = {p.shape for p in spec.params if len(p.shape) == 2 and p.name != spec.embedding}
    shapes = []
    for n, k in sorted(kinds):
        shapes += [(tokens, k, n), (tokens, n, k), (n, tokens, k)]
    return shapes


def _best_seconds(fn: Any, repeat: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rates(shapes: list[tuple[int, int, int]], adam_elements: int = 1 << 22) -> dict:
    """This process's matmul FLOP/s on ``shapes``, memory bandwidth and AdamW s/element."""
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += _best_seconds(lambda a=a, b=b: a @ b)
        flops += 2.0 * m * k * n
    x, y = torch.randn(1 << 23), torch.randn(1 << 23)
    out = torch.empty_like(x)
    bandwidth = 3 * x.numel() * 4 / _best_seconds(lambda: torch.add(x, y, out=out))
    params = [torch.nn.Parameter(torch.randn(adam_elements // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW(params, lr=1e-4)
    adam_s = _best_seconds(adam.step) / adam_elements
    return {"matmul_flops": flops / seconds, "bandwidth": bandwidth, "adam_seconds": adam_s}


def _calibration_rank(rank: int, world: int, port: int, shapes: list, queue: Any) -> None:
    import torch.distributed as dist

    from torch_sagemaker.bench import end_rank, set_rank_environment

    set_rank_environment(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    dist.barrier()  # every process measures while the others do
    rates = measure_rates(shapes)
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


def calibrate(nprocs: int, shapes: list[tuple[int, int, int]]) -> dict[str, float]:
    """The slowest of ``nprocs`` concurrent processes' rates (module docstring, step 1)."""
    from torch_sagemaker.bench import run_ranks

    return run_ranks(_calibration_rank, nprocs, shapes)[0]


def machine_of(rates: dict[str, float]) -> Machine:
    """The planner's ``Machine`` for calibrated rates."""
    return Machine(rates["matmul_flops"], rates["bandwidth"], rates["adam_seconds"])


def predict_step(
    spec: ModelSpec,
    *,
    hosts: int,
    per_host: int,
    hybrid_shard_degree: int,
    seq_len: int,
    batch: int,
    rates: dict[str, float],
    costs: comm.Costs,
    nic_bits: float = 1e12,
    cores: float = 0.0,
) -> float:
    """The planner's step time for an fp32 FSDP2 run on CPU ranks (no overlap)."""
    world = hosts * per_host
    cluster = Cluster(
        hosts=hosts,
        per_host=per_host,
        accelerator=CPU,
        nic_bits=nic_bits,
        overlap=False,
        costs=costs,
        cores_per_host=cores,
    )
    workload = Workload(seq_len, seq_len * batch * world, "float32")
    candidate = Candidate(hybrid_shard_degree, fsdp=2, checkpointing=False)
    checked = check(candidate, spec, cluster, workload)
    if isinstance(checked, Rejected):
        raise ValueError(f"the planner rejects the measured layout: {checked.reason}")
    fabric = comm.Fabric(
        per_host=per_host,
        nic_rate=nic_bits / 8,
        link_rate=0.0,
        costs=costs,
        cores=cores or float(os.cpu_count() or 1),
        machine_ranks=world,  # simulated hosts share this machine's cores
    )
    result = evaluate(spec, checked, cluster, workload, machine_of(rates), fabric)
    return result.time.step


def calibration_key(row: dict) -> str:
    """Which calibration a row uses: its process count and its model's GEMM shapes."""
    m = row["model"]
    return (
        f"{row['processes']} processes, hidden {m['hidden_size']}, "
        f"{row['seq_len'] * row['batch']} tokens"
    )


def costs_from(record: dict) -> comm.Costs:
    """The cost model's costs a record was predicted with."""
    return comm.Costs(**record["costs"])


def predict_rows(record: dict) -> list[tuple[dict, float]]:
    """Each measured row of ``record`` with the planner's predicted step seconds."""
    costs = costs_from(record)
    out = []
    for row in record["rows"]:
        spec = meta_spec(_config(row["model"]))
        rates = record["calibration"][calibration_key(row)]
        predicted = predict_step(
            spec,
            hosts=row["hosts"],
            per_host=row["per_host"],
            hybrid_shard_degree=row["hybrid_shard_degree"],
            seq_len=row["seq_len"],
            batch=row["batch"],
            rates=rates,
            costs=costs,
            nic_bits=row.get("nic_bits", 1e12),
            cores=record["cores"],
        )
        out.append((row, predicted))
    return out


def _config(model: dict) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**model)


def _model_dict(config: Any) -> dict:
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    )
    return {k: getattr(config, k) for k in keys}


def measure_training(args: argparse.Namespace) -> list[dict]:
    """``bench training``'s rows, ``args.runs`` passes (step 2 of the module docstring)."""
    from torch_sagemaker.bench import training

    bench_args = training.parser().parse_args(
        [
            "--nprocs",
            str(args.nprocs),
            "--backends",
            args.backends,
            "--modes",
            args.modes,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
            "--vocab",
            str(args.vocab),
            "--seq",
            str(args.seq),
            "--repeat",
            str(args.runs),
        ]
    )
    model = _model_dict(training.model_config(bench_args))
    rows = []
    for (backend, mode), seconds in training.step_seconds(bench_args).items():
        alone = backend == "none"
        n = 1 if mode == "1 rank" else args.nprocs
        rows.append(
            {
                "source": "bench training",
                "name": f"{backend} {mode}",
                "model": model,
                "hosts": 1,
                # Alone, each process trains on its own: one rank, n processes' calibration.
                "per_host": 1 if alone else n,
                "processes": n,
                # Alone, nothing is sharded: every process trains its own whole model.
                "hybrid_shard_degree": 1 if alone else TRAINING_MODES[mode](n),
                "alone": alone,
                "seq_len": args.seq,
                "batch": 1,
                "measured": seconds,
            }
        )
    return rows


def measure_multihost(args: argparse.Namespace) -> list[dict]:
    """``bench multihost --train``'s layouts, ``args.runs`` times each (smddp)."""
    from torch_sagemaker.bench import multihost, multihost_rank, netns

    rate = netns.parse_rate(args.rate)
    model = _model_dict(multihost_rank.training_config())
    rows = []
    layouts = [tuple(int(x) for x in t.split("x")) for t in args.layouts.split(",") if t]
    for hosts, local in layouts:
        tokens = []
        for _ in range(args.runs):
            got = multihost.run_layout(
                hosts,
                local,
                rate,
                [],
                [],
                ["smddp"],
                1,
                args.timeout,
                False,
                ["smddp"],
                args.steps,
            )
            tokens.append(got["training"]["smddp"])
        world = hosts * local
        per_step = world * multihost_rank.TRAINING_BATCH * multihost_rank.TRAINING_SEQ
        rows.append(
            {
                "source": "bench multihost --train",
                "name": f"smddp {hosts}x{local} at {args.rate}",
                "model": model,
                "hosts": hosts,
                "per_host": local,
                "processes": world,
                "hybrid_shard_degree": world,
                "seq_len": multihost_rank.TRAINING_SEQ,
                "batch": multihost_rank.TRAINING_BATCH,
                "nic_bits": rate if hosts > 1 else 1e12,
                "measured": [per_step / t for t in tokens],
            }
        )
    return rows


def table(record: dict) -> str:
    """Predicted against measured step time, each row (Markdown)."""
    lines = [
        "| source | row | ranks | measured s (runs) | predicted s | error of the median |",
        "|---|---|---|---|---|---|",
    ]
    for row, predicted in predict_rows(record):
        runs = row["measured"]
        median = statistics.median(runs)
        lines.append(
            f"| {row['source']} | {row['name']} | {row['processes']} | "
            f"{median:.3f} ({', '.join(f'{r:.3f}' for r in runs)}) | {predicted:.3f} | "
            f"{predicted / median - 1:+.0%} |"
        )
    return "\n".join(lines)


def errors(record: dict) -> list[tuple[str, float]]:
    """(row name, relative error of the prediction against the median run) of each row."""
    return [
        (row["name"], predicted / statistics.median(row["measured"]) - 1)
        for row, predicted in predict_rows(record)
    ]


def run(args: argparse.Namespace, costs: comm.Costs) -> dict:
    """Calibrates, measures and returns the record (module docstring)."""
    load_before = os.getloadavg()
    rows = []
    if args.modes:
        rows += measure_training(args)
    if args.layouts:
        rows += measure_multihost(args)
    calibration: dict[str, dict[str, float]] = {}
    for row in rows:
        key = calibration_key(row)
        if key not in calibration:
            spec = meta_spec(_config(row["model"]))
            shapes = gemm_shapes(spec, row["seq_len"] * row["batch"])
            calibration[key] = calibrate(row["processes"], shapes)
    return {
        "recorded": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "cores": os.cpu_count(),
        "calibration": calibration,
        "costs": dataclasses.asdict(costs),
        "rows": rows,
        "note": args.note,
    }


__all__ = [
    "TIME_TOLERANCE",
    "calibrate",
    "calibration_key",
    "errors",
    "gemm_shapes",
    "measure_rates",
    "meta_spec",
    "predict_rows",
    "predict_step",
    "run",
    "table",
]
