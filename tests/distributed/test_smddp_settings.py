"""smddp settings reach the groups: typed pg_options per group over the environment, and a
malformed environment refused at group creation naming the variable."""

import os
import time

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _options_per_group():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions
    from torch_sagemaker.smddp.backend import group_settings

    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "smddp", rank=rank, world_size=2, pg_options=SMDDPOptions(spin_us=7, oneshot_bytes="1K")
    )
    small = dist.new_group(
        [0, 1],
        pg_options=SMDDPOptions(buffer_bytes="8K", chunk_bytes=4096, timeout=timedelta(seconds=30)),
    )
    plain = dist.new_group([0, 1])
    out = {
        "world": group_settings(),
        "small": group_settings(small),
        "plain": group_settings(plain),
    }
    # The small buffers really carry the traffic: many pipelined steps, exact results.
    t = torch.arange(100_000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t, group=small)
    out["exact"] = bool(torch.equal(t, torch.arange(100_000, dtype=torch.float64) * 3))
    try:
        dist.new_group([0, 1], pg_options={"buffer_bytes": 8192})
    except TypeError as e:
        out["type_error"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_options_apply_per_group_over_the_environment():
    results = run_distributed(
        _options_per_group,
        world_size=2,
        backend="smddp",
        init_process_group=False,
        env={"SMDDP_SPIN_US": "3"},
    )
    for r in results:
        assert r["world"]["spin_us"] == "7" and r["world"]["oneshot_bytes"] == "1024"
        assert r["small"]["buffer_bytes"] == "8192" and r["small"]["chunk_bytes"] == "4096"
        assert r["small"]["timeout"] == "30" and r["small"]["spin_us"] == "3"  # environment
        assert r["plain"]["buffer_bytes"] == str(1 << 20) and r["plain"]["spin_us"] == "3"
        assert r["exact"]
        assert (
            "pg_options must be a torch_sagemaker.smddp.SMDDPOptions, got dict" in r["type_error"]
        )


def _malformed_environment():
    from datetime import timedelta

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=60)
    )
    try:
        dist.init_process_group("smddp", store=store, rank=rank, world_size=2)
        message = "created"
    except ValueError as e:
        message = str(e)
    store.add("done", 1)  # rank 0's store serves rank 1 until rank 1 is done with it
    while store.add("done", 0) < 2:
        time.sleep(0.01)
    if rank == 1:
        store.set("bye", "1")
    else:
        store.wait(["bye"])
    return message


def test_malformed_environment_is_refused_at_group_creation():
    # Before: "12x" was read as 12 bytes (rounded to a page) and the job ran on.
    for message in run_distributed(
        _malformed_environment,
        world_size=2,
        backend="smddp",
        init_process_group=False,
        env={"SMDDP_BUFFER_BYTES": "12x"},
    ):
        assert "SMDDP_BUFFER_BYTES=12x is invalid" in message, message


def _warnings_at_init(marker):
    """The warnings a rank's default group creation raised that mention ``marker``."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("smddp")
        dist.barrier()
    dist.destroy_process_group()
    return [str(w.message) for w in caught if marker in str(w.message)]


def _ring_warnings():
    return _warnings_at_init("net_algo=ring")


@pytest.mark.parametrize(
    ("local_size", "warned"),
    [("2", "[2, 1] ranks"), ("1", None)],
    ids=["unequal_hosts", "three_equal_hosts"],
)
def test_a_ring_that_cannot_run_is_said_once(local_size, warned):
    # DESIGN: warn once when a setting has no effect. Hosts of 2 and 1 ranks take the mesh;
    # three hosts of one rank run the ring, and nothing is said.
    results = run_distributed(
        _ring_warnings,
        world_size=3,
        backend="smddp",
        init_process_group=False,
        fresh=True,
        env={"SMDDP_NET_ALGO": "ring", "SMDDP_FORCE_LOCAL_SIZE": local_size},
    )
    for messages in results:
        if warned is None:
            assert messages == [], messages
        else:
            assert len(messages) == 1 and warned in messages[0], messages


def _idle_restart_warnings():
    return _warnings_at_init("tcp_slow_start_after_idle")


def test_hosts_that_restart_tcp_windows_after_idle_gaps_are_said_once_each():
    # Note [Slow start after idle]: 2 hosts of 2 ranks; the first rank of each host warns
    # where the machine's setting is 1 (CI's and Linux's default), nobody where it is 0.
    with open(backend.SLOW_START_AFTER_IDLE) as f:
        restarts = f.read().strip() == "1"
    results = run_distributed(
        _idle_restart_warnings,
        world_size=4,
        backend="smddp",
        init_process_group=False,
        fresh=True,
        env={"SMDDP_FORCE_LOCAL_SIZE": "2"},
    )
    counts = [len(messages) for messages in results]
    assert counts == ([1, 0, 1, 0] if restarts else [0, 0, 0, 0]), results
