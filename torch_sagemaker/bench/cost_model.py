"""A latency-bandwidth cost model of collectives between hosts, fitted on ``bench multihost``.

    python -m torch_sagemaker.bench multihost --fit tests/data/multihost/*.json \
        [--predict-rate 100gbit --predict-nics 4 --predict-ranks 8] [--plot FILE.png]

It fits per-layer costs (the NIC, the CPU's work per byte and per message, the reduction,
the shared-memory steps) on measured rows, prints its error on every measured point, and
predicts time and busbw of the full mesh, a ring, recursive halving/doubling and a tree
for 8 to 1024 hosts, with the algorithm it would pick at each scale and size.
Note [Cost model] says what it models and what it leaves out.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from typing import NamedTuple

from torch_sagemaker.bench.netns import BURST_BYTES

# Note [Cost model]
# A collective of S bytes (nccl-tests' S) on H hosts of L ranks (N = HL) costs, per rank:
#
#   T = alpha + latency steps + max(NIC time, overlapped CPU work / CPU share) + serial CPU work
#
# - NIC time: the bytes the busiest NIC sends (k (H-1)/H S for the hierarchical algorithms,
#   k = 2 for all_reduce, 1 otherwise; a flat ring over all N ranks sends k (N-1)/N S) at
#   nic_efficiency times its rate. Both directions are shaped alike, so one term holds both.
#   An exchange that waits on F flows per NIC direction at once (the mesh: H-1; a ring: 1)
#   takes 1 + flow_skew (F-1) times as long: the flows share the link unevenly, so some
#   parts arrive late, and an all_reduce's second half, or the call's end, waits for the
#   last (docs/multi_node.md, "Mesh or ring": a 4x1 mesh all_reduce's ranks finished their
#   reductions between 243 and 406 ms). Linear in F is the simplest growth that the 4- and
#   8-host rows fit; later runs on 16 and 32 hosts (not in the fit) agree with it roughly,
#   and beyond 32 hosts nothing was measured.
# - CPU work, in core-seconds: every byte a rank sends or receives over TCP (the kernel's
#   copies and, on the simulated hosts, the virtual cable's shaping and bridging), every
#   message (system calls, headers, polling), every byte a reduction reads, every byte of
#   the shared-memory reduce-scatter's inputs, every byte copied. It runs on the rank's
#   share of the cores: min(1, cores / ranks on the machine). On the simulated hosts every
#   rank of every host shares the one machine's cores, which is why 4x1 and 2x2 are slower
#   than the NIC allows while 2x1 is not; on real hosts only a host's own ranks share.
# - Overlap, as comm_hier.cpp does it (Note [Pipelined exchanges]): the network exchange,
#   the chunk reductions, the shared-memory reduce-scatter and an all_gather's copy of its
#   own part run together, so their time is the larger of the NIC's and the CPU's; the
#   shared-memory all-gather after the exchange is serial (gloo copies the own part first).
# - Latency: alpha per call (entering, leaving, the ranks' skew after the barrier); wake
#   per sequential wait (the call's, and one per step) times the oversubscription, ranks per
#   core minus one (a rank that waits for a message, once woken, waits again for a core:
#   only on an oversubscribed machine); and, for a ring, recursive halving/doubling or a
#   tree, one step latency per sequential step (gloo's flat ring has its own, flat_step).
#   The mesh has no steps: all its messages are posted at once, so its per-peer cost is CPU
#   work per message, which grows with H.
# - The simulated cables pass a burst (their token buckets' size) above the rate when idle:
#   the NIC time counts only the bytes beyond it (Cluster.burst; 0 for a real NIC).
#
# Fitting: the reduction's and the copies' costs come straight from the timeline phases
# (busy time times the CPU share, over the bytes). The shared-memory reduce-scatter's is read
# there too, but its phases' busy time includes waiting for the host's other ranks, so the
# fit tries it at 0.5, 1 and 2 times that reading (among its starts) and keeps the best. The
# NIC efficiency, the CPU cost per network byte and per message, alpha, wake, the flow
# skew and the step latency are fitted on the smddp rows' end-to-end times, mesh and ring
# together (least squares of the log ratio, a coordinate search from a small grid of
# starts). gloo's flat_step is then fitted on its all_reduce rows (gloo's reduce_scatter
# and all_gather are not modelled: the first sends twice the bytes, as the wire counters
# show, and both are far from a ring's time). Each row says which algorithm ran (the
# bench's ``algorithm``); with several runs, each point's fastest run counts: the machine's
# other work only adds time. A latency the fit drives to nothing is not resolved by the
# runs (unresolved(): other terms explained the times), and predictions take it from
# --predict-latency / --predict-message instead.
#
# What it leaves out: incast and the switch beyond the flow skew (H-1 senders into one port
# at once; the simulated switch has deep queues and dropped nothing up to 8 hosts, but
# thousands of packets per case for the 32-host mesh; at 8 hosts and 1 MiB the mesh's ranks
# ended 8-29 ms into a call the ring ends in 9), stragglers and
# jitter at scale (the slowest of 1024 hosts sets the pace), congestion in a real fabric, several
# NICs being one (it takes nics x rate as one pipe), TCP's slow start after idle, the
# mesh's per-peer state (a socket and a poll entry per peer: it counts per-message work,
# not per-peer work), and pipeline fill in rings and trees. Its latency terms are fitted
# on one overloaded 2-core machine, where the scheduler, not the wire, sets them; its CPU
# costs are that machine's kernel path through virtual cables and shaping. Predictions
# for other hosts can override both (--predict-latency, --predict-message, --predict-cpu).

CHUNK_BYTES = 512 * 1024  # SMDDP_NET_CHUNK_BYTES: one network message
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
ALGORITHMS = ("mesh", "ring", "doubling", "tree", "flat_ring")
# The largest relative error the model claims on the recorded points (tests/data/multihost,
# tests/unit/test_cost_model.py). The target is 15% on every point. It holds for smddp's
# points from 16 MiB; below, one scheduling delay of a few ms on the shared 2-core machine
# is most of a call, and 8 hosts' mesh at 1 MiB waits on flows the model does not see; gloo's
# flat ring with two ranks per host costs less CPU than modelled. docs/multi_node.md ("Cost
# model") gives the points.
TARGET = 0.15
ERROR_BOUND = TARGET
ERROR_BOUND_SMALL = 0.55
ERROR_BOUND_FLAT = 0.40
# Out of sample (tests/data/multihost/validation, 16 and 32 hosts): the mesh, whose incast
# dropped thousands of packets per case on 32 hosts, which the model does not see.
ERROR_BOUND_MESH_UNSEEN = 0.50
SMALL = 16 << 20


def error_bound(algorithm: str, size: int) -> float:
    """The relative error the model claims for a measured point.

    Args:
        algorithm: What ran: ``mesh`` or ``ring`` (smddp), ``flat_ring`` (gloo).
        size: nccl-tests' S in bytes.

    Returns:
        The bound on |predicted / measured - 1| that tests/unit/test_cost_model.py holds the
        recorded points to.
    """
    if algorithm == "flat_ring":
        return ERROR_BOUND_FLAT
    return ERROR_BOUND if size >= SMALL else ERROR_BOUND_SMALL


# Fitted on the smddp rows' end-to-end times. reduce_cpu and copy_cpu are read off the
# timeline, shm_reduce_cpu too (then chosen among 3 multiples by the grid of starts), and
# flat_step is fitted on gloo's rows afterwards.
FITTED_END_TO_END = (
    "nic_efficiency",
    "net_cpu",
    "message",
    "alpha",
    "wake",
    "flow_skew",
    "step",
)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-layer costs; CPU costs are core-seconds, so they hold for any CPU share.

    Args:
        alpha: Seconds per call that no byte explains.
        wake: Seconds per sequential wait (the call's, and one per ring or tree step) per
            unit of oversubscription (ranks per core minus one): the wake-ups that wait for a
            core (none on real hosts with a core per rank).
        step: Seconds per sequential step of smddp's ring, halving/doubling or tree
            (latency, not CPU).
        flat_step: Seconds per step of gloo's flat ring (another implementation's).
        nic_efficiency: The fraction of the NIC's rate that carries payload.
        net_cpu: Core-seconds per byte a rank sends or receives over TCP.
        message: Core-seconds per message a rank sends or receives.
        reduce_cpu: Core-seconds per byte a reduction reads.
        shm_reduce_cpu: Core-seconds per input byte of the shared-memory reduce-scatter.
        copy_cpu: Core-seconds per byte copied (the shared-memory all-gather's output,
            an all_gather's own part).
        flow_skew: The NIC time's growth per flow beyond one that an exchange waits on
            (the mesh's H-1 flows per NIC share it unevenly; Note [Cost model]).
    """

    alpha: float = 1e-3
    wake: float = 1e-3
    step: float = 1e-3
    flat_step: float = 1e-3
    nic_efficiency: float = 0.9
    net_cpu: float = 1e-9
    message: float = 1e-5
    reduce_cpu: float = 3e-10
    shm_reduce_cpu: float = 1e-9
    copy_cpu: float = 3e-10
    flow_skew: float = 0.02


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where a collective runs.

    Args:
        hosts: H.
        ranks: L, ranks per host.
        nic_rate: Bytes/s of each host's NIC (all its NICs together), each direction.
        cores: Cores that the ranks on one machine share.
        machine_ranks: Ranks sharing those cores: L on real hosts, H x L when every
            simulated host runs on the same machine. 0 means L.
        burst: Bytes a NIC passes at once above its rate when it has been idle (the
            simulated cables' token buckets); 0 for a real NIC.
    """

    hosts: int
    ranks: int
    nic_rate: float
    cores: float
    machine_ranks: int = 0
    burst: float = 0.0

    @property
    def oversubscription(self) -> float:
        """Ranks beyond one per core, per core: 0 when every rank has a core."""
        return max(0.0, (self.machine_ranks or self.ranks) / self.cores - 1.0)

    @property
    def cpu_share(self) -> float:
        """The fraction of a core each rank gets."""
        return min(1.0, self.cores / (self.machine_ranks or self.ranks))


def nic_factor(op: str) -> int:
    """How often S crosses the busiest NIC, per (H-1)/H: 2 for all_reduce, else 1."""
    return 2 if op == "all_reduce" else 1


def busbw(op: str, world: int, size: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth in bytes/s: S / t times k (n-1)/n over all n ranks."""
    return size / seconds * nic_factor(op) * (world - 1) / world


def nic_bytes(algorithm: str, op: str, hosts: int, ranks: int, size: int) -> float:
    """Bytes the busiest host's NIC sends for one call.

    The mesh, the hierarchical ring and recursive halving/doubling send the minimum,
    k (H-1)/H S. A flat ring over all N ranks crosses each host's boundary once per step:
    k (N-1)/N S. A double binary tree (all_reduce only) makes every host an inner node of
    one tree and a leaf of the other: about 2 S per host, or the mesh's S with two hosts.
    """
    world = hosts * ranks
    k = nic_factor(op)
    if algorithm == "flat_ring":
        return k * (world - 1) / world * size
    if algorithm == "tree" and hosts > 2:
        return 2.0 * size
    return k * (hosts - 1) / hosts * size


def _chunks(nbytes: float) -> int:
    return max(1, math.ceil(nbytes / CHUNK_BYTES))


class Work(NamedTuple):
    """What one call asks of a rank and its NIC, before any cost is put on it."""

    nic_bytes: float  # the busiest NIC's bytes
    nic_rate: float
    burst: float  # Cluster.burst
    steps: int  # sequential latency steps (0 for the mesh: everything is posted at once)
    flat_steps: int  # the same for gloo's flat ring, whose steps cost flat_step
    moved: float  # bytes the rank sends plus bytes it receives over TCP between hosts
    looped: float  # bytes it sends plus bytes it receives over TCP inside its host
    messages: float  # messages it sends plus messages it receives
    reduced: float  # bytes its reductions read
    shm_input: float  # its shared-memory reduce-scatter's input bytes
    copied: float  # bytes it copies outside the exchange (serial)
    own: float  # bytes it copies during the exchange (an all_gather's own part)
    flows: int  # flows one rank's exchange waits on per NIC direction (the mesh: H-1)
    share: float  # its fraction of a core
    oversubscription: float  # Cluster.oversubscription


def work(cluster: Cluster, op: str, size: int, algorithm: str = "mesh") -> Work:
    """What one call of ``op`` on ``size`` bytes asks of each rank (Note [Cost model]).

    Args:
        cluster: Hosts, ranks, NIC rate and CPU share.
        op: One of OPS.
        size: nccl-tests' S in bytes.
        algorithm: ``mesh`` (smddp's), ``ring`` (a ring per rail between hosts, shared
            memory inside), ``doubling`` (recursive halving and doubling per rail),
            ``tree`` (a double binary tree per rail; all_reduce only) or ``flat_ring``
            (gloo's: one ring over all ranks, TCP inside a host too).

    Raises:
        ValueError: An unknown algorithm, or a tree for another op than all_reduce.
    """
    h, local = cluster.hosts, cluster.ranks
    world = h * local
    part = size / world
    k = nic_factor(op)
    reduces = op != "all_gather_into_tensor"
    # An all_gather's own part is copied into the output in slices between the exchange's
    # rounds (Note [Own part during the exchange] in comm_hier.cpp); gloo copies it first.
    own = part if op == "all_gather_into_tensor" else 0.0
    copied = own if algorithm == "flat_ring" else 0.0
    own = 0.0 if algorithm == "flat_ring" else own
    flows = h - 1 if algorithm == "mesh" else 1
    shm = 0.0
    looped = 0.0
    flat_steps = 0
    if algorithm == "flat_ring":
        flat_steps = k * (world - 1)
        steps = 0
        # Each step a rank sends a part to the next rank and receives one from the previous,
        # over TCP even inside a host: the busiest rank of a host has one neighbour on
        # another host and one over loopback, which copies but is neither shaped nor bridged.
        moved = (2.0 if local == 1 else 1.0) * flat_steps * part
        looped = 0.0 if local == 1 else flat_steps * part
        messages = 2.0 * flat_steps * _chunks(part)
        reduced = 2.0 * (world - 1) * part if reduces else 0.0
    else:
        if algorithm == "mesh":
            steps = 0
            moved = 2.0 * k * (h - 1) * part
            messages = 2.0 * k * (h - 1) * _chunks(part)
            reduced = h * part if reduces else 0.0
        elif algorithm == "ring":
            steps = k * (h - 1)
            moved = 2.0 * k * (h - 1) * part
            messages = 2.0 * steps * _chunks(part)
            reduced = 2.0 * (h - 1) * part if reduces else 0.0  # its own and the incoming
        elif algorithm == "doubling":
            # Recursive halving (reduce-scatter) and doubling (all-gather) between hosts:
            # log2 H steps each, the message doubling from S/N; the bytes of a ring.
            rounds = max(1, math.ceil(math.log2(h)))
            steps = k * rounds
            moved = 2.0 * k * (h - 1) * part
            messages = 2.0 * k * sum(_chunks(part * 2**i) for i in range(rounds))
            reduced = 2.0 * (h - 1) * part if reduces else 0.0
        elif algorithm == "tree":
            if op != "all_reduce":
                raise ValueError("a tree is modelled for all_reduce only")
            # The rank's rail data D, half through each tree in chunks. In the tree where
            # it is an inner node it receives two children's halves and sends one up, then
            # receives one and sends two down (6 messages per chunk, 3 D of bytes);
            # in the other it is a leaf (2 per chunk, D). It reduces its two children's
            # halves into its own.
            rail = size / local
            steps = 2 * max(1, math.ceil(math.log2(h)))
            moved = 4.0 * rail if h > 2 else 2.0 * k * (h - 1) * part
            messages = 8.0 * _chunks(rail / 2)
            reduced = 1.5 * rail if h > 2 else h * part
        else:
            raise ValueError(f"unknown algorithm {algorithm!r}")
        if local > 1 and reduces:
            shm = size  # the shared-memory reduce-scatter reads S per rank
        if local > 1 and op != "reduce_scatter_tensor":
            copied += (local - 1) / local * size  # the shared-memory all-gather, after
    return Work(
        nic_bytes(algorithm, op, h, local, size),
        cluster.nic_rate,
        cluster.burst,
        steps,
        flat_steps,
        moved,
        looped,
        messages,
        reduced,
        shm,
        copied,
        own,
        flows,
        cluster.cpu_share,
        cluster.oversubscription,
    )


def seconds(costs: Costs, w: Work) -> float:
    """The time of a call that asks ``w``, at ``costs`` (Note [Cost model])."""
    wire = max(0.0, w.nic_bytes - w.burst) / (costs.nic_efficiency * w.nic_rate)
    wire *= 1.0 + costs.flow_skew * (w.flows - 1)
    overlapped = (
        costs.net_cpu * w.moved
        + costs.copy_cpu * (w.looped + w.own)
        + costs.message * w.messages
        + costs.reduce_cpu * w.reduced
        + costs.shm_reduce_cpu * w.shm_input
    )
    # Every sequential wait (the call's, and one per step) may wait again for a core.
    waits = 1 + w.steps + w.flat_steps
    fixed = costs.alpha + costs.wake * w.oversubscription * waits
    fixed += w.steps * costs.step + w.flat_steps * costs.flat_step
    return fixed + max(wire, overlapped / w.share) + costs.copy_cpu * w.copied / w.share


def predict(costs: Costs, cluster: Cluster, op: str, size: int, algorithm: str = "mesh") -> float:
    """Seconds for one call of ``op`` on ``size`` bytes; arguments as for work()."""
    return seconds(costs, work(cluster, op, size, algorithm))


def algorithms_for(op: str) -> tuple[str, ...]:
    """The hierarchical algorithms the model compares for ``op`` (a tree only for all_reduce)."""
    both = ("mesh", "ring", "doubling")
    return (*both, "tree") if op == "all_reduce" else both


def best(costs: Costs, cluster: Cluster, op: str, size: int) -> tuple[str, float]:
    """The algorithm with the lowest predicted time, and that time."""
    return min(
        ((a, predict(costs, cluster, op, size, a)) for a in algorithms_for(op)),
        key=lambda x: x[1],
    )


# --- measured rows -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured row: a layout, op, size and backend, and its median time."""

    hosts: int
    ranks: int
    op: str
    size: int
    backend: str
    seconds: float
    nic_rate: float
    cores: float
    timeline: list | None = None
    ran: str = ""  # the row's "algorithm"; empty in files written before it was recorded
    burst: float = 0.0  # the run's burst_bytes

    @property
    def algorithm(self) -> str:
        """The algorithm that ran: the row's, else smddp's mesh or gloo's flat ring."""
        if self.ran:
            return self.ran
        return "flat_ring" if self.backend == "gloo" else "mesh"

    def cluster(self) -> Cluster:
        """The measured machine: all simulated hosts share its cores."""
        machine = self.hosts * self.ranks
        return Cluster(self.hosts, self.ranks, self.nic_rate, self.cores, machine, self.burst)


def points(runs: Iterable[dict]) -> list[Point]:
    """The rows of ``bench multihost --json`` files as points.

    A file without ``cores`` (written before it was recorded) is taken as a 2-core machine,
    one without ``burst_bytes`` as cables of netns.BURST_BYTES (every run so far).
    """
    out = []
    for run in runs:
        for r in run["rows"]:
            hosts, local = (int(x) for x in r["layout"].split("x"))
            out.append(
                Point(
                    hosts,
                    local,
                    r["op"],
                    r["bytes"],
                    r["backend"],
                    r["seconds"],
                    run["rate_bits"] / 8,
                    run.get("cores", 2),
                    r.get("timeline"),
                    r.get("algorithm", ""),
                    run.get("burst_bytes", BURST_BYTES),
                )
            )
    return out


def fastest(pts: list[Point]) -> list[Point]:
    """One point per layout, op, size and algorithm: the run with the lowest time.

    The machine's other work only ever adds time, so the fastest of several runs is the
    closest to what the collectives themselves cost (Note [Cost model]). Rows of smddp
    groups that ran the same algorithm (the default group's choice and a forced one) are
    runs of one point.
    """
    groups: dict[tuple, Point] = {}
    for p in pts:
        key = (p.hosts, p.ranks, p.op, p.size, p.algorithm, p.nic_rate)
        if key not in groups or p.seconds < groups[key].seconds:
            groups[key] = p
    return list(groups.values())


def modelled(p: Point) -> bool:
    """Whether the model claims to predict this point: smddp's rows and gloo's all_reduce."""
    return p.algorithm != "flat_ring" or p.op == "all_reduce"


# --- fitting -------------------------------------------------------------------------------


def _phases(spans: list) -> dict[str, tuple[float, float, float, float]]:
    """A rank's timeline as phase -> (first begin, last end, busy seconds, bytes)."""
    out: dict[str, tuple[float, float, float, float]] = {}
    for phase, begin, end, n in spans:
        b, e, busy, nbytes = out.get(phase, (begin, end, 0.0, 0.0))
        out[phase] = (min(b, begin), max(e, end), busy + (end - begin) / 1e9, nbytes + n)
    return out


def timeline_costs(pts: list[Point], min_size: int = 16 << 20) -> dict[str, float]:
    """Per-byte CPU costs read off the timeline phases of the smddp rows of ``min_size`` up.

    Each is the median over ranks and rows of a phase's busy time times the rank's CPU
    share, over the bytes it handled: ``reduce_cpu`` from the chunk reductions (H inputs
    each), ``shm_reduce_cpu`` from the shared-memory reduce-scatter's steps (S of input per
    rank), ``copy_cpu`` from the shared-memory all-gather's ((L-1)/L S). Costs without a
    phase to read them from are left out.
    """
    samples: dict[str, list[float]] = {"reduce_cpu": [], "shm_reduce_cpu": [], "copy_cpu": []}
    for p in pts:
        if p.algorithm == "flat_ring" or not p.timeline or p.size < min_size:
            continue
        share = p.cluster().cpu_share
        for spans in p.timeline:
            ph = _phases(spans)
            if "reduce" in ph:
                samples["reduce_cpu"].append(ph["reduce"][2] * share / (p.hosts * ph["reduce"][3]))
            if "local reduce_scatter" in ph and p.op == "reduce_scatter_tensor":
                samples["shm_reduce_cpu"].append(ph["local reduce_scatter"][2] * share / p.size)
            if "local all_gather" in ph:
                copied = (p.ranks - 1) / p.ranks * p.size
                samples["copy_cpu"].append(ph["local all_gather"][2] * share / copied)
    return {name: statistics.median(v) for name, v in samples.items() if v}


def log_error(costs: Costs, pts: list[Point]) -> float:
    """The sum of squared log ratios of predicted to measured times."""
    return _loss(costs, [(work(p.cluster(), p.op, p.size, p.algorithm), p.seconds) for p in pts])


def _loss(costs: Costs, cases: list[tuple[Work, float]]) -> float:
    return sum(math.log(seconds(costs, w) / t) ** 2 for w, t in cases)


def _search(
    costs: Costs, names: tuple[str, ...], loss: Callable[[Costs], float], rounds: int = 60
) -> Costs:
    """Coordinate search in log space: each name in turn, steps halving when none helps."""
    step = 1.0  # factor e^step per move
    best_loss = loss(costs)
    for _ in range(rounds):
        moved = False
        for name in names:
            for sign in (1.0, -1.0):
                value = getattr(costs, name) * math.exp(sign * step)
                if name == "nic_efficiency" and value > 1.0:
                    continue
                trial = dataclasses.replace(costs, **{name: value})
                trial_loss = loss(trial)
                if trial_loss < best_loss:
                    costs, best_loss, moved = trial, trial_loss, True
                    break
        if not moved:
            step /= 2
            if step < 1e-3:
                break
    return costs


def fit(pts: list[Point], timeline: dict[str, float] | None = None) -> Costs:
    """Fits the costs on measured points (Note [Cost model]).

    Args:
        pts: The measured points, of one run or several (each point's fastest run counts).
        timeline: The costs to take as read instead of reading them off the points'
            timelines (timeline_costs).

    Raises:
        ValueError: No smddp rows to fit on.
    """
    measured = fastest(pts)
    smddp = [p for p in measured if p.algorithm != "flat_ring"]
    if not smddp:
        raise ValueError("no smddp rows to fit the model on")
    read = timeline_costs(measured) if timeline is None else timeline
    cases = [(work(p.cluster(), p.op, p.size, p.algorithm), p.seconds) for p in smddp]
    start = dataclasses.replace(Costs(), **read)
    # The max() of the NIC and CPU terms makes the loss kinked: a coordinate search from one
    # start can stop on a ridge, so it starts from a small grid and keeps the best.
    fitted = []
    for eta, net, shm in itertools.product((0.7, 0.85, 0.95), (2e-10, 1e-9), (0.5, 1.0, 2.0)):
        trial = dataclasses.replace(
            start, nic_efficiency=eta, net_cpu=net, shm_reduce_cpu=start.shm_reduce_cpu * shm
        )
        trial = _search(trial, FITTED_END_TO_END, lambda c: _loss(c, cases))
        fitted.append((_loss(trial, cases), trial))
    costs = min(fitted, key=lambda x: x[0])[1]
    rings = [p for p in measured if p.algorithm == "flat_ring" and p.op == "all_reduce"]
    if rings:
        ring_cases = [(work(p.cluster(), p.op, p.size, p.algorithm), p.seconds) for p in rings]
        costs = _search(costs, ("flat_step",), lambda c: _loss(c, ring_cases))
    return costs


# --- reports -------------------------------------------------------------------------------


def errors(costs: Costs, pts: list[Point]) -> list[tuple[Point, float, float]]:
    """Each modelled point with its predicted seconds and relative error (pred / meas - 1)."""
    out = []
    for p in pts:
        if modelled(p):
            t = predict(costs, p.cluster(), p.op, p.size, p.algorithm)
            out.append((p, t, t / p.seconds - 1))
    return out


def _size(n: float) -> str:
    from torch_sagemaker.bench.collectives_report import format_size

    return format_size(int(n))


# Latencies the fit drove below this are not resolved by the runs: other terms explain the
# times, and the value says nothing about the real latency (predictions need --predict-latency).
RESOLUTION = 1e-6


def unresolved(costs: Costs) -> list[str]:
    """The latency costs a fit left below RESOLUTION seconds.

    Args:
        costs: Fitted costs.

    Returns:
        The names of those of alpha, wake, step, flat_step and message below RESOLUTION:
        other terms explained the measured times, so their values mean nothing.
    """
    names = ("alpha", "wake", "step", "flat_step", "message")
    return [n for n in names if getattr(costs, n) < RESOLUTION]


def costs_table(costs: Costs) -> str:
    """The costs in readable units, one line each."""
    per_core = "GB/s per core"
    blind = unresolved(costs)

    def ms(name: str) -> str:
        value = getattr(costs, name)
        return "not resolved" if name in blind else f"{value * 1e3:.3f} ms"

    lines = [
        "| cost | value |",
        "|---|---|",
        f"| alpha (per call) | {ms('alpha')} |",
        f"| wake (per wait, per rank per core beyond one) | {ms('wake')} |",
        f"| step (ring/tree latency) | {ms('step')} |",
        f"| gloo's flat ring step | {ms('flat_step')} |",
        f"| NIC efficiency | {costs.nic_efficiency:.3f} |",
        f"| TCP bytes sent or received | {1e-9 / costs.net_cpu:.2f} {per_core} |",
        f"| message | {costs.message * 1e6:.0f} us of CPU |"
        if "message" not in blind
        else "| message | not resolved |",
        f"| reduction (bytes read) | {1e-9 / costs.reduce_cpu:.2f} {per_core} |",
        f"| shared-memory reduce-scatter (input) | {1e-9 / costs.shm_reduce_cpu:.2f} {per_core} |",
        f"| copies | {1e-9 / costs.copy_cpu:.2f} {per_core} |",
        f"| flow skew (NIC time per flow beyond one) | {costs.flow_skew:.3f} |",
    ]
    return "\n".join(lines)


def error_table(rows: list[tuple[Point, float, float]]) -> str:
    """Measured and predicted times of every modelled point, with the error."""
    lines = [
        "| layout | op | size | algorithm | measured ms | model ms | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, t, err in rows:
        lines.append(
            f"| {p.hosts}x{p.ranks} | {p.op} | {_size(p.size)} | {p.algorithm} | "
            f"{p.seconds * 1e3:.1f} | {t * 1e3:.1f} | {err:+.0%} |"
        )
    lines.append("")
    smddp = [r for r in rows if r[0].algorithm != "flat_ring"]
    for label, group in (
        (f"smddp from {_size(SMALL)}", [r for r in smddp if r[0].size >= SMALL]),
        (f"smddp below {_size(SMALL)}", [r for r in smddp if r[0].size < SMALL]),
        ("gloo", [r for r in rows if r[0].algorithm == "flat_ring"]),
    ):
        if not group:
            continue
        p, _, err = max(group, key=lambda r: abs(r[2]))
        median = statistics.median(abs(r[2]) for r in group)
        within = sum(abs(r[2]) <= TARGET for r in group)
        lines.append(
            f"{label}: {within} of {len(group)} within {TARGET:.0%}, median {median:.0%}, "
            f"largest {abs(err):.0%} ({p.hosts}x{p.ranks} {p.op} {_size(p.size)} "
            f"{p.algorithm}; claimed bound {error_bound(p.algorithm, p.size):.0%})"
        )
    return "\n".join(lines)


HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)


def prediction_table(
    costs: Costs, ranks: int, nic_rate: float, cores: float, sizes: list[int]
) -> str:
    """Per op: for each host count and size, the algorithm picked, its time and busbw.

    "of NIC" is the NIC bound k (H-1)/H S at the NIC's rate over the time.
    """
    lines = []
    for op in OPS:
        head = ["hosts"] + [_size(s) for s in sizes]
        lines += [f"\n{op}: algorithm, ms, busbw GB/s, of NIC", "| " + " | ".join(head) + " |"]
        lines.append("|" + "---|" * len(head))
        for h in HOSTS:
            cluster = Cluster(h, ranks, nic_rate, cores)
            cells = [str(h)]
            for s in sizes:
                algorithm, t = best(costs, cluster, op, s)
                bound = nic_bytes("mesh", op, h, ranks, s) / nic_rate
                cells.append(
                    f"{algorithm} {t * 1e3:.3g} {busbw(op, h * ranks, s, t) / 1e9:.1f} "
                    f"{bound / t:.2f}"
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
