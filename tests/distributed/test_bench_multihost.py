"""``bench multihost``'s short case: 2 simulated hosts x 2 ranks, NICs shaped to 1 Gbit/s, 4 MiB.

It checks what the benchmark's table rests on: every collective's result is right, both
backends' times respect the NIC's bound (a faster one would mean the shaping failed), the
NIC counters see at least the bytes the collective must send, and smddp's float32 and
bfloat16 results agree bit for bit on every rank of both hosts. The same job trains SMP's
bf16 recipe (``--train-setups fsdp1_hybrid,fsdp2_hybrid --dtype bf16``) on a tiny Llama,
held against one host of 4 ranks."""

import time

import pytest

from benchmarks import multihost, multihost_report, multihost_training_report
from benchmarks.multihost_training import runs_for
from tools import netns
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

RATE = 10**9
# Large enough that a part crosses in several messages (256 KiB on 2x2: Note [A message per
# local step] in csrc/smddp/algorithms/comm_hier.cpp).
SIZE = 4 << 20
BACKENDS = ["smddp", "gloo", "bare-tcp"]
ALGORITHM = {"smddp": "mesh", "gloo": "flat_ring", "bare-tcp": "bare_ring"}
TRAINED = ["fsdp1_hybrid", "fsdp2_hybrid"]
# --train in bf16 on a tiny Llama (2 layers), 2 timed steps: the bookkeeping, not speed.
TRAINING = {
    "train_backends": ["smddp", "gloo"],
    "train_steps": 2,
    "train_runs": runs_for(TRAINED, 2, 2),
    "train_dtype": "bfloat16",
    "train_model": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 128,
        "seq": 16,
    },
}


def _needs_namespaces() -> None:
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"needs Linux network namespaces: {reason}")


@pytest.fixture(scope="module")
def short_run():
    _needs_namespaces()
    return multihost.run_layout(
        2,
        2,
        RATE,
        list(multihost.OPS),
        [SIZE],
        BACKENDS,
        2,
        240,
        identical=True,
        timeline=True,
        warmup_largest=1,
        dtypes=["float32", "bfloat16"],
        **TRAINING,
    )


@pytest.fixture(scope="module")
def one_host_training():
    _needs_namespaces()
    return multihost.run_layout(1, 4, RATE, [], [], ["smddp", "gloo"], 1, 240, **TRAINING)


def test_results_respect_the_nic_and_the_counters(short_run):
    rows = short_run["rows"]
    assert {(r["op"], r["backend"], r["dtype"]) for r in rows} == {
        (op, b, d) for op in multihost.OPS for b in BACKENDS for d in ("float32", "bfloat16")
    }
    for r in rows:
        assert r["ok"], r
        # Two hosts cross in one exchange: the mesh (gloo: its ring over all ranks; the
        # ceiling: bare streams along the rails).
        assert r["algorithm"] == ALGORITHM[r["backend"]], r
        # What no call can beat: the bytes beyond the buckets' bursts (96 KiB at each end of
        # the cable, netns.BURST) at the NIC's rate. Faster means the shaping did not hold.
        floor = (multihost_report.min_bytes(r["op"], 2, r["bytes"]) - 2 * 96 * 1024) * 8 / RATE
        assert r["seconds"] > floor, r
        assert r["tx_per_call"] >= 0.98 * multihost_report.min_bytes(r["op"], 2, r["bytes"]), r
    text = multihost_report.table(rows, RATE)
    assert "| 2x2 | float32 | 1 | all_reduce | 4 MiB |" in text and "gloo / smddp" in text
    assert "| 2x2 | bfloat16 | 1 | reduce_scatter_tensor | 4 MiB |" in text
    assert "smddp of bare-tcp" in text and "gloo of bare-tcp" in text


def test_each_case_reports_its_cpu_and_smddp_its_messages(short_run):
    """Note [CPU per byte]: every rank's CPU over the timed calls; smddp's transport counts."""
    for r in short_run["rows"]:
        assert len(r["cpu_per_call"]) == 4 and all(c > 0 for c in r["cpu_per_call"]), r
        assert r["softirq_per_call"] >= 0
        t = r["transport_per_call"]
        if r["backend"] != "smddp":
            assert t is None, r
            continue
        # The mesh on 2x2: each rank sends its share of the 4 MiB to the other host in one
        # or more 256 KiB-or-smaller messages, and receives as many; each takes a send(2).
        assert t["messages_sent"] >= 4 and t["messages_received"] == t["messages_sent"], r
        assert t["send_calls"] >= t["messages_sent"] and t["recv_calls"] > 0, r
        assert 0 <= t["stashed_bytes"] <= t["bytes_received"], r
        assert t["bytes_received"] >= multihost_report.min_bytes(r["op"], 2, r["bytes"]) * 2, r
    text = multihost_report.cpu_table(short_run["rows"])
    assert "| layout | dtype | op | size | backend | GB/s | CPU s/GB |" in text
    assert text.count("\n| 2x2 |") == len(short_run["rows"])
    assert "| bare-tcp |" in text and "| smddp |" in text


