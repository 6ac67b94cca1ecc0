"""The multihost cost model (torch_sagemaker/planner/cost_model.py): its formulas on cases
worked by hand, its fit on data it generated itself, and its error on the recorded runs."""

import dataclasses
import glob
import itertools
import json
import math
import os
import re

import pytest

from benchmarks import cost_model_fit as cf
from benchmarks import cost_model_report as report
from torch_sagemaker.planner import cost_model as cm
from torch_sagemaker.planner.auto_rule import GROUP_BYTES, AutoBySize, group_algorithm

MIB = 1 << 20
DATA = os.path.join(os.path.dirname(__file__), "..", "data", "multihost")

# Only the NIC: no latency, no CPU cost, half the rate is payload.
WIRE_ONLY = cm.Costs(
    alpha=0.0,
    wake=0.0,
    step=0.0,
    flat_step=0.0,
    nic_efficiency=0.5,
    net_cpu=0.0,
    message=0.0,
    reduce_cpu=0.0,
    shm_reduce_cpu=0.0,
    half_reduce_cpu=0.0,
    half_shm_reduce_cpu=0.0,
    copy_cpu=0.0,
    flow_skew=0.0,
    flow_latency=0.0,
)


@pytest.mark.parametrize("hosts", [2, 4, 8, 1024])
def test_nic_bytes_are_the_textbook_ones(hosts):
    s = 64 * MIB
    # A ring or a full mesh between hosts sends 2(H-1)/H S per NIC for all_reduce and
    # (H-1)/H S for all_gather and reduce_scatter.
    for algorithm in ("mesh", "ring"):
        assert cm.nic_bytes(algorithm, "all_reduce", hosts, 8, s) == 2 * (hosts - 1) / hosts * s
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            assert cm.nic_bytes(algorithm, op, hosts, 8, s) == (hosts - 1) / hosts * s
    # One ring over all N ranks crosses each host's boundary once per step.
    n = hosts * 8
    assert cm.nic_bytes("flat_ring", "all_reduce", hosts, 8, s) == 2 * (n - 1) / n * s
    # smddp's tree sends S in each of its log2 H rounds (the mesh's S on two hosts).
    assert cm.nic_bytes("tree", "all_reduce", hosts, 8, s) == math.log2(hosts) * s


@pytest.mark.parametrize(
    "hosts, rounds, fold", [(2, 1, 0), (3, 1, 1), (4, 2, 0), (5, 2, 1), (7, 2, 1), (1024, 10, 0)]
)
def test_the_tree_folds_hosts_beyond_a_power_of_two(hosts, rounds, fold):
    assert cm.tree_rounds(hosts) == (rounds, fold)
    # The fold's two hops, S into a core and S out, each its own stage on the NIC and in
    # the latency steps (a stage starts when the one before ended).
    s = MIB
    assert cm.nic_bytes("tree", "all_reduce", hosts, 1, s) == (rounds + 2 * fold) * s
    w = cm.work(cm.Cluster(hosts, 1, 1e9, 1), "all_reduce", s, "tree")
    assert w.steps == rounds + 2 * fold and w.flows == 1


def test_busbw_is_nccl_tests():
    assert cm.busbw("all_reduce", 4, 100, 1.0) == 100 * 2 * 3 / 4
    assert cm.busbw("all_gather_into_tensor", 4, 100, 2.0) == 50 * 3 / 4


