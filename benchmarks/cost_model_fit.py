"""Fitting the cost model (cost_model.py) on ``bench multihost`` rows, and its error.

The measured points (which algorithm ran, on which layout, how fast), the per-byte costs
read off their timelines, the end-to-end fit, and the error the model claims on the
recorded runs (tests/data/multihost). Note [Cost model] in
torch_sagemaker/planner/cost_model.py says how.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable

import numpy as np

from benchmarks.multihost_rank import SMDDP_POOL
from tools.bare_tcp import BARE_TCP
from tools.netns import BURST_BYTES
from torch_sagemaker.planner import cost_model as cm

# The largest relative error the model claims on the recorded points (tests/data/multihost,
# tests/unit/test_cost_model.py). The target is 15% on every point. It holds on shaped
# cables from 16 MiB, both dtypes. At 1 MiB one scheduling delay of a few ms on the shared
# 2-core machine is most of a call; since the unshaped rows joined the fit (they set the CPU
# per TCP byte, which the shaped rows left loose), the 4x2 mesh all_gather of build acc023f
# there is 16% long, so 1 MiB claims 20% (it was 15%). On unshaped cables the CPU is the
# bound and a point's three runs differed by up to 1.6x (docs/log/multi_node.md, "At the
# machine's own rate"): the 2x1 all_gather is 17-29% long in both dtypes (the model's copy
# of its own part costs more than it did there), so they claim 35%. For gloo's flat ring the
# model is 30-37% off at 1 MiB on 2 and 4 hosts (its 1 MiB all_reduce calls on 4x2 took
# anywhere from 14 to 43 ms). docs/cost_model.md gives the points.
TARGET = 0.15
ERROR_BOUND = TARGET
ERROR_BOUND_SMALL = 0.20
ERROR_BOUND_UNSHAPED = 0.35
ERROR_BOUND_FLAT = 0.40
# Out of sample (tests/data/multihost/validation, 16 and 32 hosts): the mesh, whose incast
# dropped thousands of packets per case on 32 hosts, which the model does not see.
ERROR_BOUND_MESH_UNSEEN = 0.40
# The tree's and halving/doubling's rows (16 and 32 hosts of one rank on the 2 cores, fitted
# last; Note [Staged algorithms] in cost_model.py): within 0.82-1.26, the largest errors at
# 64 KiB, where one wait for a core is most of a call.
ERROR_BOUND_STAGED = 0.30
SMALL = 16 << 20


def error_bound(algorithm: str, size: int, shaped: bool = True) -> float:
    """The relative error the model claims for a measured point.

    Args:
        algorithm: What ran: ``mesh``, ``ring``, ``doubling`` or ``tree`` (smddp),
            ``flat_ring`` (gloo).
        size: nccl-tests' S in bytes.
        shaped: Whether the cables were shaped (Point.shaped); unshaped, the CPU is the bound.

    Returns:
        The bound on |predicted / measured - 1| that tests/unit/test_cost_model.py holds the
        recorded points to.
    """
    if algorithm == "flat_ring":
        return ERROR_BOUND_FLAT
    if algorithm in cm.STAGED:
        return ERROR_BOUND_STAGED
    if not shaped:
        return ERROR_BOUND_UNSHAPED
    return ERROR_BOUND if size >= SMALL else ERROR_BOUND_SMALL


# Fitted on the smddp rows' end-to-end times in float32. reduce_cpu and copy_cpu are read off
# the timeline, shm_reduce_cpu too (then chosen among 3 multiples by the grid of starts), and
# flat_step is fitted on gloo's rows afterwards.
FITTED_END_TO_END = (
    "nic_efficiency",
    "net_cpu",
    "message",
    "alpha",
    "wake",
    "flow_skew",
    "flow_latency",
    "step",
    "shaper_cpu",
)
# Fitted last, on the staged algorithms' rows (the tree and halving/doubling, which the runs
# of 16 and 32 hosts measured: tests/data/multihost/*-staged-*.json), the others held (Note
# [Staged algorithms] in cost_model.py).
FITTED_STAGED = ("stage_serial", "stage_wake")
# Fitted afterwards on the bf16/fp16 rows, each against the float32 row of the same jobs
# (Note [Cost model of half precision]).
FITTED_HALF = ("half_reduce_cpu", "half_shm_reduce_cpu")


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
    dtype: str = "float32"  # the row's "dtype"; float32 in files written before it was recorded
    job: int = 0  # which run (file) of those given to points() it came from
    network: str = ""  # the hosts' congestion control and switch queue (points())

    @property
    def algorithm(self) -> str:
        """The algorithm that ran: the row's, else smddp's mesh or gloo's flat ring."""
        if self.ran:
            # The backend's name for recursive halving/doubling is the model's "doubling".
            return "doubling" if self.ran == "halving_doubling" else self.ran
        return "flat_ring" if self.backend == "gloo" else "mesh"

    @property
    def shaped(self) -> bool:
        """Whether the simulated cables were shaped (a run at --rate unlimited was not)."""
        return math.isfinite(self.nic_rate)

    @property
    def cables(self) -> str:
        """The simulated network in words: rate, congestion control, switch-port queue."""
        rate = f"{self.nic_rate * 8 / 1e9:g} Gbit/s" if self.shaped else "unshaped"
        return f"{rate}, {self.network}" if self.network else rate

    def cluster(self) -> cm.Cluster:
        """The measured machine: all simulated hosts share its cores."""
        machine = self.hosts * self.ranks
        return cm.Cluster(
            self.hosts, self.ranks, self.nic_rate, self.cores, machine, self.burst, self.shaped
        )

    def work(self) -> cm.Work:
        """What the measured call asked of each rank (cost_model.work)."""
        return cm.work(self.cluster(), self.op, self.size, self.algorithm, self.dtype)


