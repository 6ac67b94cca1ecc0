"""Collectives between simulated hosts: smddp and gloo against what each host's NIC allows.

    python -m benchmarks multihost [--layouts 2x1,4x1,2x2,4x2] [--rate 2gbit]
        [--ops all_reduce,all_gather_into_tensor,reduce_scatter_tensor] [--sizes 1M,16M,64M]
        [--dtypes float32,bfloat16] [--switch-queue 2M] [--congestion auto]
        [--slow-start-after-idle 1] [--warmup-largest 5,0]
        [--train|--train-only]
        [--train-setups fsdp2,fsdp1_hybrid,fsdp1_overlap,fsdp2_hybrid,fsdp2_overlap]
        [--dtype bf16] [--train-steps 3]

Each layout HxL is H simulated hosts (tools/netns.py: namespaces, one bridge as the switch,
each host's cable shaped to ``--rate`` in both directions, each switch port queueing at most
``--switch-queue`` bytes (2 MiB: Note [Shallow switch ports] in tools/netns.py), its TCP congestion
control
``--congestion``, by default cubic where the kernel lets a namespace choose it and otherwise
the machine's own, as each host's kernel reports it in the header and the record: Note
[Simulated hosts run cubic]; whether TCP restarts
its window after idle gaps ``--slow-start-after-idle``, Linux's default 1 unless told 0: Note
[Slow start after idle] in smddp/backend.py) with L ranks each. One
job per layout runs every backend: the default group is smddp's, and a gloo group spans the same
ranks. The default group also carries the benchmark's own barrier before every timed call;
"smddp-auto" is auto's choice in a group of its own (on 16 hosts at 1 MiB it took 0.69x the
default group's time in the median of 7 jobs, 0.50x to 1.28x: docs/log/multi_node.md,
2026-11-30). "smddp-mesh", "smddp-ring",
"smddp-hd" and "smddp-tree" are further smddp groups over
the same ranks that cross hosts by the mesh, a ring, halving-doubling or (all_reduce only;
the rest as auto) the tree whatever SMDDP_NET_ALGO says (``SMDDPOptions(net_algo=...)``;
hosts of unequal rank counts, and two hosts but for halving-doubling and the tree, take the
mesh); each row records the algorithm its calls crossed hosts by, as the group counted them
(``algorithm``: ``mesh``, ``ring``, ``halving_doubling``, ``tree``, or ``flat_ring`` for
gloo): under auto a small all_reduce may take the tree. "smddp-pool" is an auto group whose
operands come from its tensor pool, as FSDP2's all-gather and reduce-scatter buffers do (the
all-gather's input in place in its output): a host's ranks then read each other's all-gather
parts where they lie (Note [Read from the pool] in csrc/smddp/algorithms/shm_algos.h); its
rows record how often the timed calls read a peer's pool (``pool_reads``, all ranks: 0 where
no host has two ranks or the pool could not hold the operands), and the cost model leaves
them out.
"bare-tcp" is no collective but the ceiling the machine allows: the bytes of a ring on the
ring's flows as bare TCP streams, with no other work (tools/bare_tcp.py, Note [The bare-TCP
ceiling]); it is not trained and the cost model leaves it out. For every
op, size S (nccl-tests' S in bytes: the all_reduce tensor, the all_gather output, the
reduce_scatter input) and element type (``--dtypes``; bfloat16 is what SMP's scripts reduce
in), each backend runs a checked call, a warm-up call and
``--iters`` timed calls, each after a barrier; the time is the median over calls of the
slowest rank. Each backend runs its whole sweep before the next starts, and each op's sweep
starts with ``--warmup-largest`` calls at the largest size (Note [Each backend's sweep back to
back]); several counts (``5,0``) run every layout once per count, the "warm-up" column telling
them apart (0: a job's connections first carry these cases, as a training job's do).

The bound is the time the busiest NIC needs for the bytes it must send:
k (H-1)/H S 8 / R, with k = 2 for all_reduce and 1 for all_gather and reduce_scatter
(the L ranks of a host share its NIC). "of bound" is bound / time (1.0: at the NIC's rate;
TCP/IP headers leave about 0.95 of it for data). "wire" is the bytes each host's NIC sent
per call, from its counters (headers included), over the minimum k (H-1)/H S. "drops" are
the packets the buckets dropped during the timed calls, at the hosts' uploads and at the
switch's ports (their downloads).

``--rate unlimited`` leaves the cables unshaped: there is no bound, the CPU is the limit, and
bare-tcp's time is the scale ("of bare-tcp"). A second table gives, for every case, the CPU
it took per GB the op must move between hosts (each rank's user and system time, the
machine's softirq time) and, for smddp, its transport's messages and system calls (Note [CPU
per byte] in multihost_rank.py).

``--train`` (``--train-only``: without the sweep) trains a small Llama in each layout and on
one host of as many ranks, with the same mesh shapes: ``--train-setups`` (default ``fsdp2``,
FSDP2 over every rank; ``fsdp1_hybrid`` as SMP's train.py wraps FSDP1, ``fsdp1_overlap``
with its replicas' all-reduce during backward, ``fsdp2_hybrid``: HSDP; ``fsdp2_overlap``:
HSDP's replicas averaged during backward) in ``--dtype`` (float32 by default; bf16 as SMP's
recipe). It prints tokens/s, the
fraction of one host's and of gloo's, the step split into compute and exposed communication
per op (Note [Exposed communication] in multihost_training.py), and how far each run's losses
are from one host's (multihost_training_report.py); losses beyond the tolerance make the
exit code 1.

Without namespaces (no ``unshare``/``ip``/``tc``, or no right to use them) it says why and
exits with 2.

``--model`` fits the cost model (torch_sagemaker/planner/cost_model.py) on the rows after the
run, ``--fit FILE...`` on rows saved with ``--json`` without running anything; both print its
error on every point and its predictions for 8 to 1024 hosts (``--predict-*``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks import comma_list, cost_model_report, multihost_training_report
from benchmarks.multihost_rank import BACKENDS, DTYPES, OPS
from benchmarks.multihost_report import (
    cpu_table,
    queue_text,
    ran_setting,
    table,
    timeline_table,
)
from benchmarks.multihost_training import SETUPS, TRAIN_DTYPES, Run, runs_for
from tools import netns
from tools.bare_tcp import BARE_TCP

# Note [Each backend's sweep back to back]
# A job runs one backend's cases (every op, every size) one after the other, then the next
# backend's, as nccl-tests runs one library; and before each op's sizes it makes
# ``--warmup-largest`` calls at the largest size, as nccl-tests' timing loop does first (it
# then warms up at the smallest size too, which each case's own warm-up call covers here).
# The table then measures collectives that follow each other on connections that have carried
# the largest size. That is not a training step, whose compute leaves gaps between its
# collectives (Note [Slow start after idle] in smddp/backend.py).
# - The warm-up is what the numbers needed. What smddp's first transfers leave in its
#   connections lasts: where they were 1 MiB calls (the smallest size first), a host's flows
#   could ramp unequally and stay so for the whole job. On 2 hosts of 2 ranks, back to back
#   without the warm-up, three launches of four ran every large case slow (9 of 24 cells from
#   16 MiB below 0.9 of the bound), and with it none did (0 of 24, alternating), while the
#   bare streams of the same launches, which also began with 1 MiB, ran at 0.95.
# - The order is nccl-tests' and not a measured gain: without the warm-up it missed in those
#   9 of 24 cells, and the old order (each case on every backend in turn; alternating runs of
#   their own, six launches each) in 5 of 36 at either host setting. It keeps a backend's
#   connections from sitting idle for seconds between its own cases while others run.
WARMUP_LARGEST = 5


def _layout(text: str) -> tuple[int, int]:
    try:
        hosts, local = (int(x) for x in text.lower().split("x"))
    except ValueError:
        hosts = local = 0
    if hosts < 2 or local < 1:
        raise argparse.ArgumentTypeError(
            f"layout {text!r}: write HOSTSxRANKS with at least 2 hosts and 1 rank, e.g. 2x1"
        )
    return hosts, local


def _train_dtype(text: str) -> str:
    name = {"bf16": "bfloat16", "fp32": "float32"}.get(text.lower(), text.lower())
    if name not in TRAIN_DTYPES:
        raise argparse.ArgumentTypeError(
            f"training dtype {text!r}: choose from {', '.join(TRAIN_DTYPES)} (or bf16, fp32)"
        )
    return name


# --- the driver ----------------------------------------------------------------------------


def run_layout(
    hosts: int,
    local: int,
    rate_bits: int | None,
    ops: list[str],
    sizes: list[int],
    backends: list[str],
    iters: int,
    timeout_s: float,
    identical: bool = False,
    train_backends: list[str] | None = None,
    train_steps: int = 3,
    train_runs: list[Run] | None = None,
    train_dtype: str = "float32",
    train_model: dict[str, int] | None = None,
    timeline: bool = False,
    congestion: str | None = netns.AUTO_CONGESTION,
    slow_start_after_idle: int | None = None,
    warmup_largest: int = WARMUP_LARGEST,
    dtypes: list[str] | None = None,
    switch_queue_bytes: int | None = netns.SWITCH_QUEUE_BYTES,
) -> dict[str, Any]:
    """Runs one layout's job.

    Args:
        hosts: H, simulated hosts.
        local: L, ranks per host.
        rate_bits: Each host's NIC rate, bits per second; None: unshaped.
        ops: The collectives to time.
        sizes: Their sizes S in bytes (nccl-tests' S).
        backends: Of ``BACKENDS``.
        iters: Timed calls per op, size and backend.
        timeout_s: Seconds for the whole job.
        identical: Also check that float32 and bfloat16 results agree bit for bit.
        train_backends: Backends to time training on.
        train_steps: Timed training steps per run and backend (after one untimed).
        train_runs: The setups and mesh shapes to train (``multihost_training``); default
            ``fsdp2`` over every rank.
        train_dtype: The training's element type (``multihost_training.TRAIN_DTYPES``).
        train_model: Overrides of the model's config, and ``seq``, the sequence length
            (default: ``multihost_training.training_config()``, 128 tokens).
        timeline: Record each smddp row's phases (SMDDP_TIMELINE).
        congestion: The hosts' TCP congestion control, as ``netns.resolve_congestion``
            takes it: a name, ``auto`` (cubic where the hosts may choose it, else the
            machine's own) or None (the machine's own); Note [Simulated hosts run cubic].
        slow_start_after_idle: The hosts' ``net.ipv4.tcp_slow_start_after_idle``; None: the
            kernel's default (1).
        warmup_largest: Untimed calls at the largest size before each op's sweep, on each
            backend (Note [Each backend's sweep back to back]).
        dtypes: The operands' element types (torch's names: float32, bfloat16, float16);
            default float32. Sizes stay in bytes, so the bound is the dtype's bytes.
        switch_queue_bytes: Each switch port's queue (Note [Shallow switch ports] in
            tools/netns.py); None: a 50 ms queue.

    Returns:
        ``{"rows": one per op, size and backend, "identical": None, or with ``identical``
        each rank's results of the float32/bfloat16 agreement check (smddp), "training":
        one record per run and backend in ``train_backends`` (``multihost_training.
        summarise``), "hosts": each host's TCP settings as its kernel reported them
        (``tools.bench_host.host_settings``), "congestion_why": why the hosts ran that
        congestion control}``.

    Raises:
        ValueError: A congestion control the hosts cannot run (``netns.check_congestion``).
        RuntimeError: The job failed; the message holds the hosts' output.
    """
    congestion, why = netns.resolve_congestion(congestion)
    with tempfile.TemporaryDirectory(prefix="tsm_multihost_") as tmp:
        out = os.path.join(tmp, "rows.json")
        spec: dict[str, Any] = {
            "hosts": hosts,
            "local": local,
            "ops": ops,
            "sizes": sizes,
            "backends": backends,
            "iters": iters,
            "timeout": timeout_s,
            "identical": identical,
            "train_backends": train_backends or [],
            "train_steps": train_steps,
            "train_runs": runs_for(["fsdp2"], hosts, local) if train_runs is None else train_runs,
            "train_dtype": train_dtype,
            "train_model": train_model,
            "timeline": timeline,
            "warmup_largest": warmup_largest,
            "dtypes": dtypes or ["float32"],
            "out": out,
        }
        # Note [A light host process]: each host's process starts its ranks and waits. The
        # hosts' processes inherit the environment and working directory, so their ranks
        # import this package as this process did.
        command = [sys.executable, "-m", "tools.bench_host", "{host}", json.dumps(spec)]
        done = netns.run_hosts(
            hosts,
            command,
            timeout_s,
            rate_bits,
            congestion=congestion,
            slow_start_after_idle=slow_start_after_idle,
            switch_queue_bytes=switch_queue_bytes,
        )
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"layout {hosts}x{local} failed:\n{done.stdout[-6000:]}")
        with open(out) as f:
            result = json.load(f)
        result["hosts"] = []
        for host in range(hosts):
            with open(f"{out}.host{host}") as f:
                result["hosts"].append(json.load(f))
        result["congestion_why"] = why
        return result


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with the internal --rank-spec, one rank)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-spec"]:
        from benchmarks.multihost_rank import rank_main

        rank_main(json.loads(argv[1]))
        return 0
    from benchmarks.collectives import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", type=comma_list(), default=["2x1", "4x1", "2x2", "4x2"])
    p.add_argument(
        "--rate",
        default="2gbit",
        help="each host's NIC rate, both directions; 'unlimited': unshaped, the CPU bounds it",
    )
    p.add_argument("--ops", type=comma_list(OPS), default=list(OPS))
    p.add_argument("--sizes", type=comma_list(), default=["1M", "16M", "64M"])
    p.add_argument(
        "--backends",
        type=comma_list(BACKENDS),
        default=["smddp", "gloo"],
        help=f"of {', '.join(BACKENDS)}",
    )
    p.add_argument(
        "--congestion",
        default=netns.AUTO_CONGESTION,
        help=f"the hosts' TCP congestion control ('{netns.AUTO_CONGESTION}':"
        f" {netns.DEFAULT_CONGESTION} where the kernel lets the hosts choose it, else the"
        f" machine's; '{netns.SYSTEM_CONGESTION}': the machine's)",
    )
    p.add_argument(
        "--slow-start-after-idle",
        type=int,
        choices=(0, 1),
        default=1,
        help="the hosts' net.ipv4.tcp_slow_start_after_idle (1: Linux's default)",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--dtypes",
        type=comma_list(DTYPES),
        default=["float32"],
        help=f"the operands' element types, of {', '.join(DTYPES)} (sizes stay in bytes)",
    )
    p.add_argument(
        "--switch-queue",
        default="2M",
        help="bytes each switch port queues towards its host (Note [Shallow switch ports]); "
        "'deep' for a 50 ms queue",
    )
    p.add_argument(
        "--warmup-largest",
        type=comma_list(),
        default=[str(WARMUP_LARGEST)],
        help="untimed calls at the largest size before each op's sweep, on each backend; "
        "several (e.g. 5,0) run the layouts once each",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds for one layout's job")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument(
        "--train",
        action="store_true",
        help="also time training of a small Llama in each layout and in one host of as "
        "many ranks, and say where each step's time went",
    )
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument(
        "--train-setups",
        type=comma_list(SETUPS),
        default=["fsdp2"],
        help=f"what --train trains, of {', '.join(SETUPS)} (benchmarks/multihost_training.py)",
    )
    p.add_argument(
        "--train-dtype",
        "--dtype",
        type=_train_dtype,
        default="float32",
        help="the training's element type: float32, or bfloat16 (bf16) as SMP's recipe",
    )
    p.add_argument(
        "--train-only",
        action="store_true",
        help="--train without the collectives' sweep",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also print, for each smddp row, where one call's time went on each rank "
        "(SMDDP_TIMELINE)",
    )
    model = p.add_argument_group(
        "cost model (torch_sagemaker/planner/cost_model.py)",
        "fit per-layer costs on the measured rows, print the error on each, and predict "
        "time, busbw and the algorithm to pick for 8 to 1024 hosts",
    )
    model.add_argument("--model", action="store_true", help="fit the model after the run")
    model.add_argument(
        "--fit",
        nargs="+",
        metavar="FILE",
        default=None,
        help="fit on rows saved with --json instead of running (each point's fastest run)",
    )
    model.add_argument("--predict-rate", default="100gbit", help="one NIC's rate")
    model.add_argument("--predict-nics", type=int, default=4, help="NICs per host")
    model.add_argument("--predict-ranks", type=int, default=8, help="ranks per host")
    model.add_argument(
        "--predict-cores", type=float, default=0, help="cores per host (0: one per rank)"
    )
    model.add_argument("--predict-sizes", type=comma_list(), default=["1M", "64M", "1G"])
    model.add_argument(
        "--predict-latency",
        type=float,
        default=None,
        help="seconds per call, per ring or tree step and per extra flow of the mesh instead of "
        "the fitted ones",
    )
    model.add_argument(
        "--predict-message",
        type=float,
        default=None,
        help="CPU seconds per message instead of the fitted",
    )
    model.add_argument(
        "--predict-cpu",
        choices=("fitted", "none"),
        default="fitted",
        help="none: no CPU cost per byte (as if a fabric and accelerators moved and reduced "
        "the bytes)",
    )
    model.add_argument(
        "--predict-dtypes",
        type=comma_list(DTYPES),
        default=["float32"],
        help="with more than float32: also each op in each dtype at each size (bytes), with "
        "what bounds it (Note [Cost model of half precision])",
    )
    model.add_argument(
        "--predict-hosts",
        type=comma_list(),
        default=["64", "128", "256", "512", "1024"],
        help="host counts of the --predict-dtypes table",
    )
    model.add_argument("--plot", default=None, help="write all_reduce's predicted busbw here")
    args = p.parse_args(argv)
    try:
        warmups = [int(w) for w in args.warmup_largest]
    except ValueError:
        warmups = [-1]
    if any(w < 0 for w in warmups):
        p.error(f"--warmup-largest {','.join(args.warmup_largest)}: counts of calls, 0 or more")
    if not all(h.isdigit() and int(h) >= 2 for h in args.predict_hosts):
        p.error(f"--predict-hosts {','.join(args.predict_hosts)}: host counts, 2 or more")
    if args.train_steps < 1:
        p.error(f"--train-steps {args.train_steps}: at least 1 timed step (after one untimed)")
    if args.fit:
        runs = []
        for path in args.fit:
            with open(path) as f:
                runs.append(json.load(f))
        return cost_model_report.model_report(runs, args)
    try:
        unshaped = args.rate.strip().lower() in ("unlimited", "none")
        rate = None if unshaped else netns.parse_rate(args.rate)
        # Checked before any host starts (Note [Simulated hosts run cubic]).
        netns.resolve_congestion(args.congestion)
        queue = None if args.switch_queue == "deep" else parse_size(args.switch_queue)
        if queue is not None and queue < netns.BURST_BYTES:
            raise ValueError(
                f"--switch-queue {args.switch_queue}: at least one burst"
                f" ({netns.BURST_BYTES} bytes), or 'deep'"
            )
    except ValueError as e:
        p.error(str(e))
    reason = netns.unavailable_reason()
    if reason:
        print(f"multihost: cannot simulate hosts here: {reason}", file=sys.stderr)
        return 2
    layouts = [_layout(x) for x in args.layouts]
    sizes = [] if args.train_only else [parse_size(s) for s in args.sizes]
    if args.train_only:
        warmups = warmups[:1]
    rows: list[dict] = []
    trained: dict[str, list[dict]] = {}
    per_host: list[dict[str, str]] = []  # every job's hosts, as their kernels reported
    why = ""
    train = [b for b in args.backends if b != BARE_TCP] if args.train or args.train_only else []
    for warmup in warmups:
        for hosts, local in layouts:
            got = run_layout(
                hosts,
                local,
                rate,
                args.ops,
                sizes,
                args.backends,
                args.iters,
                args.timeout,
                train_backends=train if warmup == warmups[0] else [],
                train_steps=args.train_steps,
                train_runs=runs_for(args.train_setups, hosts, local),
                train_dtype=args.train_dtype,
                timeline=args.timeline,
                congestion=args.congestion,
                slow_start_after_idle=args.slow_start_after_idle,
                warmup_largest=warmup,
                dtypes=args.dtypes,
                switch_queue_bytes=queue,
            )
            rows += got["rows"]
            per_host += got["hosts"]
            why = got["congestion_why"]
            if train and warmup == warmups[0]:
                trained[f"{hosts}x{local}"] = got["training"]
    for world in sorted({h * loc for h, loc in layouts}) if train else []:
        # One host's reference for every layout of as many ranks: the same runs, same shapes.
        same = [(h, loc) for h, loc in layouts if h * loc == world]
        runs = [r for h, loc in same for r in runs_for(args.train_setups, h, loc)]
        got = run_layout(
            1,
            world,
            rate,
            [],
            [],
            args.backends,
            1,
            args.timeout,
            False,
            train,
            args.train_steps,
            train_runs=list(dict.fromkeys(runs)),
            train_dtype=args.train_dtype,
            congestion=args.congestion,
            slow_start_after_idle=args.slow_start_after_idle,
            switch_queue_bytes=queue,
        )
        trained[f"1x{world}"] = got["training"]
        per_host += got["hosts"]
    # What the hosts' kernels said they ran, not what was asked.
    ran = ran_setting(per_host, "congestion")
    whose = f" ({why})" if why else ""
    print(
        f"NIC rate {args.rate} per host, both directions; TCP congestion control {ran}{whose};"
        f" slow start after idle {ran_setting(per_host, 'slow_start_after_idle')};"
        f" switch ports {queue_text(queue, rate)};"
        f" median of {args.iters} calls, each backend's sweep back to back; warm-up: calls at"
        " the largest size before each op's sweep (0: none)"
    )
    if rows:
        print(table(rows, rate))
        print("\nCPU per GB the op must move between hosts (Note [CPU per byte])")
        print(cpu_table(rows))
    if args.timeline:
        print(timeline_table(rows))
    problems = multihost_training_report.loss_problems(trained)
    if trained:
        print(
            "\n"
            + multihost_training_report.header(
                args.train_setups, args.train_dtype, args.train_steps, None
            )
        )
        print(multihost_training_report.training_table(trained))
        for line in problems:
            print(f"LOSSES APART: {line}")
    run = {
        "rate_bits": rate,
        "iters": args.iters,
        # What the machine could give the simulated hosts, which all share it (the cost
        # model's CPU share, Note [Cost model] in torch_sagemaker/planner/cost_model.py).
        "cores": os.cpu_count(),
        "burst_bytes": netns.BURST_BYTES,  # what each cable passes above the rate at once
        # The hosts' TCP congestion control, as their kernels said: one name, or each host's.
        "congestion": ran.removesuffix(" on every host"),
        "congestion_asked": args.congestion,
        "congestion_why": why,
        "hosts": per_host,
        "slow_start_after_idle": args.slow_start_after_idle,  # the hosts' sysctl
        "warmup_largest": warmups,
        "dtypes": args.dtypes,
        "switch_queue_bytes": queue,  # None: a 50 ms queue
        "sweep": "backend",  # each backend's cases back to back (before: each case in turn)
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "recorded": time.strftime("%Y-%m-%d %H:%M %Z"),
        "rows": rows,
        "training": trained,  # per layout, one record per run and backend
        "train": {
            "setups": args.train_setups,
            "dtype": args.train_dtype,
            "steps": args.train_steps,
        },
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    if args.model:
        cost_model_report.model_report([run], args)
    return 0 if all(r["ok"] for r in rows) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
