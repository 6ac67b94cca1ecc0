"""The time model against measured steps on this machine: calibrate, measure, compare.

1. Calibration (``calibration.calibrate``): this machine's matrix-multiply rate on the
   model's GEMM shapes, memory bandwidth and AdamW time per element, on as many concurrent
   one-thread processes as the measurement runs, before and after the measurements
   (averaged). They become the planner's ``Machine`` for that many ranks.
2. Measurement: ``bench training``'s rows (1 rank alone, N ranks alone, FSDP2 full and hybrid
   sharding, DDP; smddp and gloo) and ``bench multihost --train``'s layouts (FSDP2 over H
   simulated hosts of L ranks, each host's NIC shaped to a rate, and one host of as many
   ranks), each ``runs`` times.
3. Prediction: the planner's time model for the same model, layout and batch, with the
   calibrated ``Machine``, no overlap (the ranks' collectives take the cores the compute
   needs). Collectives inside one host are priced by the lines the calibration measured for
   the row's backend (smddp's shared memory and gloo's loopback TCP differ several-fold,
   which one cost model for both missed by up to 45%); between hosts by the cost model
   fitted on the recorded ``bench multihost`` runs (``tests/data/multihost``), which are
   smddp's.

``run`` returns a record holding everything (calibration, costs, measurements, the machine's
load), so that ``predict_rows`` reproduces the predictions from a record alone:
tests/unit/test_planner_time.py checks every row of the quiet-machine records against
``TIME_TOLERANCE``.

The benchmark runners are imported where used; the cost model comes through the planner's
``comm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.planner.calibration import calibrate, machine_of, one_host_lines
from torch_sagemaker.planner import comm
from torch_sagemaker.planner.candidates import Candidate, Rejected, check
from torch_sagemaker.planner.inputs import Cluster, Workload
from torch_sagemaker.planner.model import ModelSpec, describe
from torch_sagemaker.planner.presets import Accelerator
from torch_sagemaker.planner.search import evaluate
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
#: A row's NIC rate where no NIC is crossed (one host) or shaped: far above any collective's.
NO_NIC_BITS = 1e12

#: A CPU as an accelerator: only what the memory model reads; rates come from calibration.
CPU = Accelerator("cpu", 1 << 40, 1.0, 1.0, 1.0, 0.0)


def meta_spec(config: Any) -> ModelSpec:
    """The ``ModelSpec`` of a Hugging Face config (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return describe(model, lookup_policy(model))


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
    nic_bits: float = NO_NIC_BITS,
    cores: float = 0.0,
    backend: str = "smddp",
    accumulation: int = 1,
) -> float:
    """The planner's step time for an fp32 FSDP2 run on CPU ranks (no overlap).

    ``batch`` is each rank's sequences a step, in ``accumulation`` micro-batches.

    ``rates`` are a calibration's (``calibration.calibrate``); its measured one-host
    collectives of ``backend``, if any, price the one-host groups. Simulated hosts whose
    NICs run at a rate (``nic_bits`` below NO_NIC_BITS) have their cables shaped on this
    machine's cores, and their collectives pay that CPU (Note [Shaped cables cost CPU]).
    """
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
    candidate = Candidate(
        hybrid_shard_degree, fsdp=2, checkpointing=False, accumulation_steps=accumulation
    )
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
        one_host=one_host_lines(rates, backend),
        shaper=hosts > 1 and nic_bits < NO_NIC_BITS,
    )
    result = evaluate(spec, checked, cluster, workload, machine_of(rates), fabric)
    return result.time.step


def calibration_key(row: dict) -> str:
    """Which calibration a row uses: its process count and its model's GEMM shapes.

    The shapes are one forward's: a micro-batch's tokens where the row accumulates.
    """
    m = row["model"]
    tokens = row["seq_len"] * row["batch"] // row.get("accumulation", 1)
    return f"{row['processes']} processes, hidden {m['hidden_size']}, {tokens} tokens"


def costs_from(record: dict) -> comm.Costs:
    """The cost model's costs a record was predicted with."""
    return comm.Costs(**record["costs"])


def predict_rows(record: dict) -> list[tuple[dict, float]]:
    """Each measured row of ``record`` with the planner's predicted step seconds."""
    costs = costs_from(record)
    out = []
    for row in record["rows"]:
        spec = _model_spec(tuple(sorted(row["model"].items())))
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
            nic_bits=row.get("nic_bits", NO_NIC_BITS),
            cores=record["cores"],
            backend=backend_of(row),
            accumulation=row.get("accumulation", 1),
        )
        out.append((row, predicted))
    return out


def backend_of(row: dict) -> str:
    """The backend a row ran (records before the field: the first word of its name)."""
    return row.get("backend") or row["name"].split()[0]