def test_half_precision_crosses_hosts_in_its_own_bytes(short_run):
    # Note [Half precision on the wire]: a bf16 reduction sends bf16 partials between hosts,
    # so its NIC carries the bf16 minimum (headers aside), not fp32's twice that.
    for r in short_run["rows"]:
        if r["backend"] == "smddp" and r["dtype"] == "bfloat16":
            wire = r["tx_per_call"] / multihost_report.min_bytes(r["op"], 2, r["bytes"])
            assert wire < 1.15, (r["op"], wire)


def test_results_are_bit_identical_across_hosts(short_run):
    per_rank = short_run["identical"]
    assert len(per_rank) == 4
    for dtype, tolerance in (("float32", 1e-4), ("bfloat16", 0.1)):
        first = per_rank[0][dtype]
        for r in per_rank:
            mine = r[dtype]
            assert mine["all_reduce"] == first["all_reduce"], dtype
            assert mine["all_gather"] == first["all_gather"] and mine["all_gather_exact"]
            assert mine["all_reduce_error"] < tolerance, (dtype, mine)
            assert mine["reduce_scatter_error"] < tolerance, (dtype, mine)


def test_timeline_shows_each_phase_inside_its_call(short_run):
    # 2 hosts of 2: shared memory inside a host, the network between them, and the
    # reduction of what arrived (Note [Timeline], Note [Pipelined exchanges]).
    expected = {
        "all_reduce": {"local reduce_scatter", "network", "reduce", "local all_gather"},
        "reduce_scatter_tensor": {"local reduce_scatter", "network", "reduce"},
        "all_gather_into_tensor": {"network", "local all_gather"},
    }
    smddp_rows = [r for r in short_run["rows"] if r["backend"] == "smddp"]
    assert {r["op"] for r in smddp_rows} == set(expected)
    for r in smddp_rows:
        assert len(r["timeline"]) == 4, r["op"]
        for rank, spans in enumerate(r["timeline"]):
            whole = [s for s in spans if s[0] == r["op"]]
            assert len(whole) == 1, (r["op"], rank, spans)
            _, begin, end, _ = whole[0]
            phases = {s[0] for s in spans} - {r["op"]}
            assert phases == expected[r["op"]], (r["op"], rank, phases)
            for phase, b, e, _ in spans:
                assert begin <= b <= e <= end, (r["op"], rank, phase)
    for gloo in (r for r in short_run["rows"] if r["backend"] == "gloo"):
        assert gloo["timeline"] is None
    text = multihost_report.timeline_table(short_run["rows"])
    assert "2x2 smddp (mesh) all_reduce 4 MiB: phases per rank, ms" in text
    assert "| 3 | network |" in text


def test_unshaped_runs_have_no_bound():
    row = {"layout": "2x1", "dtype": "float32", "warmup": 0, "op": "all_reduce"}
    row |= {"bytes": 1 << 20, "backend": "smddp", "ok": True, "seconds": 0.01}
    row |= {"tx_per_call": 1 << 20, "drops": 0}
    line = multihost_report.table([row], None).splitlines()[2]
    assert line.startswith("| 2x1 | float32 | 0 | all_reduce | 1 MiB | - | 10.0 | - |"), line


def test_arguments_are_checked():
    assert netns.parse_rate("2gbit") == 2 * 10**9 and netns.parse_rate("500mbit") == 5 * 10**8
    for bad in ("fast", "inf", "-1gbit", "0"):
        with pytest.raises(ValueError, match=f"'{bad}' is not a positive rate"):
            netns.parse_rate(bad)
    with pytest.raises(Exception, match="at least 2 hosts"):
        multihost._layout("1x2")


def test_each_backend_runs_its_sweep_back_to_back(short_run):
    # Note [Each backend's sweep back to back]: the rows come in the order they ran, so one
    # backend's cases (every op) must all come before the next backend's; interleaved
    # backends leave each one's connections idle between its own cases.
    ran = [r["backend"] for r in short_run["rows"]]
    assert ran == [b for b in BACKENDS for _ in range(2 * len(multihost.OPS))], ran