def test_half_precision_crosses_hosts_in_two_byte_elements():
    # Note [Cost model of half precision]: n elements of bf16 put 2n bytes on the wire per
    # k (H-1)/H, fp32 4n, and bf16 with SMDDP_NET_REDUCE_DTYPE=fp32 4n as well (its partial
    # sums cross in fp32); an all_gather moves the tensor's own bytes whatever the setting.
    n = 8 * MIB
    cluster = cm.Cluster(hosts=4, ranks=1, nic_rate=1e9, cores=4)
    for op, k in (("all_reduce", 2), ("reduce_scatter_tensor", 1), ("all_gather_into_tensor", 1)):
        bf16 = cm.predict(WIRE_ONLY, cluster, op, 2 * n, "ring", "bfloat16")
        assert bf16 == pytest.approx(k * 3 / 4 * 2 * n / 0.5e9), op
        fp32 = cm.predict(WIRE_ONLY, cluster, op, 4 * n, "ring", "float32")
        assert fp32 == pytest.approx(2 * bf16), op
        wide = cm.predict(WIRE_ONLY, cluster, op, 2 * n, "ring", "bfloat16", wire="float32")
        assert wide == pytest.approx(bf16 if op == "all_gather_into_tensor" else fp32), op
    # The messages are the wire's 512 KiB chunks: a 4 MiB bf16 part is 8, in fp32 16.
    two = cm.Cluster(hosts=2, ranks=1, nic_rate=1e9, cores=2)
    half = cm.work(two, "reduce_scatter_tensor", 8 * MIB, "mesh", "bfloat16")
    wide_msgs = cm.work(two, "reduce_scatter_tensor", 8 * MIB, "mesh", "bfloat16", "float32")
    assert (half.messages, wide_msgs.messages) == (2 * 8, 2 * 16)
    assert half.moved == 2 * 4 * MIB and wide_msgs.moved == 2 * 8 * MIB
    with pytest.raises(ValueError, match="float64"):
        cm.work(two, "all_reduce", MIB, "mesh", "float64")
    with pytest.raises(ValueError, match="bfloat16"):
        cm.work(two, "all_reduce", MIB, "mesh", "float32", wire="bfloat16")


def test_half_precision_reductions_are_priced_in_the_type_they_read():
    s = 16 * MIB
    # One rank per host: the input is the partial; both parts read are bf16 (S/2 each).
    one = cm.work(cm.Cluster(2, 1, 1e9, 2), "all_reduce", s, "mesh", "bfloat16")
    assert (one.reduced, one.reduced_half, one.shm_input, one.shm_input_half) == (0, s, 0, 0)
    # Two ranks per host: the shared-memory steps read S of bf16 and sum in fp32; the owner
    # reads the other host's bf16 part (S/4) and its own fp32 partial (S/4 of bf16 = S/2).
    two = cm.work(cm.Cluster(2, 2, 1e9, 4), "all_reduce", s, "mesh", "bfloat16")
    assert (two.reduced, two.reduced_half, two.shm_input, two.shm_input_half) == (
        s / 2,
        s / 4,
        0,
        s,
    )
    fp32 = cm.work(cm.Cluster(2, 2, 1e9, 4), "all_reduce", s, "mesh", "float32")
    assert (fp32.reduced, fp32.reduced_half, fp32.shm_input, fp32.shm_input_half) == (
        s / 2,
        0,
        s,
        0,
    )
    # fp32 on the wire with one rank per host: the input is widened first (S of bf16), and
    # both partials read are fp32 (S each).
    wide = cm.work(cm.Cluster(2, 1, 1e9, 2), "all_reduce", s, "mesh", "bfloat16", "float32")
    assert (wide.reduced, wide.reduced_half, wide.shm_input_half) == (2 * s, 0, s)
    # The rates apply per type: a bf16 reduction's bytes cost half_reduce_cpu only.
    costs = dataclasses.replace(WIRE_ONLY, half_reduce_cpu=1e-9)
    unshaped = cm.Cluster(2, 1, math.inf, 2)
    assert cm.predict(costs, unshaped, "all_reduce", s, "mesh", "bfloat16") == pytest.approx(
        s * 1e-9
    )
    assert cm.predict(costs, unshaped, "all_reduce", s, "mesh", "float32") == 0.0
    assert cm.bound(costs, cm.work(unshaped, "all_reduce", s, "mesh", "bfloat16")) == (
        "CPU (reduction 100%)"
    )


def test_a_nic_bound_call_takes_its_bytes_at_the_payload_rate():
    cluster = cm.Cluster(hosts=4, ranks=1, nic_rate=1e9, cores=4)
    t = cm.predict(WIRE_ONLY, cluster, "all_reduce", 64 * MIB, "mesh")
    assert t == pytest.approx(2 * 3 / 4 * 64 * MIB / 0.5e9)
    # Two ranks per host share the NIC: the same bytes per NIC, the same time.
    two = dataclasses.replace(cluster, ranks=2, cores=8)
    assert cm.predict(WIRE_ONLY, two, "all_reduce", 64 * MIB, "mesh") == pytest.approx(t)


