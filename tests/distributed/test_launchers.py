"""Real launchers start real jobs (docs/launch.md): OpenMPI's mpirun and MPICH's mpiexec on one
host, mpirun across two simulated hosts, a real SLURM cluster's srun on one and two hosts,
four processes with exactly srun's variables, and torchrun across two simulated hosts with
c10d rendezvous, where one host's rank is killed mid-training and the job resumes.

Every rank runs tests/distributed/launch_rank.py (the smddp import, ``init_process_group``
with no arguments, ``tsm.init`` with ``hybrid_shard_degree=2``, an all_reduce); no test sets
RANK or WORLD_SIZE. Each job is checked the same way: every rank's ranks in
``torch.distributed`` and ``tsm.state`` equal what its launcher said, the hybrid groups are
the expected ones, smddp found the expected hosts, and the all_reduce sum is exact.
Launchers' jobs on one host start 2 ranks (their variables are what they check; each rank is
a fresh interpreter, seconds of CPU); the four processes with srun's variables and the jobs
across hosts start 4, so hybrid groups with replicas are checked on one host and across two
(the kill-and-resume job runs one rank per host: what it tests is a host lost).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.distributed import netns_hosts, slurm_cluster
from torch_sagemaker import launch_env
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_SCRIPT = [sys.executable, "-m", "tests.distributed.launch_rank"]
MPI_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# Variables of the process running the tests that must not leak into a job's ranks.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "MPI_LOCAL", "SLURM_", "SM_", "SMDATAPARALLEL_", "MASTER_")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in TORCHRUN_VARS and not k.startswith(LAUNCHER_PREFIXES)
    }
    env.pop("SMDDP_FORCE_LOCAL_SIZE", None)
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


def _results(out, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _check_job(results: list[dict], launcher: str, hosts: list[list[int]]) -> None:
    """Every rank agrees with its launcher; groups, hosts and the all_reduce are right."""
    world = len(results)
    host_of = {r: h for h, members in enumerate(hosts) for r in members}
    for rank, res in enumerate(results):
        view = res["launcher_view"]
        assert res["launcher"] == launcher, res["launcher"]
        assert view["rank"] == rank and view["world_size"] == world, view
        assert res["dist"] == {"rank": rank, "world_size": world, "backend": "smddp"}, res["dist"]
        state = res["state"]
        assert (state["rank"], state["world_size"]) == (rank, world), state
        assert state["local_world_size"] == len(hosts[host_of[rank]]), state
        assert state["local_rank"] == hosts[host_of[rank]].index(rank), state
        assert (view["local_rank"], view["local_world_size"]) == (
            state["local_rank"],
            state["local_world_size"],
        )
        # hybrid_shard_degree=2: shard pairs of consecutive ranks, replicas across them.
        assert res["shard_group"] == [rank - rank % 2, rank - rank % 2 + 1], res["shard_group"]
        assert res["replicate_group"] == list(range(rank % 2, world, 2)), res["replicate_group"]
        assert res["smddp_layout"]["members"] == hosts, res["smddp_layout"]
        assert not res["smddp_layout"]["forced"]
        expected = world * (world + 1) / 2
        assert res["all_reduce"] == {"min": expected, "max": expected}, res["all_reduce"]


def _run(argv, env, timeout=180) -> None:
    done = subprocess.run(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-8000:]


@pytest.mark.skipif(shutil.which("mpirun.openmpi") is None, reason="OpenMPI is not installed")
def test_openmpi_mpirun_one_host(tmp_path):
    # SageMaker's single-instance mpirun path: no address is exported; the ranks use this host.
    argv = ["mpirun.openmpi", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x",
            "OMP_NUM_THREADS", *RANK_SCRIPT, str(tmp_path)]  # fmt: skip
    _run(argv, _clean_env(**MPI_ROOT))
    results = _results(tmp_path, 2)
    _check_job(results, launch_env.OPENMPI, [[0, 1]])
    assert results[0]["launcher_view"]["master_addr"] == launch_env.LOCAL_HOST_ADDRESS
    assert results[1]["launcher_env"]["OMPI_COMM_WORLD_RANK"] == "1"
    assert "RANK" not in results[1]["launcher_env"]


@pytest.mark.skipif(shutil.which("mpiexec.hydra") is None, reason="MPICH is not installed")
def test_mpich_mpiexec_one_host(tmp_path):
    argv = ["mpiexec.hydra", "-n", "2", *RANK_SCRIPT, str(tmp_path)]
    _run(argv, _clean_env())
    results = _results(tmp_path, 2)
    _check_job(results, launch_env.MPICH, [[0, 1]])
    assert results[1]["launcher_env"]["PMI_RANK"] == "1"
    assert results[1]["launcher_env"]["MPI_LOCALNRANKS"] == "2"


def test_srun_variables_and_init_creating_the_group(tmp_path):
    # Exactly what a real srun (Slurm 22.05) gives task i of `srun -N 1 -n 4` (recorded from
    # the cluster of slurm_cluster.py); here tsm.init creates the process group itself.
    procs = []
    for i in range(4):
        env = _clean_env(
            SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_NODEID="0", SLURM_STEP_ID="0",
            SLURM_STEPID="0", SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_NNODES="1",
            SLURM_JOB_NODELIST="smddp-host-0", SLURM_STEP_NODELIST="smddp-host-0",
            SLURM_TASKS_PER_NODE="4", SLURM_STEP_TASKS_PER_NODE="4", SLURM_JOB_ID="7",
        )  # fmt: skip
        argv = [*RANK_SCRIPT, str(tmp_path), "--init-group", "tsm"]
        procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-3000:] for o in outputs)
    results = _results(tmp_path, 4)
    _check_job(results, launch_env.SLURM, [[0, 1, 2, 3]])
    assert results[1]["launcher_view"]["master_addr"] == launch_env.LOCAL_HOST_ADDRESS
    assert results[1]["launcher_view"]["node_rank"] == 0


def _needs_namespaces() -> None:
    reason = netns_hosts.unavailable_reason()
    if reason:
        pytest.skip(f"needs Linux network and mount namespaces: {reason}")


@pytest.mark.skipif(shutil.which("mpirun.openmpi") is None, reason="OpenMPI is not installed")
def test_openmpi_mpirun_two_hosts(tmp_path):
    # SageMaker's multi-instance mpirun path: SMDATAPARALLEL_SERVER_ADDR and SM_HOSTS reach
    # every rank with -x; SM_CURRENT_HOST is each host's own (set by the launch agent there).
    _needs_namespaces()
    out = tmp_path / "out"
    out.mkdir()
    env = _clean_env(
        SM_HOSTS='["algo-1", "algo-2"]', SM_CURRENT_HOST="algo-1",
        SMDATAPARALLEL_SERVER_ADDR=netns_hosts.HOST_ADDRESS.format(1),
    )  # fmt: skip
    command = [sys.executable, "-m", "tests.distributed.netns_mpirun", "{host}", str(tmp_path),
               "--", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "SM_HOSTS", "-x",
               "SMDATAPARALLEL_SERVER_ADDR", *RANK_SCRIPT, str(out)]  # fmt: skip
    done = netns_hosts.run_on_two_hosts(command, timeout_s=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-8000:]
    results = _results(out, 4)
    _check_job(results, launch_env.OPENMPI, [[0, 1], [2, 3]])
    for rank, res in enumerate(results):
        assert res["hostname"] == netns_hosts.HOST_NAME.format(rank // 2)
        assert res["launcher_view"]["node_rank"] == rank // 2
        assert res["launcher_view"]["master_addr"] == netns_hosts.HOST_ADDRESS.format(1)
        assert res["launcher_view"]["sources"]["master_addr"] == "SMDATAPARALLEL_SERVER_ADDR"


def test_torchrun_c10d_rendezvous_two_hosts(tmp_path):
    # HyperPod's recipes: torchrun on every host with --rdzv-backend c10d; smddp finds the
    # two hosts itself (no SMDDP_FORCE_LOCAL_SIZE).
    _needs_namespaces()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"{netns_hosts.HOST_NAME.format(0)}:29400", "--rdzv-id", "c10d-job",
               "-m", "tests.distributed.launch_rank", str(tmp_path)]  # fmt: skip
    done = netns_hosts.run_on_two_hosts(command, timeout_s=240, env=_clean_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-8000:]
    results = _results(tmp_path, 4)
    _check_job(results, launch_env.TORCHRUN, [[0, 1], [2, 3]])
    # The c10d rendezvous decides which host gets node rank 0; each node's ranks share one.
    hosts = [res["hostname"] for res in results]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    assert [res["launcher_view"]["node_rank"] for res in results] == [0, 0, 1, 1]


@pytest.mark.skipif(slurm_cluster.unavailable_reason() is not None, reason="no SLURM here")
def test_real_srun_one_and_two_hosts(tmp_path):
    # slurmctld and a slurmd per simulated host; `srun -N 1 -n 2` on the first host, then
    # `srun -N 2 -n 4` across both: rank 0's address is the first host of the node list.
    slurm_cluster.write_conf(str(tmp_path))
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    command = [sys.executable, "-m", "tests.distributed.slurm_cluster", "{host}", str(tmp_path),
               "--", "-N", "1", "-n", "2", "-w", netns_hosts.HOST_NAME.format(0), *RANK_SCRIPT,
               str(one), "---", "-N", "2", "-n", "4", *RANK_SCRIPT, str(two)]  # fmt: skip
    try:
        done = netns_hosts.run_on_two_hosts(command, timeout_s=480, env=_clean_env(), cwd=REPO)
    finally:
        slurm_cluster.remove_spool(str(tmp_path))
    assert done.returncode == 0, done.stdout[-8000:]
    results = _results(one, 2)
    _check_job(results, launch_env.SLURM, [[0, 1]])
    assert results[0]["launcher_view"]["master_addr"] == launch_env.LOCAL_HOST_ADDRESS
    assert results[0]["launcher_env"]["SLURM_STEP_ID"] == "0"
    results = _results(two, 4)
    _check_job(results, launch_env.SLURM, [[0, 1], [2, 3]])
    for rank, res in enumerate(results):
        assert res["hostname"] == netns_hosts.HOST_NAME.format(rank // 2)
        view = res["launcher_view"]
        assert view["node_rank"] == rank // 2
        assert view["master_addr"] == netns_hosts.HOST_NAME.format(0)
        assert res["launcher_env"]["SLURM_STEP_NODELIST"] == "smddp-host-[0-1]"


# ----------------------------------------------------------------- kill and resume

TINY = ["--hidden-width", "64", "--num-layers", "2", "--num-heads", "4",
        "--num-key-value-heads", "2", "--intermediate-size", "128", "--max-context-width", "32",
        "--train-batch-size", "4", "--corpus-mb", "0.2", "--logging-freq", "1",
        "--validation-freq", "0", "--progress", "0"]  # fmt: skip
MAX_STEPS, CHECKPOINT_FREQ, KILL_AFTER = 12, 2, 4


def _train_args(work) -> list[str]:
    """examples/train.py's arguments for the job in ``work``."""
    return [
        "--smp-config", os.path.join(REPO, "examples", "configs", "full_shard.json"),
        "--max-steps", str(MAX_STEPS),
        "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-freq", str(CHECKPOINT_FREQ),
        "--num-kept-checkpoints", "2", "--resume", "auto", "--output-dir", str(work / "out"),
        *TINY,
    ]  # fmt: skip


