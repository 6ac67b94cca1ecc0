"""Expert parallel benchmark: a Mixtral (8 experts, top-2) at ep 1 against ep 2 / ep 4, in one run.

    python -m benchmarks moe [--nprocs 2,4] [--steps 4] [--backends smddp,gloo]

For each world size and backend the same model (about 30M parameters: hidden 256, 4 layers,
8 experts of intermediate 512, vocab 32000, sequence 256, 2 sequences per rank) is trained
with ``tsm.transform(model, config=MoEConfig(moe_load_balancing="none"))`` and FSDP2 at
``hybrid_shard_degree=1`` (parameters replicated over the data-parallel ranks, so at ep 1
every rank holds every expert) for ep 1 and for each ep > 1 with the all-to-all and the
all-gather dispatcher. The global batch is the same in every row (EP ranks are data-parallel
ranks). Reported per row: tokens/s (median step of the slowest rank), the time spent in the
dispatch and combine collectives per step (forward and backward, slowest rank; measured in
further steps with a barrier before each of these collectives, so that waiting for a slower
rank is not counted; it still includes queueing behind FSDP's asynchronous gradient
reductions on backends that run one group's collectives after another's), the same time
measured in isolation (one experts module, forward and backward, no other traffic, each
collective's median over repetitions, times the layer count), and the
per-rank bytes of parameters + gradients + AdamW state, for the experts and in total. The
last lines check the issue's targets against the rows of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta
from typing import cast

import torch
from torch import nn

from benchmarks import comma_list, end_rank, run_ranks, set_rank_environment


def _model(args: argparse.Namespace):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    # transformers' generated config signature omits the attn_implementation keyword, which
    # the config accepts at run time.
    config = MixtralConfig(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config).float()


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors
    )


def _memory(model, optim) -> dict[str, int]:
    out = {"expert": 0, "all": 0}
    for name, p in model.named_parameters():
        states = [t for t in optim.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0]
        size = (
            _local_bytes([p])
            + (_local_bytes([p.grad]) if p.grad is not None else 0)
            + _local_bytes(states)
        )
        out["all"] += size
        if ".experts." in name:
            out["expert"] += size
    return out


def _run_config(args: argparse.Namespace, ep: int, all_to_all: bool) -> dict:
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.moe.collectives import DispatchTimer
    from torch_sagemaker.moe.moe_config import MoEConfig
    from torch_sagemaker.sharding import shard_model

    tsm.state.reset()
    tsm.init({"expert_parallel_degree": ep, "hybrid_shard_degree": 1})
    model = tsm.transform(
        _model(args),
        config=MoEConfig(moe_load_balancing="none", moe_all_to_all_dispatcher=all_to_all),
    )
    model = cast(nn.Module, shard_model(model))  # an FSDPModule is the module itself
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    steps, dispatch = [], []
    # Timed steps first (no extra synchronization), then as many steps with a barrier before
    # each dispatch collective, timing the collectives alone (DispatchTimer.sync).
    for step in range(args.warmup + 2 * args.steps):
        timing_dispatch = step >= args.warmup + args.steps
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        dist.barrier()
        DispatchTimer.reset(enabled=timing_dispatch, sync=True)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=False)  # keep the gradients for the byte count
        times = torch.tensor([time.perf_counter() - t0, DispatchTimer.seconds], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if timing_dispatch:
            dispatch.append(float(times[1]))
        elif step >= args.warmup:
            steps.append(float(times[0]))
    DispatchTimer.reset(enabled=False)
    memory = torch.tensor(list(_memory(model, optim).values()), dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    isolated = _isolated_dispatch(model, args) if ep > 1 else 0.0
    return {
        "step": statistics.median(steps),
        "dispatch": statistics.median(dispatch),
        "isolated": isolated,
        "expert_bytes": float(memory[0]),
        "all_bytes": float(memory[1]),
    }


def _isolated_dispatch(model, args: argparse.Namespace) -> float:
    """Dispatch + combine seconds of all layers, forward and backward, with no other traffic.

    One experts module is run on this rank's tokens with random top-2 routing, bypassing its
    FSDP hooks (at hybrid_shard_degree 1 its parameters are whole on each rank), so the only
    collectives are the dispatcher's, each after a barrier. On a shared machine a rank can be
    descheduled in the middle of any collective, so each collective's time is the median
    over ``args.isolated_reps`` repetitions (slowest rank); their sum is scaled by the layer count.
    """
    import torch.distributed as dist

    from torch_sagemaker.moe.collectives import DispatchTimer
    from torch_sagemaker.sharding.experts import expert_modules

    experts = expert_modules(model)
    gen = torch.Generator().manual_seed(7)  # the same routing in every repetition
    tokens = args.batch * args.seq
    hidden0 = torch.randn(tokens, args.hidden, generator=gen)
    weights, index = torch.softmax(torch.randn(tokens, 8, generator=gen), -1).topk(2, dim=-1)
    reps = []
    for _ in range(args.isolated_reps + 1):
        hidden = hidden0.clone().requires_grad_()
        DispatchTimer.reset(enabled=True, sync=True)
        experts[0].forward(hidden, index, weights).sum().backward()
        per_call = torch.tensor(DispatchTimer.durations, dtype=torch.float64)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        reps.append(per_call)
    DispatchTimer.reset(enabled=False)
    per_call_median = torch.stack(reps[1:]).median(dim=0).values
    return float(per_call_median.sum()) * len(experts)


def _configs(world: int) -> list[tuple[int, bool]]:
    eps = [e for e in (2, 4, 8) if e <= world and world % e == 0]
    return [(1, True)] + [(ep, a2a) for ep in eps for a2a in (True, False)]


def _rank_main(
    rank: int, world: int, port: int, backend: str, args: argparse.Namespace, results
) -> None:
    set_rank_environment(rank, world, port, "ERROR")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import torch_sagemaker  # noqa: F401  (registers smddp)

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    for ep, a2a in _configs(world):
        row = _run_config(args, ep, a2a)
        if rank == 0:
            results.put((world, backend, ep, a2a, row))
    end_rank(results)


def _run(args: argparse.Namespace) -> list[tuple]:
    rows = []
    for world in args.nprocs:
        for backend in args.backends:
            rows += run_ranks(_rank_main, world, backend, args, results=len(_configs(world)))
    return rows


def _table(rows: list[tuple], args: argparse.Namespace) -> str:
    tokens_per_rank = args.batch * args.seq
    index = {(w, b, ep, a2a): r for w, b, ep, a2a, r in rows}
    lines = [
        f"Mixtral {args.params_m:.0f}M params (8 experts, top-2), seq {args.seq}, "
        f"{args.batch} seq/rank, "
        f"hybrid_shard_degree 1, medians of {args.steps} steps (slowest rank)",
        "| ranks | backend | ep | dispatcher | tokens/s | vs ep 1 | step ms | "
        "dispatch+combine ms/step "
        "in training | isolated | isolated vs gloo | expert MiB/rank (p+g+opt) | x ep 1 | "
        "all MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for (world, backend, ep, a2a), r in index.items():
        base = index[(world, backend, 1, True)]
        tps = tokens_per_rank * world / r["step"]
        base_tps = tokens_per_rank * world / base["step"]
        gloo = index.get((world, "gloo", ep, a2a))
        vs_gloo = (
            f"{r['isolated'] / gloo['isolated']:.2f}"
            if gloo and backend != "gloo" and ep > 1
            else ""
        )
        mem_ratio = r["expert_bytes"] / base["expert_bytes"]
        lines.append(
            f"| {world} | {backend} | {ep} | {'all-to-all' if a2a else 'all-gather'} | {tps:.0f} | "
            f"{tps / base_tps:.2f} | {r['step'] * 1e3:.0f} | {r['dispatch'] * 1e3:.1f} | "
            f"{r['isolated'] * 1e3:.1f} | {vs_gloo} | "
            f"{r['expert_bytes'] / 2**20:.1f} | {mem_ratio:.3f} | {r['all_bytes'] / 2**20:.1f} |"
        )
        if ep > 1:
            ok = abs(mem_ratio * ep - 1) <= 0.05
            checks.append(
                f"{'PASS' if ok else 'FAIL'} expert memory {world} ranks {backend} ep {ep}: "
                f"{mem_ratio:.3f} of ep 1 (target 1/{ep} within 5%)"
            )
            if world == 2 and a2a:
                ratio = tps / base_tps
                checks.append(
                    f"{'PASS' if ratio >= 0.9 else 'FAIL'} tokens/s 2 ranks {backend} ep 2 "
                    "all-to-all: "
                    f"{ratio:.2f}x ep 1 (target >= 0.9x)"
                )
            if backend == "smddp" and gloo:
                ratio = r["isolated"] / gloo["isolated"]
                checks.append(
                    f"{'PASS' if ratio <= 0.2 else 'FAIL'} dispatch+combine {world} ranks ep {ep} "
                    f"{'all-to-all' if a2a else 'all-gather'}: smddp {ratio:.2f}x gloo "
                    "(isolated; target <= 0.2x)"
                )
    return "\n".join(lines + [""] + checks)


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark and prints the table (``--help`` for options)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nprocs", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--backends", type=comma_list(), default="smddp,gloo")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument(
        "--isolated-reps", type=int, default=15, help="repetitions of the isolated dispatch"
    )
    args = p.parse_args(argv)
    with torch.device("meta"):
        args.params_m = sum(t.numel() for t in _model(args).parameters()) / 1e6
    print(_table(_run(args), args))


if __name__ == "__main__":
    main()
