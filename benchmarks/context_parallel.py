"""Context parallelism benchmark: tokens/s, activation memory and exposed communication.

    python -m benchmarks context_parallel [--seqs 2048,4096,8192] [--backend smddp]

A Llama of a few million parameters (fp32, FSDP2 over the 2 ranks, one intra-op thread per
rank) trains on one sequence per data-parallel rank at each sequence length, in one run:

- ``no CP``: each rank holds whole sequences (two sequences per step, one per rank), Hugging
  Face's SDPA attention (the CPU flash kernel);
- ``cp2 p2p`` and ``cp2 all_gather``: the two ranks share each sequence (one sequence per
  step, half of it per rank);
- PyTorch's experimental ``context_parallel`` is tried once and reported if it fails.

The configurations take turns step by step, so load from other processes spreads over all
of them; every number is a median over the timed steps of the slower rank.

Columns: tokens/s of the whole job; saved activations per rank, the bytes autograd holds
from forward to backward (distinct storages, parameters excluded), which is the activation
memory that context parallelism splits (on CPU there is no allocator peak to read; this is
the peak of what a step keeps alive); exposed communication measured two ways: the step
time minus the same step with the attention communication replaced by local copies of the
same sizes (same computation, FSDP's own communication in both; on a loaded machine this
difference is within the noise of the step time), and the time the computing thread is
blocked in attention communication (posting and waiting for ring transfers; the whole
all-gather and reduce-scatter, which are synchronous); the attention communication alone
(the same transfers without computation); and the share of it hidden behind computation,
``1 - blocked / alone``.

A second table isolates one layer's context parallel attention (forward + backward on
tensors of the model's shapes): with its communication, with local copies instead, and the
communication alone. These measurements are short, so other processes disturb them less
than whole steps; ``hidden = 1 - (with - local) / alone``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import cast

import torch
from torch import nn

from benchmarks import comma_list, end_rank, run_ranks, set_rank_environment

MODES = ("no CP", "cp2 p2p", "cp2 p2p, no comm", "cp2 all_gather", "cp2 all_gather, no comm")


def build_model(args: argparse.Namespace) -> nn.Module:
    """The benchmark Llama (fp32, SDPA attention, same weights everywhere)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # transformers' generated config signature omits the attn_implementation keyword, which
    # the config accepts at run time.
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=max(args.seqs),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


@contextlib.contextmanager
def local_attention_comm() -> Iterator[None]:
    """Replaces the attention communication by local copies of the same sizes."""
    from torch_sagemaker.context_parallel import allgather, comm

    class _Local:
        def __init__(self, tensor: torch.Tensor) -> None:
            self._tensor = tensor.clone()

        def wait(self) -> torch.Tensor:
            return self._tensor

    def shift(self, send, tag):
        return _Local(send)

    def gather(tensor, group):
        return tensor.unsqueeze(0).repeat(group.size(), *([1] * tensor.dim()))

    def scatter(stacked, group):
        return stacked[group.rank()].clone()

    saved = (comm.Ring.shift, allgather.all_gather_stacked, allgather.reduce_scatter_stacked)
    comm.Ring.shift, allgather.all_gather_stacked, allgather.reduce_scatter_stacked = (
        shift,
        gather,
        scatter,
    )
    try:
        yield
    finally:
        comm.Ring.shift, allgather.all_gather_stacked, allgather.reduce_scatter_stacked = saved


@contextlib.contextmanager
def timed_attention_comm(blocked: list[float]) -> Iterator[None]:
    """Adds to ``blocked[0]`` the seconds the computing thread spends in attention communication.

    That is posting ring transfers and waiting for them (p2p), or the time inside the all-gather
    and reduce-scatter (all_gather, synchronous).
    """
    from torch_sagemaker.context_parallel import allgather, comm

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                blocked[0] += time.perf_counter() - start

        return call

    saved = (
        comm.Ring.shift,
        comm.Transfer.wait,
        allgather.all_gather_stacked,
        allgather.reduce_scatter_stacked,
    )
    comm.Ring.shift, comm.Transfer.wait = timed(saved[0]), timed(saved[1])
    allgather.all_gather_stacked, allgather.reduce_scatter_stacked = (
        timed(saved[2]),
        timed(saved[3]),
    )
    try:
        yield
    finally:
        (
            comm.Ring.shift,
            comm.Transfer.wait,
            allgather.all_gather_stacked,
            allgather.reduce_scatter_stacked,
        ) = saved