def points(runs: Iterable[dict]) -> list[Point]:
    """The rows of ``bench multihost --json`` files as points.

    Rows of runs on different simulated networks (congestion control, switch-port queue)
    are points of their own (``network``), not runs of one point.
    A file without ``cores`` (written before it was recorded) is taken as a 2-core machine,
    one without ``burst_bytes`` as cables of netns.BURST_BYTES (every run so far), a row
    without ``dtype`` as float32. Rows of the bare-TCP ceiling, and of operands in smddp's
    pool (whose local steps copy less than the model prices), are left out. Each point
    keeps the index of its run (``job``): the half-precision rows are fitted against the
    float32 rows of the same jobs (half_pairs).
    """
    out = []
    for job, run in enumerate(runs):
        queue = run.get("switch_queue_bytes")
        queue_words = f"{queue >> 20} MiB queue" if queue else "deep queue"
        network = f"{run['congestion']}, {queue_words}" if "congestion" in run else ""
        for r in run["rows"]:
            if r["backend"] == BARE_TCP:  # no collective: the machine's ceiling
                continue
            if r["backend"] == SMDDP_POOL:  # copies less than the model prices
                continue
            dtype = r.get("dtype", "float32")
            hosts, local = (int(x) for x in r["layout"].split("x"))
            out.append(
                Point(
                    hosts,
                    local,
                    r["op"],
                    r["bytes"],
                    r["backend"],
                    r["seconds"],
                    # An unshaped run (--rate unlimited): the wire costs nothing, the CPU all.
                    (run["rate_bits"] or math.inf) / 8,
                    run.get("cores", 2),
                    r.get("timeline"),
                    r.get("algorithm", ""),
                    run.get("burst_bytes", BURST_BYTES),
                    dtype,
                    job,
                    network,
                )
            )
    return out


def fastest(pts: list[Point]) -> list[Point]:
    """One point per layout, op, size, algorithm, dtype and network: the fastest run.

    The machine's other work only ever adds time, so the fastest of several runs is the
    closest to what the collectives themselves cost (Note [Cost model]). Rows of smddp
    groups that ran the same algorithm (the default group's choice and a forced one) are
    runs of one point.
    """
    groups: dict[tuple, Point] = {}
    for p in pts:
        key = (*_key(p), p.dtype)
        if key not in groups or p.seconds < groups[key].seconds:
            groups[key] = p
    return list(groups.values())