def test_cpu_work_runs_on_the_ranks_share_of_the_cores():
    costs = dataclasses.replace(WIRE_ONLY, net_cpu=1e-9)
    fast_nic = 1e15
    s = 8 * MIB
    # 2x1 mesh all_reduce: a rank sends and receives k (H-1) S/N = S/2 twice each: 2 S bytes.
    own = cm.Cluster(2, 1, fast_nic, cores=2, machine_ranks=2)
    assert cm.predict(costs, own, "all_reduce", s, "mesh") == pytest.approx(2 * s * 1e-9)
    # Four ranks on two cores: half a core each, twice the time.
    shared = cm.Cluster(2, 1, fast_nic, cores=2, machine_ranks=4)
    assert cm.predict(costs, shared, "all_reduce", s, "mesh") == pytest.approx(4 * s * 1e-9)


def test_the_overlapped_phases_cost_their_maximum_and_the_serial_ones_add():
    s = 64 * MIB
    cluster = cm.Cluster(2, 2, nic_rate=1e9, cores=4)
    wire = 2 * 1 / 2 * s / 0.5e9
    # A shared-memory reduce-scatter slower than the wire hides it; the shared-memory
    # all-gather after the exchange adds (L-1)/L S of copies.
    costs = dataclasses.replace(WIRE_ONLY, shm_reduce_cpu=wire * 2 / s, copy_cpu=1e-9)
    t = cm.predict(costs, cluster, "all_reduce", s, "mesh")
    assert t == pytest.approx(2 * wire + 1e-9 * s / 2)
    assert wire < t


def test_the_mesh_waits_on_its_flows():
    costs = dataclasses.replace(WIRE_ONLY, flow_skew=0.1)
    s = 64 * MIB
    wire = 2 * 3 / 4 * s / 0.5e9
    cluster = cm.Cluster(4, 1, nic_rate=1e9, cores=4)
    # Each NIC carries the mesh's 3 flows at once, a ring's one: 1 + 0.1 (3 - 1).
    assert cm.predict(costs, cluster, "all_reduce", s, "mesh") == pytest.approx(1.2 * wire)
    assert cm.predict(costs, cluster, "all_reduce", s, "ring") == pytest.approx(wire)
    # Two hosts: the mesh is one flow per NIC.
    two = cm.Cluster(2, 1, nic_rate=1e9, cores=4)
    assert cm.predict(costs, two, "all_reduce", s, "mesh") == pytest.approx(2 * s / 2 / 0.5e9)


def test_each_flow_beyond_one_adds_its_latency_to_the_mesh():
    costs = dataclasses.replace(WIRE_ONLY, flow_latency=1e-3)
    s = MIB
    wire = 2 * 3 / 4 * s / 0.5e9
    cluster = cm.Cluster(4, 1, nic_rate=1e9, cores=4)
    # The mesh waits on 3 flows per NIC: 2 ms more; a ring's one flow, none.
    assert cm.predict(costs, cluster, "all_reduce", s, "mesh") == pytest.approx(wire + 2e-3)
    assert cm.predict(costs, cluster, "all_reduce", s, "ring") == pytest.approx(wire)


def test_an_all_gathers_own_part_is_copied_during_the_exchange():
    s = 64 * MIB
    cluster = cm.Cluster(4, 1, nic_rate=1e9, cores=4)
    wire = 3 / 4 * s / 0.5e9
    copy = wire / 2 / (s / 4)  # the own part's copy takes half the wire time
    costs = dataclasses.replace(WIRE_ONLY, copy_cpu=copy)
    for algorithm in ("mesh", "ring"):
        t = cm.predict(costs, cluster, "all_gather_into_tensor", s, algorithm)
        assert t == pytest.approx(wire), algorithm
    # gloo's flat ring copies it before the first step (it sends 3/4 S as well on 1 rank
    # per host).
    t = cm.predict(costs, cluster, "all_gather_into_tensor", s, "flat_ring")
    assert t == pytest.approx(1.5 * wire)