def saved_activation_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of distinct storages autograd saves in one forward pass (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, attention_mask=None, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def _models(args: argparse.Namespace) -> dict[str, nn.Module]:
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.sharding import shard_model

    base = build_model(args)
    plain = copy.deepcopy(base)
    for layer in cast(nn.ModuleList, plain.get_submodule("model.layers")):
        fully_shard(layer, mesh=tsm.state.fsdp_shard_mesh)
    fully_shard(plain, mesh=tsm.state.fsdp_shard_mesh)
    models = {"no CP": plain}
    for comm in ("p2p", "all_gather"):
        sharded = shard_model(tsm.transform(copy.deepcopy(base), cp_comm_type=comm))
        models[f"cp2 {comm}"] = cast(nn.Module, sharded)  # an FSDPModule is the module itself
    return models


def _step(model: nn.Module, optim: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, attention_mask=None, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _comm_alone(comm: str, local_len: int, layers: int, args: argparse.Namespace) -> float:
    """Seconds of ``layers`` layers' attention transfers without computation (same sizes, count)."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.context_parallel.comm import (
        Ring,
        all_gather_stacked,
        reduce_scatter_stacked,
    )

    group = tsm.state.cp_process_group
    cp = dist.get_world_size(group)
    head_dim = args.hidden // args.heads
    kv = torch.randn(2, 1, args.heads // 2, local_len, head_dim)
    ring = Ring(group)
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        for _layer in range(layers):
            if comm == "p2p":  # forward ring, backward ring, dK/dV accumulators (fp32)
                for _ in range(2 * (cp - 1)):
                    ring.shift(kv, 17).wait()
                for _ in range(cp):
                    ring.shift(kv.float(), 18).wait()
            else:  # gather, gather again in backward, reduce-scatter dK/dV
                all_gather_stacked(kv, group)
                full = all_gather_stacked(kv, group)
                reduce_scatter_stacked(full.float(), group)
        times.append(_slowest(time.perf_counter() - start))
    return statistics.median(times[args.warmup :])


def _attention_alone(comm: str, local_len: int, args: argparse.Namespace) -> tuple[float, float]:
    """Seconds of one attention layer's forward + backward, with communication and without.

    "Without" replaces the communication by local copies; both are medians over
    ``args.attention_reps`` interleaved repetitions.
    """
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.context_parallel.attention import ContextParallelAttention

    head_dim = args.hidden // args.heads
    gen = torch.Generator().manual_seed(local_len)
    q = torch.randn(1, args.heads, local_len, head_dim, generator=gen).requires_grad_()
    k, v = (
        torch.randn(1, args.heads // 2, local_len, head_dim, generator=gen).requires_grad_()
        for _ in range(2)
    )
    dout = torch.randn(q.shape, generator=gen)
    plan = ContextParallelAttention(tsm.state.cp_process_group, comm)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(1 + args.attention_reps):
        for with_comm in (True, False):
            dist.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if with_comm else local_attention_comm():
                plan.attend(q, k, v, head_dim**-0.5).backward(dout)
            elapsed = _slowest(time.perf_counter() - start)
            if rep:
                times[with_comm].append(elapsed)
    return statistics.median(times[True]), statistics.median(times[False])


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _pytorch_cp(model: nn.Module, ids: torch.Tensor) -> str:
    """Tries PyTorch's experimental context_parallel on this device; the outcome in words."""
    import torch.sagemaker as tsm
    from torch.distributed.tensor.experimental import context_parallel

    labels = ids.clone()
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous()
    try:
        with context_parallel(
            tsm.state.device_mesh["cp"], buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]
        ):
            model(input_ids=ids, position_ids=positions, labels=labels).loss.backward()
    except Exception as e:  # noqa: BLE001  (reported, not handled)
        return f"does not run on {ids.device.type.upper()}: {type(e).__name__}: {e}"
    return "ran"


def _measure(seq: int, rank: int, args: argparse.Namespace) -> dict:
    """One sequence length: every configuration's steps, memory and communication (a row)."""
    import torch.distributed as dist

    from torch_sagemaker.context_parallel import split_sequence

    models = _models(args)
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    gen = torch.Generator().manual_seed(seq)
    # One sequence per data-parallel rank: whole on each rank without CP, split with CP.
    own = torch.randint(0, args.vocab, (2, seq), generator=gen)[rank : rank + 1]
    shared = split_sequence(torch.randint(0, args.vocab, (1, seq), generator=gen))
    inputs = {"no CP": own, "cp2 p2p": shared, "cp2 all_gather": shared}
    row: dict = {"seq": seq, "times": {m: [] for m in MODES}, "blocked": {m: [] for m in MODES}}
    row["memory"] = {name: saved_activation_bytes(m, inputs[name]) for name, m in models.items()}
    for step in range(args.warmup + args.steps):
        for mode in MODES:
            name = mode.split(",")[0]
            blocked = [0.0]
            ctx = (
                local_attention_comm()
                if mode.endswith("no comm")
                else timed_attention_comm(blocked)
            )
            dist.barrier()
            start = time.perf_counter()
            with ctx:
                _step(models[name], optims[name], inputs[name])
            elapsed = _slowest(time.perf_counter() - start)
            if step >= args.warmup:
                row["times"][mode].append(elapsed)
                row["blocked"][mode].append(_slowest(blocked[0]))
    row["alone"] = {
        comm: _comm_alone(comm, shared.shape[1], args.layers, args)
        for comm in ("p2p", "all_gather")
    }
    row["attention"] = {
        comm: (
            *_attention_alone(comm, shared.shape[1], args),
            _comm_alone(comm, shared.shape[1], 1, args),
        )
        for comm in ("p2p", "all_gather")
    }
    return row


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    set_rank_environment(rank, world, port, "WARNING")
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group(args.backend, rank=rank, world_size=2, timeout=timedelta(minutes=30))
    tsm.init({"context_parallel_degree": 2, "hybrid_shard_degree": 2})
    outcome = _pytorch_cp(build_model(args), torch.randint(0, args.vocab, (1, 256)))  # collective
    if rank == 0:
        results.put(("pytorch", outcome))
    for seq in args.seqs:
        row = _measure(seq, rank, args)
        if rank == 0:
            results.put(("row", row))
    end_rank(results)


def run(args: argparse.Namespace) -> tuple[str | None, list[dict]]:
    """Runs the two ranks; returns PyTorch CP's outcome and one result row per sequence length."""

    def progress(item: tuple) -> None:
        if item[0] == "row":
            print(
                f"[context_parallel] sequence length {item[1]['seq']} done",
                file=sys.stderr,
                flush=True,
            )

    items = run_ranks(_rank_main, 2, args, results=1 + len(args.seqs), on_result=progress)
    pytorch = next(value for kind, value in items if kind == "pytorch")
    return pytorch, [value for kind, value in items if kind == "row"]


def format_table(pytorch: str | None, rows: list[dict], args: argparse.Namespace) -> str:
    """The Markdown table (one block of rows per sequence length)."""
    mib = 2.0**20
    lines = [
        f"Llama {args.params_m:.1f}M params ({args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads / {args.heads // 2} kv heads, vocab {args.vocab}), fp32, FSDP2 over 2 "
        f"ranks on {args.backend}, 1 thread per rank, one sequence per data-parallel rank; "
        f"medians of {args.steps} steps (slower rank) after {args.warmup} warm-up, "
        "configurations interleaved.",
        f"PyTorch experimental context_parallel: {pytorch}.",
        "",
        "| seq | configuration | tokens/s | vs no CP | step ms | saved activations MiB/rank | "
        "vs no CP | exposed CP comm ms (step - no comm) | blocked in CP comm ms | "
        "CP comm alone ms | hidden (by blocked) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        seq, med = row["seq"], {m: statistics.median(t) for m, t in row["times"].items()}
        tokens = {"no CP": 2 * seq, "cp2 p2p": seq, "cp2 all_gather": seq}
        base_tps = tokens["no CP"] / med["no CP"]
        base_mem = row["memory"]["no CP"]
        for name in ("no CP", "cp2 p2p", "cp2 all_gather"):
            tps = tokens[name] / med[name]
            mem = row["memory"][name]
            comm_cols = ["", "", "", ""]
            if name != "no CP":
                exposed = med[name] - med[f"{name}, no comm"]
                blocked = statistics.median(row["blocked"][name])
                alone = row["alone"][name.split()[1]]
                comm_cols = [
                    f"{exposed * 1e3:.0f}",
                    f"{blocked * 1e3:.0f}",
                    f"{alone * 1e3:.0f}",
                    f"{max(0.0, 1 - blocked / alone) * 100:.0f}%",
                ]
            lines.append(
                f"| {seq} | {name} | {tps:.0f} | {tps / base_tps:.2f} | {med[name] * 1e3:.0f} | "
                f"{mem / mib:.1f} | {mem / base_mem:.2f} | " + " | ".join(comm_cols) + " |"
            )
    lines += [
        "",
        "Attention alone: one layer's context parallel attention, forward + backward, "
        f"medians of {args.attention_reps} repetitions (shorter, so less exposed to other "
        "processes than whole steps).",
        "",
        "| seq | comm | with communication ms | local copies ms | exposed ms | "
        "communication alone ms | hidden |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for comm, (with_comm, local, alone) in row["attention"].items():
            exposed = with_comm - local
            lines.append(
                f"| {row['seq']} | {comm} | {with_comm * 1e3:.1f} | {local * 1e3:.1f} | "
                f"{exposed * 1e3:.1f} | {alone * 1e3:.1f} | "
                f"{min(1.0, max(0.0, 1 - exposed / alone)) * 100:.0f}% |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the table (``--help`` for options)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks context_parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seqs", type=comma_list(), default="2048,4096,8192")
    p.add_argument("--backend", choices=("smddp", "gloo"), default="smddp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attention-reps", type=int, default=7)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs]
    bad = [s for s in args.seqs if s % 4]
    if bad:
        p.error(f"sequence lengths {bad} must be multiples of 4 (2 * context_parallel_degree)")
    with torch.device("meta"):
        args.params_m = sum(t.numel() for t in build_model(args).parameters()) / 1e6
    pytorch, rows = run(args)
    print(format_table(pytorch, rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
