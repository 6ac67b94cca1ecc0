"""Training-step benchmark: FSDP2 (shard_model, plain fully_shard, hybrid) and DDP, smddp vs gloo.

    python -m torch_sagemaker.bench training [--nprocs 2] [--steps 4] [--plot training.png]

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
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from torch_sagemaker.bench import comma_list, end_rank, run_ranks, set_rank_environment

MODES = ("fsdp2_full", "fsdp2_plain", "fsdp2_hybrid", "ddp", "fsdp2_plain_staged")
# fsdp2_plain_staged: the plain script with the pool turned off again, i.e. what such a
# script got before Note [Pool buffers for every FSDP2 user]; a baseline, not run by default.
DEFAULT_MODES = MODES[:4]


def _model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # transformers' generated config signature omits the attn_implementation keyword, which
    # the config accepts at run time.
    config = LlamaConfig(  # type: ignore[call-arg]
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
    return LlamaForCausalLM(config).float()


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
    if mode == "ddp":
        tsm.init({"hybrid_shard_degree": 1})
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=tsm.state.dp_process_group)
    tsm.init({"hybrid_shard_degree": 0 if mode == "fsdp2_full" else max(1, world // 2)})
    return shard_model(model)


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
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        times = torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)
        if distributed:
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            out.append(tuple(times.tolist()))
    return out


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
    barrier = mp.get_context("spawn").Barrier(args.nprocs)
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


def _table(rows, args: argparse.Namespace) -> tuple[str, dict]:
    tokens = args.batch * args.seq
    alone_mode = f"{args.nprocs} ranks alone"
    alone = statistics.median(sum(s) for s in rows[1][2])
    lines = [
        f"Llama {args.params_m:.0f}M params, seq {args.seq}, batch {args.batch}/rank, "
        f"{args.nprocs} ranks, "
        f"medians of {args.steps} steps (slowest rank)",
        "| backend | mode | tokens/s | step ms | fwd ms | bwd ms | optim ms | exposed comm ms | "
        f"vs gloo | vs {args.nprocs} x 1 rank | vs {args.nprocs} alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {}
    for backend, mode, steps in rows:
        step = statistics.median(sum(s) for s in steps)
        world = 1 if mode == "1 rank" else args.nprocs
        by_key[(backend, mode)] = tokens * world / step
    for backend, mode, steps in rows:
        fwd, bwd, opt = (statistics.median(s[i] for s in steps) for i in range(3))
        step = statistics.median(sum(s) for s in steps)
        tps = by_key[(backend, mode)]
        gloo = by_key.get(("gloo", mode))
        vs_gloo = f"{tps / gloo:.2f}x" if gloo and backend != "gloo" and backend != "none" else ""
        scaling = (
            "" if mode == "1 rank" else f"{tps / (args.nprocs * by_key[('none', '1 rank')]):.2f}"
        )
        vs_alone = "" if backend == "none" else f"{tps / by_key[('none', alone_mode)]:.2f}"
        exposed = "" if backend == "none" else f"{max(0.0, step - alone) * 1e3:.0f}"
        lines.append(
            f"| {backend} | {mode} | {tps:.0f} | {step * 1e3:.0f} | {fwd * 1e3:.0f} | "
            f"{bwd * 1e3:.0f} | "
            f"{opt * 1e3:.0f} | {exposed} | {vs_gloo} | {scaling} | {vs_alone} |"
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


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark and prints the table (``--help`` for options)."""
    p = argparse.ArgumentParser(
        prog="python -m torch_sagemaker.bench training",
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
    p.add_argument("--plot", default=None, help="write a PNG of tokens/s")
    args = p.parse_args(argv)
    with torch.device("meta"):
        args.params_m = sum(t.numel() for t in _model(args).parameters()) / 1e6
    table, by_key = _table(_run(args), args)
    print(table)
    if args.plot:
        _plot(by_key, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