def modelled(p: Point) -> bool:
    """Whether the model claims to predict this point (smddp's, gloo's shaped fp32 all_reduce).

    It claims smddp's rows, and gloo's float32 all_reduce on shaped cables.

    gloo's flat ring is priced with smddp's CPU rates, which are not gloo's: where the CPU
    is the bound (unshaped cables) the model is 21-33% short of it, and its bf16 reduction
    is gloo's own code (Note [Cost model of half precision]).
    """
    if p.algorithm != "flat_ring":
        return True
    return p.op == "all_reduce" and p.dtype == "float32" and p.shaped


def half_pairs(pts: list[Point]) -> list[tuple[Point, Point]]:
    """Each modelled bf16/fp16 point of smddp with its float32 twin from the same jobs.

    The twin has the same layout, op, size, algorithm and cables; both are the fastest of
    the runs that measured both dtypes, so what the float32 model misses at a point (the
    build, the machine's other work, the cables' congestion control) is common to both.
    """
    jobs = {p.job for p in pts if p.dtype != "float32"}
    both = fastest([p for p in pts if p.job in jobs])
    full = {_key(p): p for p in both if p.dtype == "float32"}
    return [
        (p, full[_key(p)])
        for p in both
        if p.dtype != "float32" and p.algorithm != "flat_ring" and _key(p) in full
    ]


def _key(p: Point) -> tuple:
    return (p.hosts, p.ranks, p.op, p.size, p.algorithm, p.nic_rate, p.network)


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


class _Cases:
    """Measured calls priced all at once: Work's fields as arrays (the fit's inner loop)."""

    def __init__(self, pts: list[Point]):
        rows = [p.work() for p in pts]
        # Each field an array over the calls: cost_model.seconds() takes either.
        self.work = cm.Work._make(np.array(col, dtype=float) for col in zip(*rows))
        self.log_measured = np.log([p.seconds for p in pts])

    def log_predicted(self, costs: cm.Costs) -> np.ndarray:
        return np.log(cm.seconds(costs, self.work, np.maximum))

    def loss(self, costs: cm.Costs) -> float:
        """The sum of squared log ratios of predicted to measured times."""
        return float(np.sum((self.log_predicted(costs) - self.log_measured) ** 2))


class _Pairs:
    """half_pairs() for the fit: the log of each pair's time ratio, predicted and measured."""

    def __init__(self, pairs: list[tuple[Point, Point]]):
        self.half = _Cases([h for h, _ in pairs])
        self.full = _Cases([f for _, f in pairs])

    def loss(self, costs: cm.Costs) -> float:
        """The sum of squared differences of log(half / float32), predicted and measured."""
        predicted = self.half.log_predicted(costs) - self.full.log_predicted(costs)
        measured = self.half.log_measured - self.full.log_measured
        return float(np.sum((predicted - measured) ** 2))


def log_error(costs: cm.Costs, pts: list[Point]) -> float:
    """The sum of squared log ratios of predicted to measured times."""
    return _Cases(pts).loss(costs)


def _search(
    costs: cm.Costs, names: tuple[str, ...], loss: Callable[[cm.Costs], float], rounds: int = 5000
) -> cm.Costs:
    """Coordinate search in log space: each name in turn, steps halving when none helps.

    It stops when a step is below a factor of e^0.001; ``rounds`` only guards the loop.
    """
    step = 1.0  # factor e^step per move
    best_loss = loss(costs)
    for _ in range(rounds):
        moved = False
        for name in names:
            for sign in (1.0, -1.0):
                value = getattr(costs, name) * math.exp(sign * step)
                if name in ("nic_efficiency", "stage_serial") and value > 1.0:
                    continue  # fractions
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


