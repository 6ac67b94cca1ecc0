"""The launcher's environment (torch_sagemaker/launch_env.py): each launcher's
variables, their precedence, SLURM's list syntax, the master address and every error."""

import pytest

from torch_sagemaker import launch_env as L

OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
# What srun sets for task 5 of `srun -N 4 -n 7` (tasks per node 2, 2, 2, 1).
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_NTASKS": "7",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NODELIST": "node[01-03,07]",
    "SLURM_STEP_NODELIST": "node[01-03,07]",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
}
TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "7777",
}


def test_no_launcher_is_none():
    assert L.detect({}) is None
    assert L.detect({"PATH": "/bin", "SM_HOSTS": '["algo-1"]'}) is None


def test_torchrun():
    info = L.detect(TORCHRUN)
    assert (info.launcher, info.rank, info.world_size) == (L.TORCHRUN, 1, 4)
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, 0)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 7777)
    assert info.sources["master_addr"] == "MASTER_ADDR"


def test_env_launch_without_local_variables_leaves_them_unknown():
    info = L.detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert info.local_rank is None and info.local_world_size is None
    assert "LOCAL_RANK" not in info.torch_variables()


def test_a_local_rank_without_the_local_size_is_refused():
    """Ranks per host unknown: the layout would take a job on several hosts for one host."""
    with pytest.raises(L.LaunchEnvError, match="LOCAL_WORLD_SIZE is not set"):
        L.detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h"})


def test_a_single_rank_needs_no_address():
    info = L.detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert (
        info.master_addr == L.LOCAL_HOST_ADDRESS and info.sources["master_addr"] == "a single rank"
    )


def test_openmpi_on_several_hosts_needs_an_address():
    with pytest.raises(L.LaunchEnvError, match="MASTER_ADDR is not set.*2 of 4 ranks"):
        L.detect(OMPI)
    info = L.detect({**OMPI, "SMDATAPARALLEL_SERVER_ADDR": "algo-1"})
    assert (info.launcher, info.rank, info.world_size) == (L.OPENMPI, 3, 4)
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, None)
    assert (info.master_addr, info.master_port) == ("algo-1", L.DEFAULT_MASTER_PORT)


def test_openmpi_on_one_host_uses_the_local_address():
    env = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    info = L.detect(env)
    assert info.master_addr == L.LOCAL_HOST_ADDRESS
    assert info.sources["master_addr"] == "every rank on this host"


def test_sagemaker_hosts_give_node_rank_and_master():
    env = {**OMPI, "SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"}
    info = L.detect(env)
    assert info.node_rank == 1 and info.master_addr == "algo-1"
    env["SMDATAPARALLEL_SERVER_ADDR"] = "10.2.0.1"
    env["SMDATAPARALLEL_SERVER_PORT"] = "7592"
    info = L.detect(env)
    assert (info.master_addr, info.master_port) == ("10.2.0.1", 7592)
    assert info.sources["master_port"] == "SMDATAPARALLEL_SERVER_PORT"
    with pytest.raises(L.LaunchEnvError, match="SM_CURRENT_HOST='algo-9' is not one of"):
        L.detect({**env, "SM_CURRENT_HOST": "algo-9"})
    with pytest.raises(L.LaunchEnvError, match="SM_HOSTS=.*not a JSON list"):
        L.detect({**env, "SM_HOSTS": "algo-1,algo-2"})


def test_mpich_and_intel_mpi():
    info = L.detect({**MPICH, "MASTER_ADDR": "n1"})
    assert (info.launcher, info.rank, info.world_size) == (L.MPICH, 2, 4)
    assert (info.local_rank, info.local_world_size) == (0, 2)
    with pytest.raises(L.LaunchEnvError, match="MPI_LOCALNRANKS is not set.*MPICH"):
        L.detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "a"})


def test_slurm():
    info = L.detect(SLURM)
    assert (info.launcher, info.rank, info.world_size) == (L.SLURM, 5, 7)
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, 2)
    assert info.master_addr == "node01"
    assert info.sources["master_addr"] == "the first host of the SLURM node list"
    last = {**SLURM, "SLURM_PROCID": "6", "SLURM_NODEID": "3", "SLURM_LOCALID": "0"}
    assert L.detect(last).local_world_size == 1


def test_slurm_single_node_uses_the_local_address():
    env = {
        "SLURM_PROCID": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "gpu-node-17",
        "SLURM_TASKS_PER_NODE": "4",
    }
    info = L.detect(env)
    assert (info.rank, info.local_world_size, info.master_addr) == (2, 4, "127.0.0.1")