def _uninterrupted_job(work) -> dict:
    """The same job uninterrupted, on 2 ranks forked here as two simulated hosts of 1.

    SMDDP_FORCE_LOCAL_SIZE=1 makes smddp treat each rank as a host and take the inter-host
    path between them, so the reductions run in the torchrun job's order (with two hosts of
    2, every loss was equal, bit for bit, to torchrun's over the two namespace hosts over the
    12 steps), in about half its time (no torchrun agents, no imports per rank).
    """
    from tests.distributed.launcher import run_distributed
    from tests.distributed.test_examples import _example_main

    work.mkdir()
    env = {"SMDDP_FORCE_LOCAL_SIZE": "1"}
    run_distributed(
        _example_main, _train_args(work), world_size=2, init_process_group=False, env=env,
        timeout=600,
    )  # fmt: skip
    return json.loads((work / "out" / "metrics.json").read_text())


def _killed_job(work) -> tuple[dict, str]:
    """examples/train.py under torchrun on both hosts, host 1's rank killed once after a
    checkpoint of step KILL_AFTER or later; returns (metrics.json, output).

    One rank per host: each worker torchrun starts or restarts is a fresh interpreter that
    imports torch and transformers (about 5 CPU-seconds here), and what is tested is a host
    lost and the job resumed; test_torchrun_c10d_rendezvous_two_hosts places 2 per host.
    """
    work.mkdir()
    torchrun = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{netns_hosts.HOST_NAME.format(0)}:29400", "--rdzv-id", "job",
        "--max-restarts", "1", "examples/train.py", *_train_args(work),
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "tests.distributed.elastic_host", "{host}",
        "--kill-host", "1", "--after-step", str(KILL_AFTER),
        "--checkpoint-dir", str(work / "ckpt"), "--record", str(work / "killed.json"),
        "--", *torchrun,
    ]  # fmt: skip
    # As examples/launch/torchrun_multinode.sh: a fresh store per attempt (docs/launch.md).
    env = _clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    done = netns_hosts.run_on_two_hosts(command, timeout_s=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-10000:]
    return json.loads((work / "out" / "metrics.json").read_text()), done.stdout