def fit(pts: list[Point], timeline: dict[str, float] | None = None) -> cm.Costs:
    """Fits the costs on measured points (Note [Cost model]).

    First every cost but the half-precision and staged ones, on the float32 rows of the
    pipelined algorithms; then the half-precision two on the bf16/fp16 rows, each against its
    float32 twin (half_pairs; Note [Cost model of half precision]); then the staged two on
    the float32 rows of the tree and halving/doubling (Note [Staged algorithms]). Without
    such rows they stay at the float32 rates per byte (unmeasured), or at 0.

    Args:
        pts: The measured points, of one run or several (each point's fastest run counts).
        timeline: The costs to take as read instead of reading them off the points'
            timelines (timeline_costs).

    Raises:
        ValueError: No smddp rows of float32 to fit the model on.
    """
    measured = [p for p in fastest(pts) if p.dtype == "float32"]
    smddp = [p for p in measured if p.algorithm not in ("flat_ring", *cm.STAGED)]
    if not smddp:
        raise ValueError("no smddp rows of float32 to fit the model on")
    read = timeline_costs(measured) if timeline is None else timeline
    cases = _Cases(smddp)
    start = dataclasses.replace(cm.Costs(), **read)
    # The max() of the NIC and CPU terms makes the loss kinked: a coordinate search from one
    # start can stop on a ridge, so it starts from a small grid and keeps the best.
    fitted = []
    for eta, net, shm in itertools.product((0.7, 0.85, 0.95), (2e-10, 1e-9), (0.5, 1.0, 2.0)):
        trial = dataclasses.replace(
            start,
            nic_efficiency=eta,
            net_cpu=net,
            shaper_cpu=net / 2,
            shm_reduce_cpu=start.shm_reduce_cpu * shm,
        )
        trial = _search(trial, FITTED_END_TO_END, cases.loss)
        fitted.append((cases.loss(trial), trial))
    costs = min(fitted, key=lambda x: x[0])[1]
    rings = [p for p in measured if p.algorithm == "flat_ring" and modelled(p)]
    if rings:
        costs = _search(costs, ("flat_step",), _Cases(rings).loss)
    costs = dataclasses.replace(
        costs, half_reduce_cpu=costs.reduce_cpu, half_shm_reduce_cpu=costs.shm_reduce_cpu
    )
    pairs = half_pairs(pts)
    if pairs:
        costs = _search(costs, FITTED_HALF, _Pairs(pairs).loss)
    return fit_staged(costs, measured)


def fit_staged(costs: cm.Costs, pts: list[Point]) -> cm.Costs:
    """``costs`` with FITTED_STAGED fitted on the float32 rows of the staged algorithms in ``pts``.

    The others are held (Note [Staged algorithms] in cost_model.py); without such rows
    ``costs`` is returned as it is.
    """
    staged = [p for p in pts if p.algorithm in cm.STAGED and p.dtype == "float32"]
    if not staged:
        return costs
    # Both start inside their range: the search moves them by factors, never from 0.
    costs = dataclasses.replace(costs, stage_serial=0.5, stage_wake=max(costs.wake, 1e-5))
    return _search(costs, FITTED_STAGED, _Cases(staged).loss)


# --- reports -------------------------------------------------------------------------------


def errors(costs: cm.Costs, pts: list[Point]) -> list[tuple[Point, float, float]]:
    """Each modelled point with its predicted seconds and relative error (pred / meas - 1)."""
    out = []
    for p in pts:
        if modelled(p):
            t = cm.seconds(costs, p.work())
            out.append((p, t, t / p.seconds - 1))
    return out


# Latencies the fit drove below this are not resolved by the runs: other terms explain the
# times, and the value says nothing about the real latency (predictions need --predict-latency).
RESOLUTION = 1e-6


def unresolved(costs: cm.Costs) -> list[str]:
    """The latency costs a fit left below RESOLUTION seconds.

    Args:
        costs: Fitted costs.

    Returns:
        The names of those of alpha, wake, step, flat_step, flow_latency and message below
        RESOLUTION: other terms explained the measured times, so their values mean nothing.
    """
    names = ("alpha", "wake", "step", "flat_step", "flow_latency", "message")
    return [n for n in names if getattr(costs, n) < RESOLUTION]