def test_slurm_batch_script_without_a_step_is_not_a_rank():
    # sbatch's script sees SLURM_PROCID=0 and the job's task count, but it is one process.
    batch = {k: v for k, v in SLURM.items() if "STEP" not in k}
    assert L.detect(batch) is None


def test_slurm_variables_that_disagree():
    with pytest.raises(L.LaunchEnvError, match="gives 4 hosts and 6 tasks.*SLURM_STEP_NUM_TASKS=7"):
        L.detect({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2),1,1"})
    with pytest.raises(L.LaunchEnvError, match="SLURM_NODEID=4 is not below the 4 hosts"):
        L.detect({**SLURM, "SLURM_NODEID": "4"})
    with pytest.raises(L.LaunchEnvError, match="SLURM_STEP_NODELIST:.*leaves a bracket open"):
        L.detect({**SLURM, "SLURM_STEP_NODELIST": "node[01-03"})


def test_srun_with_pmi2_is_read_from_slurm_variables():
    # srun --mpi=pmi2 (or MpiDefault=pmi2) sets PMI_RANK/PMI_SIZE/PMI_FD in every task but not
    # Hydra's MPI_LOCALRANKID; those tasks are srun's, not an MPICH launch.
    info = L.detect({**SLURM, "PMI_RANK": "5", "PMI_SIZE": "7"})
    assert (info.launcher, info.rank, info.local_world_size) == (L.SLURM, 5, 2)
    # Hydra's mpiexec inside an allocation sets MPI_LOCALRANKID: still MPICH.
    assert L.detect({**SLURM, **MPICH, "MASTER_ADDR": "h0"}).launcher == L.MPICH


@pytest.mark.parametrize(
    "outer, inner, expected",
    [
        (TORCHRUN, SLURM, L.TORCHRUN),  # srun torchrun ...
        (OMPI, SLURM, L.OPENMPI),  # mpirun inside a SLURM allocation
        (TORCHRUN, OMPI, L.TORCHRUN),  # mpirun torchrun ...
        (OMPI, MPICH, L.OPENMPI),
        (MPICH, SLURM, L.MPICH),
    ],
)
def test_precedence(outer, inner, expected):
    env = {**inner, **outer, "MASTER_ADDR": "h0"}
    assert L.detect(env).launcher == expected


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0"}, "WORLD_SIZE is not set: the torchrun launcher"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK='-1' is not a non-negative integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "99999999999"}, "WORLD_SIZE='99999999999' is not a non-neg"),
        ({"RANK": "0", "WORLD_SIZE": "4294967296"}, "WORLD_SIZE=4294967296 is out of range"),
        ({"RANK": "\u0663", "WORLD_SIZE": "4"}, "RANK=.* is not a non-negative integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "2"},
            r"GROUP_RANK=2 is not below WORLD_SIZE=2: the torchrun variables disagree",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "local rank < local size <= world size",
        ),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({**TORCHRUN, "MASTER_PORT": "x"}, "MASTER_PORT='x' is not a non-negative integer"),
        (
            {**OMPI, "SM_HOSTS": "[" * 100_000 + "]" * 100_000, "SM_CURRENT_HOST": "a"},
            "SM_HOSTS=.* is not a JSON list of host names",
        ),
    ],
)
def test_errors_name_the_variable(env, message):
    with pytest.raises(L.LaunchEnvError, match=message):
        L.detect(env)