@functools.lru_cache(maxsize=16)
def _model_spec(model: tuple[tuple[str, Any], ...]) -> ModelSpec:
    return meta_spec(_config(dict(model)))


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
    from benchmarks import training

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
            "--batch",
            str(args.batch),
            "--accumulation",
            str(args.accumulation),
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
                "backend": backend,
                "model": model,
                "hosts": 1,
                # Alone, each process trains on its own: one rank, n processes' calibration.
                "per_host": 1 if alone else n,
                "processes": n,
                # Alone, nothing is sharded: every process trains its own whole model.
                "hybrid_shard_degree": 1 if alone else TRAINING_MODES[mode](n),
                "alone": alone,
                "seq_len": args.seq,
                "batch": args.batch,
                "accumulation": args.accumulation,
                "measured": seconds,
            }
        )
    return rows


def measure_multihost(args: argparse.Namespace) -> list[dict]:
    """``bench multihost --train``'s layouts, ``args.runs`` times each (smddp)."""
    from benchmarks import multihost, multihost_training
    from benchmarks.multihost_training_report import tokens_per_second
    from tools import netns

    rate = netns.parse_rate(args.rate)
    model = _model_dict(multihost_training.training_config())
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
            tokens.append(tokens_per_second(got["training"], "fsdp2", "smddp"))
        world = hosts * local
        per_step = world * multihost_training.TRAINING_BATCH * multihost_training.TRAINING_SEQ
        rows.append(
            {
                "source": "bench multihost --train",
                "name": f"smddp {hosts}x{local} at {args.rate}",
                "backend": "smddp",
                "model": model,
                "hosts": hosts,
                "per_host": local,
                "processes": world,
                "hybrid_shard_degree": world,
                "seq_len": multihost_training.TRAINING_SEQ,
                "batch": multihost_training.TRAINING_BATCH,
                "nic_bits": rate if hosts > 1 else NO_NIC_BITS,
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


def _calibrate_all(rows: list[dict], backends: list[str]) -> dict[str, dict[str, Any]]:
    calibration: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = calibration_key(row)
        if key not in calibration:
            config = _config(row["model"])
            tokens = row["seq_len"] * row["batch"] // row.get("accumulation", 1)
            spec = meta_spec(config)
            calibration[key] = calibrate(row["processes"], spec, tokens, config, backends)
    return calibration


def _mean(before: Any, after: Any) -> Any:
    """The average of two calibrations, nested dictionaries and lists alike."""
    if isinstance(before, dict):
        return {k: _mean(before[k], after[k]) for k in before}
    if isinstance(before, list):
        return [_mean(b, a) for b, a in zip(before, after)]
    if isinstance(before, int):
        return before
    return (before + after) / 2


def _planned_rows(args: argparse.Namespace) -> list[dict]:
    """The rows the measurement will produce, without their times (to calibrate first)."""
    from benchmarks import multihost_training, training

    rows = []
    if args.modes:
        model = _model_dict(training.model_config(args))
        for n in sorted({1, args.nprocs}):
            rows.append(
                {
                    "model": model,
                    "processes": n,
                    "seq_len": args.seq,
                    "batch": args.batch,
                    "accumulation": args.accumulation,
                }
            )
    for layout in filter(None, args.layouts.split(",")):
        hosts, local = (int(x) for x in layout.split("x"))
        rows.append(
            {
                "model": _model_dict(multihost_training.training_config()),
                "processes": hosts * local,
                "seq_len": multihost_training.TRAINING_SEQ,
                "batch": multihost_training.TRAINING_BATCH,
            }
        )
    return rows


def out_of_tolerance(record: dict) -> list[tuple[str, float]]:
    """The rows whose prediction is further than ``TIME_TOLERANCE`` from their median run."""
    return [(name, err) for name, err in errors(record) if abs(err) > TIME_TOLERANCE]


def run(args: argparse.Namespace, costs: comm.Costs) -> dict:
    """Calibrates, measures, calibrates again and returns the record (module docstring).

    The machine's speed drifts (other work on a shared machine): the calibration before and
    the one after the measurements are averaged, and both are kept.
    """
    load_before = os.getloadavg()
    planned = _planned_rows(args)
    backends = sorted(set(args.backends.split(",")) - {"none"} | {"smddp"})
    before = _calibrate_all(planned, backends)
    rows = []
    if args.modes:
        rows += measure_training(args)
    if args.layouts:
        rows += measure_multihost(args)
    after = _calibrate_all(planned, backends)
    calibration = _mean(before, after)
    return {
        "recorded": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "cores": os.cpu_count(),
        "calibration": calibration,
        "calibration_before": before,
        "calibration_after": after,
        "costs": dataclasses.asdict(costs),
        "rows": rows,
        "note": args.note,
    }


__all__ = [
    "TIME_TOLERANCE",
    "calibration_key",
    "errors",
    "meta_spec",
    "out_of_tolerance",
    "predict_rows",
    "predict_step",
    "run",
    "table",
]
