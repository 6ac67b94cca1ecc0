"""smddp on two simulated hosts (Linux namespaces joined by a virtual Ethernet link),
launched by torchrun as a two-node job: the backend finds the hosts itself, the mesh runs
over the hosts' own addresses, and a rank dying on one host fails every other rank fast."""

import json
import os
import sys

import pytest

from tests.distributed import netns_hosts
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def two_host_run(tmp_path_factory):
    reason = netns_hosts.unavailable_reason()
    if reason:
        pytest.skip(f"two-host test needs Linux user and network namespaces: {reason}")
    out = tmp_path_factory.mktemp("two_hosts")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        "{host}",
        "--nproc-per-node",
        "2",
        "--master-addr",
        netns_hosts.HOST_ADDRESS.format(1),
        "--master-port",
        "29500",
        "-m",
        "tests.distributed.smddp_two_hosts_rank",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.pop("SMDDP_FORCE_LOCAL_SIZE", None)
    done = netns_hosts.run_on_two_hosts(command, timeout_s=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_hosts_found_without_forcing(two_host_run):
    # Both simulated hosts run on this machine's CPUs (Note [Hosts that share CPUs]): their
    # 4 ranks count against the CPUs this process may use, as on the hosts it starts.
    shared = len(os.sched_getaffinity(0)) < 4
    for rank, result in enumerate(two_host_run):
        layout = result["layout"]
        assert layout["members"] == [[0, 1], [2, 3]] and not layout["forced"], layout
        assert layout["host"] == rank // 2 and layout["local_rank"] == rank % 2, layout
        assert result["hostname"] == f"smddp-host-{rank // 2}"
        assert layout["machine_oversubscribed"] is shared, layout


def test_collectives_across_hosts_match_references(two_host_run):
    # Every check compared its result with a direct computation on its rank; the digest
    # (raw bits of reduced floats) must be the same on every rank.
    first = two_host_run[0]["counts"]
    assert first["all_reduce"] > 0 and first["p2p"] > 0 and first["all_to_all"] > 0
    for result in two_host_run:
        assert result["counts"] == first
        assert result["async_two_groups"] == 40
        assert result["object_rounds"] == 30  # DCP's planning pattern across hosts


def test_rank_dying_on_one_host_fails_all_others_quickly(two_host_run):
    # Rank 3 exits; ranks 0-2 stay alive after their error (so rank 0 cannot learn it from
    # a closed connection of rank 2): rank 2 sees its local peer gone, rank 1 its TCP peer,
    # rank 0 gets rank 2's failure notice or rank 1's failure flag.
    for rank in (0, 1, 2):
        fault = two_host_run[rank]["fault"]
        assert fault["error"] and "all_reduce" in fault["error"], fault
        assert "group '0'" in fault["error"], fault
        # The two wordings of the lost rank: "ranks [3]" (a local peer or a failure flag) and
        # "rank 3" (a TCP peer or another rank's notice); rank 0 gets whichever comes first.
        assert "[3]" in fault["error"] or "rank 3" in fault["error"], fault
        assert fault["seconds"] < 3.0, fault  # measured ~0.05 s; the timeout is 60 s