@pytest.mark.skipif(
    netns_hosts.unavailable_reason() is not None, reason="needs Linux network namespaces"
)
def test_torchrun_two_hosts_kill_one_host_and_resume(tmp_path):
    full = _uninterrupted_job(tmp_path / "full")
    resumed, stdout = _killed_job(tmp_path / "killed")
    record = json.loads((tmp_path / "killed" / "killed.json").read_text())
    assert len(record["killed"]) == 1, record  # host 1's rank
    # torchrun restarted the workers, which found the newest complete checkpoint.
    restarted = [line for line in stdout.splitlines() if "resumed from" in line]
    assert len(restarted) == 1, stdout[-10000:]
    start = int(restarted[0].rsplit("at step ", 1)[1])
    assert start >= record["newest_checkpoint"] >= KILL_AFTER, (start, record)
    assert start % CHECKPOINT_FREQ == 0 and start < MAX_STEPS, start
    # It lost at most the steps since that checkpoint, and every later step's loss equals
    # the uninterrupted run's.
    reference = {row["step"]: row["train/loss"] for row in full["steps"]}
    after = {row["step"]: row["train/loss"] for row in resumed["steps"]}
    assert sorted(after) == list(range(start + 1, MAX_STEPS + 1)), sorted(after)
    assert after == {step: reference[step] for step in after}