def test_each_host_runs_the_congestion_control_asked_for():
    # Note [Simulated hosts run cubic]: the hosts' TCP congestion control is the benchmark's
    # choice, not the machine's, among those the kernel lets a namespace choose; a name the
    # kernel lacks, or keeps to its own namespace, is refused, naming the lists.
    if netns.unavailable_reason():
        pytest.skip(f"needs Linux network namespaces: {netns.unavailable_reason()}")
    offered = netns.congestion_settings("available_")
    allowed = netns.congestion_settings("allowed_")
    read = ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]
    asked = {"cubic", "reno", "bbr"} & set(offered) & set(allowed)
    assert asked, (offered, allowed)  # reno is always both
    for name in asked:
        assert netns.check_congestion(name) == name
        done = netns.run_hosts(2, read, 60, congestion=name)
        assert done.returncode == 0, done.stdout
        assert done.stdout.count(f"] {name}\n") == 2, done.stdout
    with pytest.raises(ValueError, match="'no-such-cc' is not available on this machine"):
        netns.check_congestion("no-such-cc")
    done = netns.run_hosts(2, read, 60, congestion="no-such-cc")
    assert done.returncode != 0 and "'no-such-cc' could not be set" in done.stdout
    for name in set(offered) - set(allowed):  # e.g. cubic where the list is "reno bbr"
        with pytest.raises(ValueError, match=f"'{name}' cannot be set in a simulated host"):
            netns.check_congestion(name)
        done = netns.run_hosts(2, read, 60, congestion=name)
        assert done.returncode != 0, done.stdout
        assert f"'{name}' could not be set" in done.stdout and "allowed" in done.stdout


def _simulated_lists(monkeypatch, allowed: str, own: str = "bbr") -> None:
    lists = {"": own, "available_": "reno bbr cubic", "allowed_": allowed}
    monkeypatch.setattr(netns, "congestion_settings", lambda kind="": lists[kind].split())


def test_the_default_congestion_control_falls_back_where_cubic_is_not_allowed(monkeypatch):
    # The suite's path (run_layout's default, AUTO) on a machine whose allowed list lacks
    # cubic, as CI's can: the machine's own, said why; where the list has cubic, cubic.
    _simulated_lists(monkeypatch, "reno bbr")
    name, why = netns.resolve_congestion(netns.AUTO_CONGESTION)
    assert name is None
    assert "cubic, the benchmark's default, is not in" in why and "(reno bbr)" in why
    assert netns.resolve_congestion("system") == (None, "the machine's own, as asked")
    assert netns.resolve_congestion("reno") == ("reno", "")
    # Asked for by name, cubic is still refused before any host starts, naming the fix.
    with pytest.raises(ValueError, match="here reno bbr, root included") as refused:
        netns.resolve_congestion("cubic")
    assert "tcp_allowed_congestion_control='reno bbr cubic'" in str(refused.value)
    with pytest.raises(SystemExit):
        multihost.main(["--layouts", "2x1", "--congestion", "cubic"])
    _simulated_lists(monkeypatch, "reno bbr cubic")
    assert netns.resolve_congestion(netns.AUTO_CONGESTION) == ("cubic", "Linux's default")
    assert netns.resolve_congestion("cubic") == ("cubic", "")


def test_hosts_start_with_the_fallback_and_report_it(monkeypatch):
    # The fallback's hosts run and read back the machine's own congestion control, which is
    # what the benchmark's record and header carry (tools.bench_host.host_settings).
    if netns.unavailable_reason():
        pytest.skip(f"needs Linux network namespaces: {netns.unavailable_reason()}")
    own = netns.congestion_settings()
    _simulated_lists(monkeypatch, "reno bbr", own=" ".join(own))
    name, _ = netns.resolve_congestion(netns.AUTO_CONGESTION)
    read = ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]
    done = netns.run_hosts(2, read, 60, congestion=name)
    assert done.returncode == 0, done.stdout
    assert done.stdout.count(f"] {own[0]}\n") == 2, done.stdout
    per_host = [{"congestion": "bbr", "slow_start_after_idle": "1"}] * 2
    assert multihost_report.ran_setting(per_host, "congestion") == "bbr on every host"
    mixed = [per_host[0], {"congestion": "cubic", "slow_start_after_idle": "1"}]
    assert multihost_report.ran_setting(mixed, "congestion") == "host 0: bbr, host 1: cubic"


def test_the_record_says_what_every_host_ran(short_run):
    # The short run took the suite's default: cubic where namespaces may choose it, else the
    # machine's own; each host's kernel reports what it ran.
    expected, why = netns.resolve_congestion(netns.AUTO_CONGESTION)
    expected = expected or netns.congestion_settings()[0]
    assert short_run["hosts"] == [
        {"congestion": expected, "slow_start_after_idle": "1"} for _ in range(2)
    ]
    assert short_run["congestion_why"] == why