def test_the_shared_memory_all_gather_runs_beside_the_exchange():
    # Note [Local all-gather during the exchange]: 2 hosts of 2 ranks; each rank copies the
    # other local rank's parts ((L-1)/L S) beside the exchange, but for the pieces of its H
    # parts' last message, which wait for that message.
    cluster = cm.Cluster(2, 2, nic_rate=1e9, cores=4)
    s = 64 * MIB
    wire = 1 / 2 * s / 0.5e9
    copy = wire / 4 / (s / 2)  # the whole all-gather's copy takes a quarter of the wire time
    costs = dataclasses.replace(WIRE_ONLY, copy_cpu=copy)
    after = 1 * 2 * cm.CHUNK_BYTES  # (L-1) H messages' pieces
    t = cm.predict(costs, cluster, "all_gather_into_tensor", s, "mesh")
    assert t == pytest.approx(wire + copy * after)
    # With parts of one message (1 MiB: 256 KiB parts) the whole all-gather follows it.
    small = MIB
    t = cm.predict(costs, cluster, "all_gather_into_tensor", small, "mesh")
    assert t == pytest.approx(1 / 2 * small / 0.5e9 + copy * small / 2)


def test_rows_say_which_algorithm_ran():
    def row(backend, algorithm, seconds):
        r = {"layout": "4x1", "op": "all_reduce", "bytes": MIB, "backend": backend}
        r["seconds"] = seconds
        if algorithm:
            r["algorithm"] = algorithm
        return r

    run = {
        "rate_bits": 10**9,
        "rows": [
            row("smddp", "ring", 3.0),
            row("smddp-ring", "ring", 2.0),
            row("smddp-mesh", "mesh", 4.0),
            row("gloo", "flat_ring", 5.0),
            row("smddp-hd", "halving_doubling", 2.5),
        ],
    }
    pts = cf.points([run])
    # The backend's halving_doubling is the model's doubling.
    assert [p.algorithm for p in pts] == ["ring", "ring", "mesh", "flat_ring", "doubling"]
    # The default group's ring and a forced ring are runs of one point: the faster counts.
    merged = {p.algorithm: p.seconds for p in cf.fastest(pts)}
    assert merged == {"ring": 2.0, "mesh": 4.0, "flat_ring": 5.0, "doubling": 2.5}
    # Files written before rows recorded it: smddp ran the mesh, gloo a flat ring.
    old = cf.points([{"rate_bits": 10**9, "rows": [row("smddp", "", 1.0), row("gloo", "", 1.0)]}])
    assert [p.algorithm for p in old] == ["mesh", "flat_ring"]


def test_latency_steps_per_algorithm():
    costs = dataclasses.replace(WIRE_ONLY, step=1e-3, alpha=5e-3)
    cluster = cm.Cluster(8, 8, nic_rate=1e18, cores=8)
    # The mesh posts everything at once: alpha only.
    assert cm.predict(costs, cluster, "all_reduce", 1, "mesh") == pytest.approx(5e-3)
    # A ring: 2(H-1) steps for all_reduce, H-1 for the others.
    assert cm.predict(costs, cluster, "all_reduce", 1, "ring") == pytest.approx(5e-3 + 14e-3)
    assert cm.predict(costs, cluster, "all_gather_into_tensor", 1, "ring") == pytest.approx(
        5e-3 + 7e-3
    )
    # smddp's tree: log2 H rounds of the whole data (Note [A tree for small all-reduces]).
    assert cm.predict(costs, cluster, "all_reduce", 1, "tree") == pytest.approx(5e-3 + 3e-3)
    # gloo's flat ring: 2(N-1) steps over all 64 ranks, at its own step cost.
    flat = dataclasses.replace(costs, flat_step=1e-4)
    assert cm.predict(flat, cluster, "all_reduce", 1, "flat_ring") == pytest.approx(5e-3 + 126e-4)
    with pytest.raises(ValueError):
        cm.predict(costs, cluster, "all_gather_into_tensor", 1, "tree")


def test_messages_grow_with_hosts_in_a_mesh():
    costs = dataclasses.replace(WIRE_ONLY, message=1e-6)
    s = MIB  # below a chunk per peer: one message per peer and direction
    for hosts in (8, 1024):
        cluster = cm.Cluster(hosts, 1, nic_rate=1e18, cores=1)
        t = cm.predict(costs, cluster, "reduce_scatter_tensor", s, "mesh")
        assert t == pytest.approx(2 * (hosts - 1) * 1e-6)


