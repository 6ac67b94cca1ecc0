"""A latency-bandwidth cost model of collectives between hosts; the planner prices with it.

Its costs are fitted on ``bench multihost`` rows by the benchmarks of a checkout
(``benchmarks/cost_model_fit.py``, ``benchmarks/cost_model_report.py``):

    python -m benchmarks multihost --fit tests/data/multihost/*.json \
        [--predict-rate 100gbit --predict-nics 4 --predict-ranks 8] [--plot FILE.png]

which fits per-layer costs (the NIC, the CPU's work per byte and per message, the reduction,
the shared-memory steps) on measured rows, prints its error on every measured point, and
predicts time and busbw of the full mesh, a ring, recursive halving/doubling and a tree
for 8 to 1024 hosts, with the algorithm it would pick at each scale and size.
Note [Cost model] says what it models and what it leaves out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

# Note [Cost model of half precision] is in cost_model_dtypes.py.
from torch_sagemaker.planner.cost_model_dtypes import ACCUMULATE_BYTES, element_bytes, wire_bytes

# Note [Cost model]
# A collective of S bytes (nccl-tests' S) on H hosts of L ranks (N = HL) costs, per rank:
#
#   T = alpha + latency steps + flow latency + max(NIC time, overlapped CPU work / CPU share)
#       + serial CPU work
#
# - NIC time: the bytes the busiest NIC sends (k (H-1)/H S for the hierarchical algorithms,
#   k = 2 for all_reduce, 1 otherwise; a flat ring over all N ranks sends k (N-1)/N S) at
#   nic_efficiency times its rate. Both directions are shaped alike, so one term holds both.
#   An exchange that waits on F flows per NIC direction at once (the mesh: H-1; a ring: 1)
#   takes 1 + flow_skew (F-1) times as long: the flows share the link unevenly, so some
#   parts arrive late, and an all_reduce's second half, or the call's end, waits for the
#   last (docs/log/multi_node.md, "Mesh or ring": a 4x1 mesh all_reduce's ranks finished their
#   reductions between 243 and 406 ms). Linear in F is the simplest growth that the 4- and
#   8-host rows fit; later runs on 16, 32 and 48 hosts (the mesh's rows not in the fit)
#   agree with it roughly, and beyond 48 hosts nothing was measured.
# - CPU work, in core-seconds: every byte a rank sends or receives over TCP (the kernel's
#   copies and, on the simulated hosts, the virtual cable's shaping and bridging), every
#   message (system calls, headers, polling), every byte a reduction reads, every byte of
#   the shared-memory reduce-scatter's inputs, every byte copied; bf16 and fp16 bytes at
#   their own rates where they are summed (Note [Cost model of half precision]). It runs on
#   the rank's
#   share of the cores: min(1, cores / ranks on the machine). On the simulated hosts every
#   rank of every host shares the one machine's cores, which is why 4x1 and 2x2 are slower
#   than the NIC allows while 2x1 is not; on real hosts only a host's own ranks share.
# - Overlap, as comm_hier.cpp does it (Note [Pipelined exchanges]): the network exchange,
#   the chunk reductions, the shared-memory reduce-scatter, an all_gather's copy of its own
#   part and the shared-memory all-gather (Note [Local all-gather during the exchange]) run
#   together, so their time is the larger of the NIC's and the CPU's. What follows the
#   exchange is serial: the shared-memory all-gather of each part's last message, which
#   cannot start before it arrived (all of it when a part is one message), and gloo's copy
#   of its own part, which it makes first.
# - Latency: alpha per call (entering, leaving, the ranks' skew after the barrier); wake
#   per sequential wait (the call's, and one per step) times the oversubscription, ranks per
#   core minus one (a rank that waits for a message, once woken, waits again for a core:
#   only on an oversubscribed machine); and, for a ring, recursive halving/doubling or a
#   tree, one step latency per sequential step (gloo's flat ring has its own, flat_step).
#   The mesh has no steps: all its messages are posted at once. Its per-peer cost is CPU
#   work per message, which grows with H, and flow_latency per flow beyond one that the
#   exchange waits on (F as for the flow skew): each flow's own start, its first window and
#   its turn at the ports it shares with the others, costs latency that no byte explains.
#   Without it the fit had to trade alpha between the algorithms: at 1 MiB it made every
#   ring point 10-24% slow and the mesh's up to 24% fast (docs/cost_model.md).
# - The simulated cables pass a burst (their token buckets' size) above the rate when idle:
#   the NIC time counts only the bytes beyond it (Cluster.burst; 0 for a real NIC).
#
# Fitting: the reduction's and the copies' costs come straight from the timeline phases
# (busy time times the CPU share, over the bytes). The shared-memory reduce-scatter's is read
# there too, but its phases' busy time includes waiting for the host's other ranks, so the
# fit tries it at 0.5, 1 and 2 times that reading (among its starts) and keeps the best. The
# NIC efficiency, the CPU cost per network byte and per message, alpha, wake, the flow
# skew and the step latency are fitted on the smddp rows' end-to-end times in float32, mesh
# and ring, shaped and unshaped cables together (least squares of the log ratio, a
# coordinate search from a small grid of starts, each run until its step is below 0.1%).
# The unshaped rows (--rate unlimited), where the CPU is the bound, are what resolve the
# CPU per TCP byte; with shaped cables the NIC hides it. The bf16/fp16 rates are fitted
# last, on the half-precision rows against the float32 rows of the same jobs (Note [Cost
# model of half precision]). gloo's flat_step is fitted on its float32 all_reduce rows on
# shaped cables (gloo's reduce_scatter and all_gather are not modelled: the first sends
# twice the bytes, as the wire counters show, and both are far from a ring's time; nor is
# gloo where the CPU bounds, whose per-byte costs are not smddp's). Each row says which
# algorithm ran (the bench's ``algorithm``); with several runs, each point's fastest run
# counts: the machine's other work only adds time; runs on other simulated networks
# (congestion control, switch queue) are points of their own. A latency the fit drives to
# nothing is not resolved by the runs (benchmarks/cost_model_fit.py:unresolved(): other
# terms explained the times), and predictions take it from --predict-latency /
# --predict-message instead.
#
# What it leaves out: incast and the switch beyond the flow skew and latency (H-1 senders
# into one port at once; the simulated switch has deep queues and dropped nothing up to 8
# hosts, but thousands of packets per case for the 32-host mesh; at 8 hosts and 1 MiB the
# mesh's ranks ended 8-29 ms into a call the ring ends in 9), stragglers and
# jitter at scale (the slowest of 1024 hosts sets the pace), congestion in a real fabric, several
# NICs being one (it takes nics x rate as one pipe), TCP's slow start after idle, the
# mesh's per-peer state (a socket and a poll entry per peer: it counts per-message work,
# not per-peer work), and pipeline fill in rings and trees. Its latency terms are fitted
# on one overloaded 2-core machine, where the scheduler, not the wire, sets them; its CPU
# costs are that machine's kernel path through virtual cables (Note [Shaped cables cost
# CPU]). Predictions for other hosts can override both (--predict-latency,
# --predict-message, --predict-cpu).

# Note [Shaped cables cost CPU]
# On the simulated hosts a shaped cable is a token-bucket filter on a veth pair, run by the
# kernel on the machine's own cores: every byte through it costs CPU that an unshaped cable
# does not ask, and a real NIC does not ask of the host at all. Bare TCP streams spent
# 1.5-1.7 times the CPU per byte on 4 shaped hosts that they spent on 2 unshaped ones
# (docs/log/*_2026-11-29). While no shaped row was CPU-bound the fit could not tell the two
# apart and took one rate for both; on 32 hosts of one rank at 1 Gbit/s the whole machine
# moves 4 GB/s through its shapers, and there the ring's 4 and 16 MiB calls took 1.19-1.45
# times that model's time (2026-11-30 rounds, BBR, 2 MiB switch queues). So shaper_cpu is
# the CPU per TCP byte a shaped cable adds to net_cpu (Cluster.shaper), fitted with the
# other end-to-end costs once those rounds' ring rows joined the recorded runs: 1.52 times
# net_cpu in all, the bare streams' ratio, found from the collectives' times alone. The
# ring is then within 0.81-1.14 of those rows, where it was 0.69-1.21, and stage_serial fell
# from 0.70 to 0.37: the staged rows' unexplained time had been the shapers' in part.
# Predictions for real hosts (Cluster.shaper False) do not pay it.

CHUNK_BYTES = 512 * 1024  # SMDDP_NET_CHUNK_BYTES: one network message
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
ALGORITHMS = ("mesh", "ring", "doubling", "tree", "flat_ring")
# Note [Staged algorithms]
# The tree and recursive halving/doubling run in rounds, each of which starts when the one before it
# ended (net_tree.cpp, net_halving_doubling.cpp): a round's bytes do not exist before the previous
# round's reduction made them. The mesh and the ring are pipelined: a ring step forwards each chunk
# as it is reduced, and the mesh posts everything at once. On the simulated hosts, where every rank
# shares the machine's 2 cores, the staged algorithms' measured times from 1 MiB are the model's NIC
# time plus its CPU time, not their larger: on 16 and 32 hosts of one rank at 1 Gbit/s, (measured -
# latency - larger) / smaller was 0.9-1.1 for the tree and halving/doubling from 1 MiB to 4 MiB,
# where the ring was within 0.2 of 0 on 16 hosts (docs/log/multi_node.md, "16 and 32 hosts"). In a
# round every rank sends and receives at once and then reduces, and what the CPU does at a round's
# start and end waits for a core that every other rank wants too. stage_serial is that fraction
# (0.37 fitted, 0.70 before Note [Shaped cables cost CPU]; 0 for the pipelined algorithms), and
# stage_wake each round's wait for a core, per round and per squared unit of oversubscription (ranks
# per core beyond one): 0.012 ms, like wake nothing on hosts with a core per rank. The wait grows
# with the square: every rank of a round waits for its partner, which waits behind the other ranks
# of its core, so a rank per core more is both one more to wait behind and one more waiting. Fitted
# with the oversubscription itself instead, the staged rows came out up to 40% slow on 16 hosts and
# 33% fast on 32; squared, within 0.82-1.26, with 2.8 times less squared log error
# (docs/log/multi_node.md, "16 and 32 hosts"). Both are fitted last, on the staged rows only, the
# other costs held (benchmarks/cost_model_fit.py: fit_staged). On hosts with a core per rank nothing
# measured says what stage_serial is, and predictions for such hosts keep the fitted one.
STAGED = ("doubling", "tree")


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
        reduce_cpu: Core-seconds per fp32 byte a reduction reads.
        shm_reduce_cpu: Core-seconds per fp32 input byte of the shared-memory reduce-scatter.
        half_reduce_cpu: Core-seconds per bf16/fp16 byte a reduction reads (each element
            widened to fp32; Note [Cost model of half precision]).
        half_shm_reduce_cpu: Core-seconds per bf16/fp16 input byte of the shared-memory
            reduce-scatter (summed in fp32; the partials leave rounded once).
        copy_cpu: Core-seconds per byte copied (the shared-memory all-gather's output,
            an all_gather's own part).
        flow_skew: The NIC time's growth per flow beyond one that an exchange waits on
            (the mesh's H-1 flows per NIC share it unevenly; Note [Cost model]).
        flow_latency: Seconds per call per flow beyond one that an exchange waits on (each
            flow's own start; Note [Cost model]).
        stage_serial: The fraction of the smaller of a staged algorithm's NIC and CPU times
            that does not overlap the larger (Note [Staged algorithms]): 0 when they overlap
            as the pipelined ones' do, 1 when they add.
        stage_wake: Seconds per round of a staged algorithm per squared unit of
            oversubscription, beyond wake: a round waits for its partner's last byte, and so
            for that rank's turn at a core (Note [Staged algorithms]; none on real hosts).
        shaper_cpu: Core-seconds per byte a rank sends or receives over TCP, beyond net_cpu,
            where a software shaper paces its cable (Cluster.shaper; Note [Shaped cables
            cost CPU]).
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
    half_reduce_cpu: float = 3e-10
    half_shm_reduce_cpu: float = 1e-9
    copy_cpu: float = 3e-10
    flow_skew: float = 0.02
    flow_latency: float = 1e-4
    stage_serial: float = 0.0
    stage_wake: float = 0.0
    shaper_cpu: float = 0.0


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
        shaper: Whether a software shaper on these cores paces each NIC (the simulated
            cables at a rate; Note [Shaped cables cost CPU]); False for a real NIC.
    """

    hosts: int
    ranks: int
    nic_rate: float
    cores: float
    machine_ranks: int = 0
    burst: float = 0.0
    shaper: bool = False

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
    k (N-1)/N S. smddp's tree (all_reduce only; Note [A tree for small all-reduces] in
    net_tree.cpp) sends the rail's whole data in each of its rounds, S per host and round,
    log2 P rounds (P the largest power of two <= H); off powers of two the fold adds S into
    a core before them and S out after, and since each stage starts when the one before
    ended, both count: the NIC time of the stages one after another (the mesh's S with two
    hosts).
    """
    world = hosts * ranks
    k = nic_factor(op)
    if algorithm == "flat_ring":
        return k * (world - 1) / world * size
    if algorithm == "tree":
        rounds, fold = tree_rounds(hosts)
        return (rounds + 2 * fold) * float(size)
    return k * (hosts - 1) / hosts * size


def tree_rounds(hosts: int) -> tuple[int, int]:
    """The shape of smddp's tree on ``hosts`` hosts.

    Returns:
        Its doubling rounds, log2 P (P the largest power of two <= H), and 1 where H is not a
        power of two (the fold: an extra host's data goes to its core before the rounds and
        its result back after them), else 0.
    """
    cores = 1 << (max(1, hosts).bit_length() - 1)
    return cores.bit_length() - 1, int(cores != hosts)


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
    reduced: float  # fp32 bytes its reductions read
    reduced_half: float  # bf16/fp16 bytes its reductions read
    shm_input: float  # its shared-memory reduce-scatter's fp32 input bytes
    shm_input_half: float  # the same, bf16/fp16 (Note [Cost model of half precision])
    copied: float  # bytes it copies before or after the exchange (serial)
    copied_during: float  # bytes it copies during the exchange (overlapped)
    flows: int  # flows one rank's exchange waits on per NIC direction (the mesh: H-1)
    staged: float  # 1 for the tree and halving/doubling (Note [Staged algorithms]), else 0
    shaper: float  # 1 where a software shaper paces the cables (Cluster.shaper), else 0
    share: float  # its fraction of a core
    oversubscription: float  # Cluster.oversubscription


def work(
    cluster: Cluster,
    op: str,
    size: int,
    algorithm: str = "mesh",
    dtype: str = "float32",
    wire: str | None = None,
) -> Work:
    """What one call of ``op`` on ``size`` bytes asks of each rank (Note [Cost model]).

    Args:
        cluster: Hosts, ranks, NIC rate and CPU share.
        op: One of OPS.
        size: nccl-tests' S in bytes (of ``dtype``).
        algorithm: ``mesh`` (smddp's), ``ring`` (a ring per rail between hosts, shared
            memory inside), ``doubling`` (recursive halving and doubling per rail),
            ``tree`` (smddp's recursive doubling of each rail's data; all_reduce only) or
            ``flat_ring`` (gloo's: one ring over all ranks, TCP inside a host too).
        dtype: The tensor's dtype (Note [Cost model of half precision]).
        wire: The type reductions send partial sums in, as for wire_bytes().

    Raises:
        ValueError: An unknown algorithm or dtype, a tree for another op than all_reduce,
            or a wire type other than the tensor's own or float32.
    """
    h, local = cluster.hosts, cluster.ranks
    world = h * local
    part = size / world
    k = nic_factor(op)
    reduces = op != "all_gather_into_tensor"
    esz = element_bytes(dtype)
    half = esz < ACCUMULATE_BYTES
    # Wire bytes per byte of the tensor; gloo sends the tensor as it is.
    on_wire = 1.0 if algorithm == "flat_ring" else wire_bytes(op, dtype, wire) / esz
    # An all_gather's own part is copied into the output in slices between the exchange's
    # rounds (Note [Own part during the exchange] in comm_hier.cpp); gloo copies it first.
    own = part if op == "all_gather_into_tensor" else 0.0
    copied = own if algorithm == "flat_ring" else 0.0
    copied_during = 0.0 if algorithm == "flat_ring" else own
    flows = h - 1 if algorithm == "mesh" else 1
    looped = 0.0
    flat_steps = 0
    # A reduction reads bytes that arrived (`incoming`) and the rank's own partial (`mine`),
    # both counted in the tensor's bytes here and priced by type below.
    if algorithm == "flat_ring":
        flat_steps = k * (world - 1)
        steps = 0
        # Each step a rank sends a part to the next rank and receives one from the previous,
        # over TCP even inside a host: the busiest rank of a host has one neighbour on
        # another host and one over loopback, which copies but is neither shaped nor bridged.
        moved = (2.0 if local == 1 else 1.0) * flat_steps * part
        looped = 0.0 if local == 1 else flat_steps * part
        messages = 2.0 * flat_steps * _chunks(part)
        incoming = mine = (world - 1) * part
    elif algorithm == "mesh":
        steps = 0
        moved = 2.0 * k * (h - 1) * part
        messages = 2.0 * k * (h - 1) * _chunks(part * on_wire)
        incoming, mine = (h - 1) * part, part
    elif algorithm == "ring":
        steps = k * (h - 1)
        moved = 2.0 * k * (h - 1) * part
        messages = 2.0 * steps * _chunks(part * on_wire)
        incoming = mine = (h - 1) * part  # each step: the running sum that came, and mine
    elif algorithm == "doubling":
        # Recursive halving (reduce-scatter) and doubling (all-gather) between hosts:
        # log2 H steps each, the message doubling from S/N; the bytes of a ring.
        rounds = max(1, math.ceil(math.log2(h)))
        steps = k * rounds
        moved = 2.0 * k * (h - 1) * part
        messages = 2.0 * k * sum(_chunks(part * 2**i * on_wire) for i in range(rounds))
        incoming = mine = (h - 1) * part
    elif algorithm == "tree":
        if op != "all_reduce":
            raise ValueError("a tree is modelled for all_reduce only")
        # smddp's tree (net_tree.cpp): the rank's rail data D crosses whole in every round,
        # one peer a round; a core with an extra host also receives D before the rounds (the
        # fold) and sends D after them. Each exchange adds what arrived to its own value (in
        # the wire type: every sum is rounded where it is stored), and the fold's result
        # goes back unreduced.
        rail = size / local
        rounds, fold = tree_rounds(h)
        steps = rounds + 2 * fold
        moved = 2.0 * (rounds + fold) * rail
        messages = 2.0 * (rounds + fold) * _chunks(rail * on_wire)
        incoming = mine = (rounds + fold) * rail
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    moved *= on_wire
    reduced = reduced_half = shm = shm_half = 0.0
    if reduces:
        # Note [Cost model of half precision]: what arrived is in the wire's type; my partial
        # is the input itself with one rank per host (and nothing to widen), else fp32 sums.
        arrived = incoming * on_wire
        if esz * on_wire < ACCUMULATE_BYTES:
            reduced_half += arrived
        else:
            reduced += arrived
        if algorithm == "flat_ring" or (local == 1 and on_wire == 1.0):
            if half:
                reduced_half += mine
            else:
                reduced += mine
        else:
            reduced += mine * ACCUMULATE_BYTES / esz
            # The shared-memory reduce-scatter reads S per rank (with one rank, it widens it).
            if half:
                shm_half = size
            else:
                shm = size
    if local > 1 and op != "reduce_scatter_tensor" and algorithm != "flat_ring":
        # The shared-memory all-gather: each rank copies the others' parts, beside the
        # exchange but for the pieces of each of its H parts' last message.
        gathered = (local - 1) / local * size
        after = min(gathered, (local - 1) * h * min(part, CHUNK_BYTES / on_wire))
        copied += after
        copied_during += gathered - after
    return Work(
        nic_bytes=nic_bytes(algorithm, op, h, local, size) * on_wire,
        nic_rate=cluster.nic_rate,
        burst=cluster.burst,
        steps=steps,
        flat_steps=flat_steps,
        moved=moved,
        looped=looped,
        messages=messages,
        reduced=reduced,
        reduced_half=reduced_half,
        shm_input=shm,
        shm_input_half=shm_half,
        copied=copied,
        copied_during=copied_during,
        flows=flows,
        staged=1.0 if algorithm in STAGED else 0.0,
        shaper=1.0 if cluster.shaper else 0.0,
        share=cluster.cpu_share,
        oversubscription=cluster.oversubscription,
    )


class Parts(NamedTuple):
    """A call's time in its parts (Note [Cost model]).

    latency + max(wire, cpu) + unoverlapped + serial.
    """

    latency: float  # alpha, the waits for a core, the steps, the mesh's flow latency
    wire: float  # the busiest NIC's time
    cpu: dict[str, float]  # the CPU work beside the exchange over the CPU share, by what it does
    unoverlapped: float  # what of the smaller of wire and cpu the larger did not hide
    serial: float  # the copies before or after the exchange, over the CPU share


def parts(costs: Costs, w: Work, maximum: Callable = max) -> Parts:
    """The parts of the time of a call that asks ``w``, at ``costs``.

    Args:
        costs: The costs.
        w: What the call asks (work()); its fields may be arrays of many calls.
        maximum: The larger of two values: ``max``, or ``numpy.maximum`` for arrays.
    """
    wire = maximum(0.0, w.nic_bytes - w.burst) / (costs.nic_efficiency * w.nic_rate)
    wire *= 1.0 + costs.flow_skew * (w.flows - 1)
    cpu = {
        "TCP bytes": (costs.net_cpu + costs.shaper_cpu * w.shaper) * w.moved / w.share,
        "messages": costs.message * w.messages / w.share,
        "reduction": (costs.reduce_cpu * w.reduced + costs.half_reduce_cpu * w.reduced_half)
        / w.share,
        "shared-memory reduce-scatter": (
            costs.shm_reduce_cpu * w.shm_input + costs.half_shm_reduce_cpu * w.shm_input_half
        )
        / w.share,
        "copies": costs.copy_cpu * (w.looped + w.copied_during) / w.share,
    }
    # Every sequential wait (the call's, and one per step) may wait again for a core.
    waits = 1 + w.steps + w.flat_steps
    latency = costs.alpha + costs.wake * w.oversubscription * waits
    latency += w.steps * costs.step + w.flat_steps * costs.flat_step
    latency += costs.flow_latency * (w.flows - 1)
    latency += costs.stage_wake * w.staged * w.oversubscription**2 * w.steps
    busy = sum(cpu.values())
    smaller = wire + busy - maximum(wire, busy)
    unoverlapped = costs.stage_serial * w.staged * smaller
    return Parts(latency, wire, cpu, unoverlapped, costs.copy_cpu * w.copied / w.share)


def seconds(costs: Costs, w: Work, maximum: Callable = max) -> float:
    """The time of a call that asks ``w``, at ``costs``; arguments as for parts()."""
    p = parts(costs, w, maximum)
    return p.latency + maximum(p.wire, sum(p.cpu.values())) + p.unoverlapped + p.serial


def bound(costs: Costs, w: Work) -> str:
    """What sets the time of a call that asks ``w``: its largest part.

    Returns:
        The largest of the NIC's time (``NIC``), the latency (``latency``) and the CPU's
        work, overlapped and serial, which names the largest of Parts.cpu and its share
        (``CPU (copies 40%)``; serial copies count as copies).
    """
    p = parts(costs, w)
    cpu = dict(p.cpu)
    cpu["copies"] += p.serial
    total = sum(cpu.values()) + p.unoverlapped
    name, most = max(cpu.items(), key=lambda x: x[1])
    if total >= max(p.wire, p.latency):
        return f"CPU ({name} {most / total:.0%})"
    return "NIC" if p.wire >= p.latency else "latency"


def predict(
    costs: Costs,
    cluster: Cluster,
    op: str,
    size: int,
    algorithm: str = "mesh",
    dtype: str = "float32",
    wire: str | None = None,
) -> float:
    """Seconds for one call of ``op`` on ``size`` bytes; arguments as for work()."""
    return seconds(costs, work(cluster, op, size, algorithm, dtype, wire))


def algorithms_for(op: str) -> tuple[str, ...]:
    """The hierarchical algorithms the model compares for ``op`` (a tree only for all_reduce)."""
    both = ("mesh", "ring", "doubling")
    return (*both, "tree") if op == "all_reduce" else both


def best(
    costs: Costs,
    cluster: Cluster,
    op: str,
    size: int,
    dtype: str = "float32",
    wire: str | None = None,
) -> tuple[str, float]:
    """The algorithm with the lowest predicted time, and that time; arguments as for work()."""
    return min(
        ((a, predict(costs, cluster, op, size, a, dtype, wire)) for a in algorithms_for(op)),
        key=lambda x: x[1],
    )
