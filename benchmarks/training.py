"""Training-step benchmark: FSDP2, FSDP1 as SMP wraps it, and DDP, smddp vs gloo.

    python -m benchmarks training [--nprocs 2] [--steps 4] [--repeat 3] [--plot x.png]
        [--batch 4 --accumulation 4]

A Llama of about 50M parameters (hidden 512, 8 layers, vocab 32000, sequence 256) is trained
for a few steps in each mode on each backend; every number is the median over the timed
steps of the slowest rank. Ranks use one intra-op thread each. The same run measures:

- ``1 rank``: one process alone (same per-rank batch, no communication); the scaling ratio
  ``vs N x 1 rank`` divides by N times its tokens/s;
- ``N ranks alone``: N processes at once, each training its own model with no communication
  (a barrier aligns their steps). This is what the machine gives N ranks before any
  communication (cores, caches and memory bandwidth shared), so ``vs N alone`` is the
  part of the scaling that communication and the sharding library cost, and the exposed
  communication is ``step time - N ranks alone step time``.

The rows run one after another, and on a shared machine its speed drifts between them by
more than the differences measured. ``--repeat R`` runs the whole sequence R times and
reports medians over the passes, each ratio computed within its own pass, with its range.

``--accumulation K`` splits each rank's ``--batch`` into K micro-batches per optimizer step;
the forward and backward columns sum over them, and replicas (``fsdp2_hybrid``, DDP) reduce
their gradients on the last one only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from datetime import timedelta

import torch

from benchmarks import comma_list, end_rank, rank_context, run_ranks, set_rank_environment

MODES = ("fsdp2_full", "fsdp2_plain", "fsdp2_hybrid", "ddp", "fsdp1", "fsdp2_plain_staged")
# fsdp1: FSDP1 FULL_SHARD wrapped as SMP's example scripts wrap it (a unit per decoder
# layer, use_orig_params=True, backward prefetch, forward prefetch, limited all-gathers).
# fsdp2_plain_staged: the plain script with the pool turned off again, i.e. what such a
# script got before Note [Pool buffers for every FSDP2 user]; a baseline, not run by default.
DEFAULT_MODES = MODES[:5]


def model_config(args: argparse.Namespace):
    """The benchmark's Llama config for ``args`` (hidden, layers, vocab, seq)."""
    from transformers import LlamaConfig

    # transformers' generated config signature omits the attn_implementation keyword, which
    # the config accepts at run time.
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def _model(args: argparse.Namespace):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(model_config(args)).float()