def test_the_choice_follows_the_costs():
    costs = dataclasses.replace(WIRE_ONLY, alpha=1e-5, step=2e-5, message=5e-6)
    nic = 4 * 100e9 / 8
    # Few hosts: the mesh's one step wins; 1024 hosts and a small all_reduce: the tree's
    # log2 H steps cost less than halving/doubling's 2 log2 H and the mesh's 4 (H-1)
    # messages; at 1 MiB the tree's log2 H times the bytes already cost more.
    assert cm.best(costs, cm.Cluster(8, 8, nic, 8), "all_reduce", 64 * MIB)[0] == "mesh"
    assert cm.best(costs, cm.Cluster(1024, 8, nic, 8), "all_reduce", 64 * 1024)[0] == "tree"
    assert cm.best(costs, cm.Cluster(1024, 8, nic, 8), "all_reduce", MIB)[0] == "doubling"


def test_the_fit_recovers_the_costs_it_generated():
    truth = cm.Costs(
        alpha=2e-3,
        wake=1e-3,
        step=1e-3,
        nic_efficiency=0.8,
        net_cpu=1e-9,
        message=2e-5,
        reduce_cpu=2e-10,
        shm_reduce_cpu=8e-10,
        copy_cpu=5e-10,
    )
    pts = []
    for hosts, ranks in ((2, 1), (4, 1), (2, 2), (4, 2)):
        for op in cm.OPS:
            for size in (MIB, 16 * MIB, 64 * MIB):
                p = cf.Point(hosts, ranks, op, size, "smddp", 1.0, 2.5e8, 2)
                t = cm.predict(truth, p.cluster(), op, size, "mesh")
                pts.append(dataclasses.replace(p, seconds=t))
    # The timeline's costs are given; the fit finds the others.
    start = {"reduce_cpu": 2e-10, "shm_reduce_cpu": 8e-10, "copy_cpu": 5e-10}
    fitted = cf.fit(pts, timeline=start)
    for _, _, err in cf.errors(fitted, pts):
        assert abs(err) < 0.01
    assert fitted.nic_efficiency == pytest.approx(0.8, rel=0.05)


def test_the_fit_recovers_the_half_precision_rates_it_generated():
    # Rows made by the model at known costs, fp32 and bf16, on shaped and unshaped cables
    # (where the CPU is the bound), with bf16 rates per byte unlike fp32's: the fit must
    # find them from the bf16 rows against their fp32 twins, and bf16 must carry 2-byte
    # elements, or its rows would not fit.
    truth = cm.Costs(
        alpha=5e-4,
        wake=5e-5,
        step=1e-4,
        nic_efficiency=0.9,
        net_cpu=3e-10,
        message=1e-5,
        reduce_cpu=4e-11,
        shm_reduce_cpu=1e-10,
        half_reduce_cpu=1.2e-10,
        half_shm_reduce_cpu=2.5e-10,
        copy_cpu=1.5e-10,
        flow_skew=0.0,
        flow_latency=5e-4,
    )
    pts = []
    for (hosts, ranks), rate in itertools.product(((2, 1), (2, 2), (4, 2)), (2.5e8, math.inf)):
        for op, size, dtype in itertools.product(
            cm.OPS, (16 * MIB, 64 * MIB), ("float32", "bfloat16")
        ):
            p = cf.Point(hosts, ranks, op, size, "smddp", 1.0, rate, 2, ran="ring", dtype=dtype)
            pts.append(dataclasses.replace(p, seconds=cm.seconds(truth, p.work())))
    read = {"reduce_cpu": 4e-11, "shm_reduce_cpu": 1e-10, "copy_cpu": 1.5e-10}
    fitted = cf.fit(pts, timeline=read)
    assert fitted.half_reduce_cpu == pytest.approx(1.2e-10, rel=0.05)
    assert fitted.half_shm_reduce_cpu == pytest.approx(2.5e-10, rel=0.05)
    for p, _, err in cf.errors(fitted, pts):
        assert abs(err) < 0.01, (p, err)