def test_export_fills_only_what_is_unset():
    env = {**OMPI, "SMDATAPARALLEL_SERVER_ADDR": "h0", "RANKS_UNRELATED": "x"}
    info = L.export_torch_variables(env)
    assert info.launcher == L.OPENMPI
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "h0" and env["MASTER_PORT"] == str(L.DEFAULT_MASTER_PORT)
    assert "GROUP_RANK" not in env
    # A second call reads the torchrun variables it wrote; a user's MASTER_PORT stays.
    env2 = {**TORCHRUN, **OMPI}
    L.export_torch_variables(env2)
    assert env2["MASTER_PORT"] == "7777" and env2["RANK"] == "1"
    assert L.export_torch_variables({}) is None
    # A blank variable (`mpirun -x MASTER_ADDR` of an empty shell variable) is unset.
    env3 = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": " ", "MASTER_PORT": ""}
    L.export_torch_variables(env3)
    assert env3["MASTER_ADDR"] == L.LOCAL_HOST_ADDRESS
    assert env3["MASTER_PORT"] == str(L.DEFAULT_MASTER_PORT)


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),
        ("login1,gpu[1-2],cpu3", ["login1", "gpu1", "gpu2", "cpu3"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("x[3]y", ["x3y"]),
        ("ip-10-0-1-[5,7]", ["ip-10-0-1-5", "ip-10-0-1-7"]),
        (" a , b ", ["a", "b"]),
    ],
)
def test_parse_nodelist(text, hosts):
    assert L.parse_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty host entry"),
        ("a,,b", "empty host entry"),
        ("a[1-2", "leaves a bracket open"),
        ("a]1", "closes a bracket it never opened"),
        ("a[[1]]", "nests brackets"),
        ("a[2-1]", "lo > hi"),
        ("a[1-b]", "expected a number or a range"),
        ("a[]", "expected a number or a range"),
        ("a[0-9999999999]", "more than 1048576 hosts"),
        ("a[0-1023]b[0-1023]c[0-1]", "more than 1048576 hosts"),
        # Host names are bounded: a long prefix or zero padding times many hosts took
        # gigabytes, and thousands of groups Python's recursion limit.
        ("a" * 300 + "[1-2]", "host name longer than 253 characters"),
        ("n[" + "0" * 300 + "1-2]", "more than 253 digits"),
        ("n" + "[1]" * 5000, "host name longer than 253 characters"),
        ("a[\u0661-\u0662]", "expected a number or a range"),  # Arabic-Indic digits
        # A long value is quoted cut short.
        ("a[" + "x" * 5000 + "]", r"^'a\[x{98}'\.\.\. \(5003 characters\) has 'x{100}'\.\.\. "),
    ],
)
def test_parse_nodelist_errors(text, message):
    with pytest.raises(ValueError, match=message):
        L.parse_nodelist(text)


def test_parse_tasks_per_node():
    assert L.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert L.parse_tasks_per_node("8") == [8]
    assert L.parse_tasks_per_node("1,2(x2)") == [1, 2, 2]
    for bad in ("", "2(x)", "x", "2(x0)", "2(x99999999)", "1(x3)2", "\u0662"):
        with pytest.raises(ValueError):
            L.parse_tasks_per_node(bad)


def test_restart_warning_names_the_fix():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    message = L.restart_warning(env)
    assert "--max-restarts 3" in message and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message
    assert L.restart_warning({**env, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert L.restart_warning({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert L.restart_warning({"TORCHELASTIC_MAX_RESTARTS": "3"}) is None
    assert L.restart_warning({**env, "TORCHELASTIC_MAX_RESTARTS": "x"}) is None


def test_smddp_import_tolerates_partial_variables_of_a_script_that_builds_its_group():
    # A stray WORLD_SIZE (exported in a batch script) reads as a torchrun launch without RANK.
    # The import warns; the script's own init_process_group with explicit ranks still works.
    import os
    import subprocess
    import sys

    script = (
        "import socket\n"
        "import smdistributed.dataparallel.torch.torch_smddp\n"
        "import torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('smddp', init_method=f'tcp://127.0.0.1:{port}', rank=0, "
        "world_size=1)\n"
        "print('group', dist.get_world_size())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in L.VARIABLES}
    env["WORLD_SIZE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group 1" in done.stdout
    assert "RANK is not set" in done.stderr  # the warning names what is missing


def test_smddp_local_rank_follows_local_rank_where_unset():
    # Hugging Face's Trainer reads SMDATAPARALLEL_LOCAL_RANK under SageMaker's data parallelism.
    env = {"LOCAL_RANK": "3"}
    L.export_smddp_variables(env)
    assert env["SMDATAPARALLEL_LOCAL_RANK"] == "3"
    kept = {"LOCAL_RANK": "3", "SMDATAPARALLEL_LOCAL_RANK": "1"}
    L.export_smddp_variables(kept)
    assert kept["SMDATAPARALLEL_LOCAL_RANK"] == "1"
    alone: dict[str, str] = {}
    L.export_smddp_variables(alone)
    assert alone == {}
    # Under mpirun, LOCAL_RANK comes from export_torch_variables first.
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    L.export_torch_variables(mpi)
    L.export_smddp_variables(mpi)
    assert mpi["SMDATAPARALLEL_LOCAL_RANK"] == "1"