def _wrap(model, mode: str, world: int):
    import torch.sagemaker as tsm

    from torch_sagemaker.sharding import shard_model

    tsm.state.reset()
    if mode in ("fsdp2_plain", "fsdp2_plain_staged"):
        # The torchtitan way, no tsm at all: the script calls fully_shard itself on the
        # default group (Note [Pool buffers for every FSDP2 user]).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        units = [fully_shard(layer, mesh=mesh) for layer in model.model.layers]
        units.append(fully_shard(model, mesh=mesh, reshard_after_forward=False))
        if mode == "fsdp2_plain_staged":
            for unit in units:
                unit.set_allocate_memory_from_process_group_for_comm(False)
        return units[-1]
    if mode == "fsdp1":
        return _fsdp1(model)
    if mode == "ddp":
        tsm.init({"hybrid_shard_degree": 1})
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=tsm.state.dp_process_group)
    tsm.init({"hybrid_shard_degree": 0 if mode == "fsdp2_full" else max(1, world // 2)})
    return shard_model(model)


def _fsdp1(model):
    """``model`` in FSDP1 FULL_SHARD after ``tsm.init``, as SMP's train.py wraps it (fp32)."""
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import ShardingStrategy

    from benchmarks.smp_fsdp1 import wrap_as_smp

    tsm.init({"hybrid_shard_degree": 0})
    return wrap_as_smp(model, ShardingStrategy.FULL_SHARD)


def _time_steps(
    model, args: argparse.Namespace, distributed: bool, barrier=None
) -> list[tuple[float, float, float]]:
    """(forward, backward, optimizer) seconds of each timed step, slowest rank.

    ``barrier``: a multiprocessing barrier that starts the steps of processes that do not
    communicate together.
    """
    import torch.distributed as dist

    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        if distributed:
            dist.barrier()
        elif barrier is not None:
            barrier.wait()
        forward = backward = 0.0
        micro = ids.chunk(args.accumulation)
        for i, part in enumerate(micro):
            last = i == len(micro) - 1
            with _replicas_reduced(model, last):
                t0 = time.perf_counter()
                loss = model(input_ids=part, labels=part).loss / len(micro)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            forward, backward = forward + t1 - t0, backward + t2 - t1
        t2 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        times = torch.tensor([forward, backward, t3 - t2], dtype=torch.float64)
        if distributed:
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            out.append(tuple(times.tolist()))
    return out


def _replicas_reduced(model, last: bool) -> contextlib.AbstractContextManager:
    """Replicas' gradients reduced on the step's last micro-batch only.

    FSDP2 keeps reduce-scattering every micro-batch into the shards and all-reduces over
    the replicas on the last (``set_requires_all_reduce``); DDP skips its all-reduce
    (``no_sync``) until then. What the planner assumes of accumulation (Note [Accumulation
    the planner plans]).
    """
    if hasattr(model, "set_requires_all_reduce"):
        model.set_requires_all_reduce(last)
    elif hasattr(model, "no_sync") and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def _rank_main(
    rank: int, world: int, port: int, backend: str, args: argparse.Namespace, results
) -> None:
    set_rank_environment(rank, world, port, "WARNING")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import torch_sagemaker  # noqa: F401  (registers smddp)

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    for mode in args.modes:
        steps = _time_steps(_wrap(_model(args), mode, world), args, distributed=True)
        if rank == 0:
            results.put((backend, mode, steps))
    end_rank(results)


def _single_rank(
    rank: int, world: int, port: int, args: argparse.Namespace, barrier, results
) -> None:
    del rank, world, port  # no communication
    torch.set_num_threads(1)
    steps = _time_steps(_model(args), args, distributed=False, barrier=barrier)
    results.put(("none", "1 rank", steps))


def _ranks_alone(args: argparse.Namespace) -> tuple[str, str, list]:
    """``args.nprocs`` processes training at once without communication; the slowest per step."""
    barrier = rank_context().Barrier(args.nprocs)
    per_rank = [
        r[2] for r in run_ranks(_single_rank, args.nprocs, args, barrier, results=args.nprocs)
    ]
    slowest = [tuple(max(parts) for parts in zip(*steps)) for steps in zip(*per_rank)]
    return ("none", f"{args.nprocs} ranks alone", slowest)


def _run(args: argparse.Namespace) -> list[tuple[str, str, list]]:
    rows = run_ranks(_single_rank, 1, args, None)
    rows.append(_ranks_alone(args))
    for backend in args.backends:
        rows += run_ranks(_rank_main, args.nprocs, backend, args, results=len(args.modes))
    return rows


def step_seconds(args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Runs the benchmark's rows ``args.repeat`` times; each row's median step time per pass.

    Args:
        args: As ``main`` parses them (``parser().parse_args([...])``).

    Returns:
        ``(backend, mode) -> [seconds of the median step, one per pass]``, the rows
        ``("none", "1 rank")`` and ``("none", "N ranks alone")`` included.
    """
    out: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeat):
        for backend, mode, steps in _run(args):
            out.setdefault((backend, mode), []).append(statistics.median(sum(s) for s in steps))
    return out


def _metrics(rows, args: argparse.Namespace) -> dict[tuple[str, str], dict[str, float | None]]:
    """Per (backend, mode) of one pass: tokens/s, step parts (s) and the ratio columns."""
    tokens = args.batch * args.seq
    alone = statistics.median(sum(s) for s in rows[1][2])
    tps = {}
    for backend, mode, steps in rows:
        world = 1 if mode == "1 rank" else args.nprocs
        tps[(backend, mode)] = tokens * world / statistics.median(sum(s) for s in steps)
    out: dict[tuple[str, str], dict[str, float | None]] = {}
    for backend, mode, steps in rows:
        key = (backend, mode)
        step = statistics.median(sum(s) for s in steps)
        gloo = tps.get(("gloo", mode))
        comm = backend != "none"
        out[key] = {
            "tps": tps[key],
            "step": step,
            **{part: statistics.median(s[i] for s in steps) for i, part in enumerate(_PARTS)},
            "exposed": max(0.0, step - alone) if comm else None,
            "vs_gloo": tps[key] / gloo if gloo and comm and backend != "gloo" else None,
            "scaling": None
            if mode == "1 rank"
            else tps[key] / (args.nprocs * tps[("none", "1 rank")]),
            "vs_alone": tps[key] / tps[("none", f"{args.nprocs} ranks alone")] if comm else None,
        }
    return out


_PARTS = ("fwd", "bwd", "optim")


def _table(passes: list, args: argparse.Namespace) -> tuple[str, dict]:
    """The Markdown table of one or more passes (medians over passes; ratios per pass)."""
    per_pass = [_metrics(rows, args) for rows in passes]
    several = len(per_pass) > 1
    lines = [
        f"Llama {args.params_m:.0f}M params, seq {args.seq}, batch {args.batch}/rank, "
        f"{args.nprocs} ranks, "
        f"medians of {args.steps} steps (slowest rank)"
        + (
            f"; {len(per_pass)} passes: medians over the passes, each ratio computed within "
            "its pass (range over the passes in brackets)"
            if several
            else ""
        ),
        "| backend | mode | tokens/s | step ms | fwd ms | bwd ms | optim ms | exposed comm ms | "
        f"vs gloo | vs {args.nprocs} x 1 rank | vs {args.nprocs} alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(key, name: str, fmt: str, scale: float = 1.0) -> str:
        values = [v for m in per_pass if (v := m[key][name]) is not None]
        if len(values) < len(per_pass):
            return ""
        text = fmt.format(statistics.median(values) * scale)
        if several and name in ("vs_gloo", "scaling", "vs_alone"):
            text += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
        return text

    by_key = {}
    for key in per_pass[0]:
        by_key[key] = statistics.median(v for m in per_pass if (v := m[key]["tps"]) is not None)
        ms = " | ".join(cell(key, name, "{:.0f}", 1e3) for name in ("step", *_PARTS, "exposed"))
        lines.append(
            f"| {key[0]} | {key[1]} | {by_key[key]:.0f} | {ms} | "
            f"{cell(key, 'vs_gloo', '{:.2f}x')} | {cell(key, 'scaling', '{:.2f}')} | "
            f"{cell(key, 'vs_alone', '{:.2f}')} |"
        )
    return "\n".join(lines), by_key


def _plot(by_key: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{b}\n{m}" for (b, m) in by_key]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(
        labels,
        list(by_key.values()),
        color=["gray" if b == "none" else "C0" if b == "smddp" else "C1" for (b, _m) in by_key],
    )
    ax.set(ylabel="tokens/s (all ranks)", title="Training throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def accumulation_problem(batch: int, accumulation: int) -> str:
    """Why ``--accumulation`` cannot split ``--batch`` into micro-batches, or ``""``."""
    if accumulation >= 1 and batch % accumulation == 0:
        return ""
    return (
        f"--accumulation {accumulation} does not divide --batch {batch}: each micro-batch is "
        "whole sequences; use a divisor of the batch."
    )


def parser() -> argparse.ArgumentParser:
    """The benchmark's arguments."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks training",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--backends", type=comma_list(), default="smddp,gloo")
    p.add_argument("--modes", type=comma_list(MODES), default=",".join(DEFAULT_MODES))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument(
        "--accumulation",
        type=_positive,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation); divides --batch",
    )
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="whole passes (every row, in order); the machine's speed drifts between rows",
    )
    p.add_argument("--plot", default=None, help="write a PNG of tokens/s")
    return p


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark and prints the table (``--help`` for options)."""
    args = parser().parse_args(argv)
    problem = accumulation_problem(args.batch, args.accumulation)
    if problem:
        raise SystemExit(problem)
    with torch.device("meta"):
        args.params_m = sum(t.numel() for t in _model(args).parameters()) / 1e6
    table, by_key = _table([_run(args) for _ in range(args.repeat)], args)
    print(table)
    if args.plot:
        _plot(by_key, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