def _recorded():
    runs = []
    for path in sorted(glob.glob(os.path.join(DATA, "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


@pytest.fixture(scope="module")
def recorded_fit():
    runs = _recorded()
    assert runs, f"no recorded runs in {DATA}"
    pts = cf.points(runs)
    return cf.fit(pts), cf.fastest(pts)


def test_the_model_is_within_its_bound_on_every_recorded_point(recorded_fit):
    costs, pts = recorded_fit
    rows = cf.errors(costs, pts)
    # Both of smddp's algorithms where they differ (4 and 8 hosts), and gloo's flat ring.
    ran = {(p.hosts, p.algorithm) for p, _, _ in rows}
    assert {(4, "mesh"), (4, "ring"), (8, "mesh"), (8, "ring"), (2, "flat_ring")} <= ran
    # bf16 beside fp32 where the NIC bounds (4x1, 4x2 at 2 Gbit/s) and where the CPU does
    # (2x1, 2x2 unshaped).
    half = {(p.hosts, p.ranks, p.shaped) for p, _, _ in rows if p.dtype == "bfloat16"}
    assert half == {(4, 1, True), (4, 2, True), (2, 1, False), (2, 2, False)}
    assert len(rows) >= 153
    # The target from 16 MiB on shaped cables; 1 MiB and unshaped cables claim more.
    assert cf.error_bound("ring", 64 * MIB) == cf.TARGET == 0.15
    assert cf.error_bound("mesh", MIB) == 0.20
    assert cf.error_bound("mesh", 64 * MIB, shaped=False) == 0.35
    for p, _, err in rows:
        bound = cf.error_bound(p.algorithm, p.size, p.shaped)
        assert abs(err) <= bound, report.error_table(rows)


def test_the_fit_predicts_more_hosts_than_it_saw(recorded_fit):
    # Fitted on 2 to 8 hosts; 16 and 32 hosts (tests/data/multihost/validation) came later.
    costs, _ = recorded_fit
    runs = []
    for path in sorted(glob.glob(os.path.join(DATA, "validation", "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    rows = cf.errors(costs, cf.fastest(cf.points(runs)))
    assert {(p.hosts, p.algorithm) for p, _, _ in rows} >= {(16, "ring"), (32, "ring")}
    for p, _, err in rows:
        if p.algorithm in ("ring", "flat_ring"):
            # The algorithms with one flow per NIC: within the target, out of sample.
            assert abs(err) <= cf.TARGET, report.error_table(rows)
        else:
            # The mesh's incast dropped packets there, which the model does not see.
            assert abs(err) <= cf.ERROR_BOUND_MESH_UNSEEN, report.error_table(rows)


def test_the_recorded_fit_is_physical(recorded_fit):
    costs, _ = recorded_fit
    assert 0.5 < costs.nic_efficiency <= 1.0
    # The mesh was measured slower than the ring at 4 and 8 hosts, most at 1 MiB: each flow
    # beyond one costs NIC time and a latency (Note [Cost model]).
    assert 0.0 < costs.flow_skew < 0.2
    assert 1e-4 < costs.flow_latency < 5e-3
    for name in ("alpha", "net_cpu", "reduce_cpu", "shm_reduce_cpu", "copy_cpu", *cf.FITTED_HALF):
        value = getattr(costs, name)
        assert value > 0 and math.isfinite(value), name
    # A bf16 byte is two elements summed in fp32: the 2x2 unshaped reduce_scatter took 1.24
    # times fp32's time at the same bytes, which the shared-memory steps' rate carries.
    assert costs.half_shm_reduce_cpu > 1.2 * costs.shm_reduce_cpu


def test_the_auto_rule_in_the_backend_is_the_models(recorded_fit):
    # Note [The auto rule from the model]: kAutoRule in net_algorithm.cpp is what the model
    # fitted on the recorded runs derives; a refit that moves a crossover must rewrite it
    # (bench multihost --fit prints the lines).
    costs, _ = recorded_fit
    rule = report.auto_rule(costs)
    source = os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "smddp", "algorithms")
    with open(os.path.join(source, "net_algorithm.cpp")) as f:
        text = f.read()
    start = text.index("kAutoRule[] = {")
    table = text[start : text.index("};", start)]
    entries = [
        (int(h), AutoBySize(group.lower(), int(t), (int(a), int(r), int(g))))
        for h, group, t, a, r, g in re.findall(
            r"\{(\d+), NetAlgo::(MESH|RING), (\d+), \{(\d+), (\d+), (\d+)\}\}", table
        )
    ]
    assert entries == rule, report.auto_rule_table(costs)
    # Never on 2 hosts, where the mesh's one exchange is all there is; the tree only for small
    # all_reduces.
    assert rule[0] == (2, AutoBySize("mesh", 0, (0, 0, 0)))
    assert all(r.tree_max_bytes <= 16 * MIB for _, r in rule)

    def at(hosts: int) -> AutoBySize:
        return [r for first, r in rule if first <= hosts][-1]

    # Note [The group's algorithm under auto]: the ring from 3 hosts, where it was measured
    # ahead of the mesh (16 and 32 hosts) and beyond.
    assert all(at(h).main == "ring" for h in range(3, 1025))
    # On the hosts measured halving-doubling takes only small collectives: it was measured
    # behind the ring from 4 MiB on 16 and 32 hosts.
    assert all(d <= MIB for h in range(3, 33) for d in at(h).doubling_max_bytes)
    # On the 16 and 32 hosts measured, the tree takes the smallest all_reduces and
    # halving-doubling the next ones (docs/log/multi_node.md, "16 and 32 hosts").
    for hosts in (16, 32):
        r = at(hosts)
        assert r.tree_max_bytes > 0 and all(d > r.tree_max_bytes for d in r.doubling_max_bytes)


def test_the_group_algorithm_is_the_faster_of_ring_and_mesh_for_large_calls(recorded_fit):
    # Note [The auto rule from the model]: the mesh on 2 hosts; from 3, the faster of the
    # ring and the mesh at GROUP_BYTES, which at the recorded fit picks as 16 MiB and 1 GiB
    # would, on every host count the rule covers.
    costs, _ = recorded_fit
    assert group_algorithm(costs, report.rule_cluster(2)) == "mesh"
    for hosts in range(3, 1025):
        cluster = report.rule_cluster(hosts)
        picks = {group_algorithm(costs, cluster, s) for s in (16 * MIB, GROUP_BYTES, 1 << 30)}
        assert picks == {"ring"}, (hosts, picks)
    # Its two terms decide: flows that share a NIC unevenly lose to the ring, and steps that
    # cost more than the mesh's flows do lose to the mesh.
    cluster = cm.Cluster(16, 1, nic_rate=1e9, cores=16)
    skewed = dataclasses.replace(WIRE_ONLY, flow_skew=0.05)
    assert group_algorithm(skewed, cluster) == "ring"
    slow_steps = dataclasses.replace(WIRE_ONLY, step=0.05)
    assert group_algorithm(slow_steps, cluster) == "mesh"


def test_staged_rounds_add_what_they_do_not_overlap():
    # Note [Staged algorithms]: the tree and halving/doubling add stage_serial of the smaller
    # of their NIC and CPU times; the pipelined ring does not.
    costs = dataclasses.replace(WIRE_ONLY, net_cpu=5e-10, stage_serial=0.5)
    cluster = cm.Cluster(4, 1, nic_rate=1e9, cores=4)
    for algorithm in ("doubling", "ring"):
        w = cm.work(cluster, "reduce_scatter_tensor", 64 * MIB, algorithm)
        p = cm.parts(costs, w)
        busy = sum(p.cpu.values())
        assert p.wire > busy > 0
        staged = algorithm == "doubling"
        assert p.unoverlapped == pytest.approx(0.5 * busy if staged else 0.0)
        assert cm.seconds(costs, w) == pytest.approx(p.wire + p.unoverlapped)
    # Each round waits for a core where ranks outnumber them: stage_wake per round and per
    # squared unit of oversubscription (3 ranks per core beyond one: 9).
    late = dataclasses.replace(WIRE_ONLY, stage_wake=1e-3)
    crowded = cm.Cluster(4, 1, nic_rate=1e18, cores=1, machine_ranks=4)
    assert cm.predict(late, crowded, "all_reduce", 1, "doubling") == pytest.approx(9 * 4e-3)
    assert cm.predict(late, crowded, "all_reduce", 1, "tree") == pytest.approx(9 * 2e-3)
    assert cm.predict(late, crowded, "all_reduce", 1, "ring") < 1e-12


def test_the_fit_recovers_the_staged_costs_it_generated():
    truth = dataclasses.replace(
        WIRE_ONLY, nic_efficiency=0.9, net_cpu=2e-10, wake=1e-5, stage_serial=0.8, stage_wake=3e-4
    )
    pts = []
    for hosts, algorithm, op, size in itertools.product(
        (8, 16, 32), ("ring", "doubling", "tree"), cm.OPS, (64 << 10, MIB, 16 * MIB)
    ):
        if algorithm == "tree" and op != "all_reduce":
            continue
        p = cf.Point(hosts, 1, op, size, "smddp", 1.0, 1.25e8, 2, ran=algorithm)
        pts.append(dataclasses.replace(p, seconds=cm.seconds(truth, p.work())))
    # The other costs held at the truth's (fit() fits them on the pipelined rows first).
    fitted = cf.fit_staged(dataclasses.replace(truth, stage_serial=0.0, stage_wake=0.0), pts)
    assert fitted.stage_serial == pytest.approx(0.8, rel=0.05)
    assert fitted.stage_wake == pytest.approx(3e-4, rel=0.05)


def test_fit_from_saved_runs_prints_the_tables(tmp_path, capsys, monkeypatch, recorded_fit):
    from benchmarks import multihost

    # The fit of these very files is recorded_fit's (the tests above check it); the command
    # takes it rather than fitting them a second time.
    monkeypatch.setattr(cf, "fit", lambda pts: recorded_fit[0])
    files = sorted(glob.glob(os.path.join(DATA, "*.json")))
    plot = tmp_path / "model.png"
    code = multihost.main(
        ["--fit", *files, "--predict-nics", "2", "--plot", str(plot)]
        + ["--predict-dtypes", "float32,bfloat16", "--predict-hosts", "64,1024"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| 2x1 | all_reduce | 64 MiB | mesh | float32 |" in out
    assert "| 8x1 | all_gather_into_tensor | 64 MiB | ring | float32 |" in out
    assert "| 2x2 | reduce_scatter_tensor | 64 MiB | mesh | bfloat16 | unshaped" in out
    # The staged rows of 16 and 32 hosts (8 from 16 MiB, 32 below it) and their ring rows (6
    # from 16 MiB, 12 below it) join the pipelined ones.
    assert "smddp from 16 MiB: 106 of 110 within 15%" in out
    assert "smddp below 16 MiB: 72 of 80 within 15%" in out
    assert "| TCP bytes through a shaped simulated cable |" in out
    assert "| bfloat16 | 4x2 | 2 Gbit/s, bbr, 2 MiB queue | 9 | 9 |" in out
    # The pairs the half-precision rates are fitted on, and bf16 beside fp32 at 1024 hosts.
    assert (
        "| 2x2 | unshaped, bbr, 2 MiB queue | reduce_scatter_tensor | 64 MiB | bfloat16 | 1.24 |"
        in out
    )
    assert "| op | hosts | float32 | bfloat16 |" in out and "| all_reduce | 1024 |" in out
    assert "Predicted: 2 x 100gbit per host, 8 ranks" in out
    assert "| 1024 |" in out and "largest" in out
    assert "auto's choice by size" in out and "    {2, NetAlgo::MESH, 0, {0, 0, 0}}," in out
    # docs/log/multi_node.md, "What bounds smddp against bare TCP": the recorded fit's split.
    assert "| 2x2 | float32 | reduce_scatter | 17.3 | 2.5 | 14.6 | - | 0.50 |" in out
    assert plot.stat().st_size > 0


def test_bare_tcps_ceiling_is_the_tcp_bytes_share_of_the_cpu():
    def shares(costs: cm.Costs) -> dict[tuple[str, str, str], float]:
        rows = report.cpu_split_table(costs).splitlines()[2:]
        cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
        return {(c[0], c[1], c[2]): float(c[-1]) for c in cells}

    tcp_only = dataclasses.replace(
        WIRE_ONLY, net_cpu=1e-9, reduce_cpu=0.0, shm_reduce_cpu=0.0, copy_cpu=0.0
    )
    assert set(shares(tcp_only).values()) == {1.0}  # nothing but the TCP path: bare TCP's speed
    # Copies at the TCP path's cost per byte: a 2x1 all_reduce copies nothing, a 2x2
    # all_gather copies its parts through the segments.
    with_copies = dataclasses.replace(tcp_only, copy_cpu=1e-9)
    got = shares(with_copies)
    assert got[("2x1", "float32", "all_reduce")] == 1.0
    assert got[("2x2", "float32", "all_gather")] < got[("2x1", "float32", "all_gather")] < 1.0