def test_each_host_keeps_or_drops_slow_start_after_idle_as_asked():
    # Note [Slow start after idle] in smddp/backend.py: the hosts' setting is the
    # benchmark's choice, and a new namespace starts with the kernel's default, 1.
    if netns.unavailable_reason():
        pytest.skip(f"needs Linux network namespaces: {netns.unavailable_reason()}")
    read = ["cat", "/proc/sys/net/ipv4/tcp_slow_start_after_idle"]
    for asked, seen in ((0, "0"), (1, "1"), (None, "1")):
        done = netns.run_hosts(2, read, 60, slow_start_after_idle=asked)
        assert done.returncode == 0, done.stdout
        assert done.stdout.count(f"] {seen}\n") == 2, (asked, done.stdout)
    for bad in (2, True):
        with pytest.raises(ValueError, match=f"slow_start_after_idle={bad}: .* is 0 or 1"):
            netns.run_hosts(2, read, 60, slow_start_after_idle=bad)


def test_hosts_are_stopped_before_they_exhaust_the_machines_memory():
    # Note [Memory floor] in tools/netns.py: a floor above what the machine has stops the
    # hosts at once, with the reason, where they would otherwise sleep for a minute.
    if netns.unavailable_reason():
        pytest.skip(f"needs Linux network namespaces: {netns.unavailable_reason()}")
    start = time.monotonic()
    done = netns.run_hosts(2, ["sleep", "60"], 90, memory_floor_bytes=1 << 60)
    assert done.returncode != 0, done.stdout
    assert done.stdout.count("killed: the machine's available memory fell to") == 2, done.stdout
    assert "below the floor of 1099511627776 MiB" in done.stdout, done.stdout
    assert time.monotonic() - start < 30, done.stdout
    done = netns.run_hosts(2, ["true"], 60)  # the default floor lets a small job run
    assert done.returncode == 0, done.stdout


def test_each_hosts_own_process_does_not_import_torch():
    # Note [A light host process] in tools/bench_host.py: one runs beside every host's ranks.
    import subprocess
    import sys

    probe = "import sys, tools.bench_host; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # The probe sees torch where it is imported.
    probe = probe.replace("tools.bench_host", "benchmarks")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['torch']", out.stdout


def test_the_local_all_gather_runs_during_the_exchange(short_run):
    # Note [Local all-gather during the exchange]: the shared-memory all-gather's steps start
    # while parts still cross the network, not once the exchange is over. Each rank handles
    # 2 parts of 1 MiB here, each in 4 messages, so a step can start after the first ones.
    for r in short_run["rows"]:
        if r["backend"] != "smddp" or r["op"] == "reduce_scatter_tensor":
            continue
        early = 0
        for spans in r["timeline"]:
            (network_end,) = [e for phase, _, e, _ in spans if phase == "network"]
            starts = [b for phase, b, _, _ in spans if phase == "local all_gather"]
            early += min(starts) < network_end
        assert early >= 2, (r["op"], r["timeline"])


def test_smps_bf16_recipe_trains_across_hosts_as_on_one_host(short_run, one_host_training):
    across, one_host = short_run["training"], one_host_training["training"]
    ran = [(r["setup"], r["backend"]) for r in across]
    assert ran == [(s, b) for s in TRAINED for b in ("smddp", "gloo")]
    assert [(r["setup"], r["backend"]) for r in one_host] == ran
    wrapped = {"fsdp1_hybrid": "FSDP1 HYBRID_SHARD on (2, 2)", "fsdp2_hybrid": "FSDP2 on (2, 2)"}
    for r in across + one_host:
        assert r["wrapped"] == wrapped[r["setup"]] and r["dtype"] == "bfloat16"
        # Each step, 3 units (2 layers and the root): the forward gathers them all and the
        # backward the 2 layers again (resharded after forward); each unit reduce-scatters
        # inside its host and all-reduces across the replicas. Every call is synchronous
        # (Note [Exposed communication]), and every one of them took time.
        assert r["calls"] == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3}, r
        assert r["async_calls"] == 0, r
        assert all(s > 0 for s in r["exposed_s"].values()), r
        assert 0 < r["compute_s"] < r["step_s"] and sum(r["exposed_s"].values()) < r["step_s"]
        assert len(r["losses"]) == 4 and all(len(steps) == 3 for steps in r["losses"])
        assert len({steps[0] for steps in r["losses"]}) == 4  # each rank its own data
    per_layout = {"2x2": across, "1x4": one_host}
    assert multihost_training_report.loss_problems(per_layout) == []
    # gloo's collectives are the same wherever the ranks are: the same losses, bit for bit.
    for mine, theirs in zip(across, one_host, strict=True):
        if mine["backend"] == "gloo":
            assert mine["losses"] == theirs["losses"], mine["setup"]
    text = multihost_training_report.training_table(per_layout)
    assert "| 2x2 | fsdp1_hybrid | FSDP1 HYBRID_SHARD on (2, 2) | smddp |" in text
    assert text.count("\n| 1x4 | ") == 4
