"""Where this process stands in the job, read from whatever launcher started it.

SMP jobs start in several ways, and each launcher describes a rank in its own variables
(rank and size; rank and size on the host; host index):

- torchrun / torchelastic, and any ``env://`` launch: ``RANK``, ``WORLD_SIZE``;
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; ``GROUP_RANK``.
- OpenMPI's ``mpirun`` (SageMaker's smdistributed and pytorchddp launchers):
  ``OMPI_COMM_WORLD_RANK``, ``_SIZE``; ``OMPI_COMM_WORLD_LOCAL_RANK``, ``_LOCAL_SIZE``;
  the index of ``SM_CURRENT_HOST`` in ``SM_HOSTS`` on SageMaker.
- MPICH and Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``; ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``; as OpenMPI.
- SLURM's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``; ``SLURM_LOCALID``, this
  host's entry of ``SLURM_STEP_TASKS_PER_NODE``; ``SLURM_NODEID``.

``detect`` picks the first launcher of that table whose rank variable is set (so ``srun
torchrun`` and ``mpirun`` inside a SLURM allocation are read as torchrun and mpirun) and
returns a ``LaunchInfo``; ``export_torch_variables`` writes the torchrun variables that are
missing, so that ``dist.init_process_group`` (``env://``) and every tool that reads them work
under any launcher. docs/launch.md has the full precedence and the defaults.

Note [Master address]: the address of rank 0's host, where the TCPStore listens. In order:
``MASTER_ADDR``; ``SMDATAPARALLEL_SERVER_ADDR`` (SMDDP's ``smddprun`` and SageMaker's
training toolkit with several hosts); under SLURM, the first host of the step's node list;
on SageMaker with several hosts, the first of ``SM_HOSTS`` (the toolkit's own choice of
master); and for a job on one host, ``127.0.0.1``. A job on several hosts with none of
these is an error naming ``MASTER_ADDR``. The port is ``MASTER_PORT``, else
``SMDATAPARALLEL_SERVER_PORT``, else ``DEFAULT_MASTER_PORT`` (torchrun's default).

This module imports nothing from torch: it is pure parsing, unit-tested without processes.
The syntax of the values (SLURM's node lists and task counts) and the bounds on what the
environment may say are in ``launch_syntax``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, MutableMapping

from torch_sagemaker.launch_syntax import (
    MAX_COUNT,
    parse_nodelist,
    parse_tasks_per_node,
    show,
)

#: The port of the TCPStore when no variable names one (torchrun's default).
DEFAULT_MASTER_PORT = 29500
#: The address used when every rank runs on this host and no address was given.
LOCAL_HOST_ADDRESS = "127.0.0.1"

#: Every variable this module reads (docs/config.md lists each).
VARIABLES = (
    # torchrun / torchelastic
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT",
    # OpenMPI
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    # MPICH and Intel MPI (Hydra)
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    # SLURM (srun)
    "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
    "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    # SageMaker and SMDDP
    "SM_HOSTS", "SM_CURRENT_HOST", "SMDATAPARALLEL_SERVER_ADDR", "SMDATAPARALLEL_SERVER_PORT",
    # torchelastic's restarts (Note [Restarts and the shared store])
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS",
)  # fmt: skip

TORCHRUN = "torchrun"
OPENMPI = "OpenMPI"
MPICH = "MPICH/Intel MPI"
SLURM = "SLURM"


class LaunchEnvError(RuntimeError):
    """The launcher's variables are missing, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """One rank's place in the job, as its launcher described it.

    Attributes:
        launcher: Which launcher's variables were read (``TORCHRUN``, ``OPENMPI``, ``MPICH``
            or ``SLURM``).
        rank: Global rank.
        world_size: Number of ranks in the job.
        local_rank: Rank among the ranks on this host; ``None`` when the launcher did not
            say (an ``env://`` launch that sets only ``RANK`` and ``WORLD_SIZE``).
        local_world_size: Number of ranks on this host; ``None`` as for ``local_rank``.
        node_rank: Index of this host in the job; ``None`` when the launcher does not give
            one (OpenMPI and MPICH outside SageMaker).
        master_addr: Address of rank 0's host (Note [Master address]).
        master_port: Port of the TCPStore on it.
        sources: For each field above, the variable (or rule) it came from.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    node_rank: int | None
    master_addr: str
    master_port: int
    sources: Mapping[str, str]

    def torch_variables(self) -> dict[str, str]:
        """The torchrun variables that describe this rank (``RANK``, ..., ``MASTER_PORT``)."""
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        if self.local_rank is not None and self.local_world_size is not None:
            out["LOCAL_RANK"] = str(self.local_rank)
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.node_rank is not None:
            out["GROUP_RANK"] = str(self.node_rank)
        return out


def detect(environ: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """Reads this rank's place in the job from the launcher's variables.

    Args:
        environ: The environment to read (default ``os.environ``).

    Returns:
        The rank's ``LaunchInfo``, or ``None`` when no launcher's rank variable is set (a
        plain ``python script.py``).

    Raises:
        LaunchEnvError: A launcher's rank variable is set but something it needs is missing,
            not a number, out of range or inconsistent; the message names the variable, the
            launcher and the fix.
    """
    env = _read(os.environ if environ is None else environ)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi(env, OPENMPI, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")  # fmt: skip
    # Without a step id the process is the batch script itself, not a task srun started
    # (sbatch sets SLURM_PROCID=0 there too): it is a single process, as under no launcher.
    srun_task = "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)
    # srun's PMI-2 plugin (--mpi=pmi2, or MpiDefault=pmi2) sets PMI_RANK and PMI_SIZE in every
    # task too, without Hydra's MPI_LOCALRANKID: such a task is srun's, read from SLURM's
    # variables. Hydra (mpiexec) sets MPI_LOCALRANKID, also when it starts its proxies with srun.
    if "PMI_RANK" in env and not (srun_task and "MPI_LOCALRANKID" not in env):
        return _mpi(env, MPICH, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if srun_task:
        return _slurm(env)
    return None


def export_torch_variables(environ: MutableMapping[str, str] | None = None) -> LaunchInfo | None:
    """Writes the torchrun variables this rank's launcher implies, where they are unset.

    Variables already set are never changed, so nothing changes for torchrun users; a
    blank one (``mpirun -x MASTER_ADDR`` of an empty shell variable) is filled in.

    Args:
        environ: The environment to read and update (default ``os.environ``).

    Returns:
        What ``detect`` returned.

    Raises:
        LaunchEnvError: As ``detect``.
    """
    target = os.environ if environ is None else environ
    info = detect(target)
    if info is not None:
        for name, value in info.torch_variables().items():
            if not target.get(name, "").strip():  # blank: unset (as MASTER_* are read)
                target[name] = value
    return info


def export_smddp_variables(environ: MutableMapping[str, str] | None = None) -> None:
    """Writes ``SMDATAPARALLEL_LOCAL_RANK`` from ``LOCAL_RANK`` where it is unset.

    SMDDP's launcher sets it, and Hugging Face's ``Trainer`` reads it when SageMaker's data
    parallelism is on (``SM_FRAMEWORK_PARAMS`` with ``sagemaker_distributed_dataparallel_enabled``):
    it wraps the model as ``DDP(model, device_ids=[int(os.getenv("SMDATAPARALLEL_LOCAL_RANK"))])``
    and failed with a ``TypeError`` on ``None`` under any other launcher. Call after
    ``export_torch_variables``, which writes ``LOCAL_RANK`` for mpirun and srun.

    Args:
        environ: The environment to read and update (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    local_rank = environ.get("LOCAL_RANK", "").strip()
    if local_rank and not environ.get("SMDATAPARALLEL_LOCAL_RANK", "").strip():
        environ["SMDATAPARALLEL_LOCAL_RANK"] = local_rank


def restart_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """Why torchrun's restarts would fail in this job, or None when they can work.

    Note [Restarts and the shared store]: with the c10d rendezvous, torchrun (torch 2.4 and
    later, 2.11 to 2.14 included) gives its workers one TCPStore for the whole job
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across restarts. The keys a failed
    attempt wrote stay, and the restarted workers' ``init_process_group`` reads them: every
    backend (gloo's and NCCL's address exchange as much as smddp's) then connects to the dead
    attempt's ranks and fails (pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in torchrun's environment gives every attempt a store of its own.

    Args:
        environ: The environment to read (default ``os.environ``).

    Returns:
        A message naming the setting and the fix when this worker's torchrun may restart it
        (``--max-restarts`` > 0) and shares its store; else None.
    """
    env = _read(os.environ if environ is None else environ)
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() != "true":
        return None
    if not (restarts.isascii() and restarts.isdigit() and int(restarts) > 0):
        return None
    return (
        f"torchrun may restart this job (--max-restarts {restarts}) but shares one TCPStore "
        "with its workers across restarts (TORCHELASTIC_USE_AGENT_STORE=True): a restarted "
        "attempt would read the failed attempt's keys and fail to connect, on any backend. "
        "Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (docs/launch.md)."
    )


def _read(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher variables that are set (the one place this module reads the environment)."""
    return {name: environ[name] for name in VARIABLES if name in environ}


# ---------------------------------------------------------------------------- launchers


def _torchrun(env: Mapping[str, str]) -> LaunchInfo:
    launcher = TORCHRUN
    rank = _count(env, "RANK", launcher)
    world = _count(env, "WORLD_SIZE", launcher, minimum=1)
    sources = {"rank": "RANK", "world_size": "WORLD_SIZE"}
    local_rank = local_world = node = None
    # Both or neither: a LOCAL_RANK alone (DeepSpeed's launcher on several hosts) would leave
    # the ranks per host unknown, and the layout would take the whole job for one host.
    if "LOCAL_RANK" in env or "LOCAL_WORLD_SIZE" in env:
        local_rank = _count(env, "LOCAL_RANK", launcher)
        local_world = _count(env, "LOCAL_WORLD_SIZE", launcher, minimum=1)
        sources.update(local_rank="LOCAL_RANK", local_world_size="LOCAL_WORLD_SIZE")
    if "GROUP_RANK" in env:
        node = _count(env, "GROUP_RANK", launcher)
        sources["node_rank"] = "GROUP_RANK"
    return _finish(env, launcher, rank, world, local_rank, local_world, node, sources)


def _mpi(
    env: Mapping[str, str],
    launcher: str,
    rank_var: str,
    size_var: str,
    local_rank_var: str,
    local_size_var: str,
) -> LaunchInfo:
    rank = _count(env, rank_var, launcher)
    world = _count(env, size_var, launcher, minimum=1)
    local_rank = _count(env, local_rank_var, launcher)
    local_world = _count(env, local_size_var, launcher, minimum=1)
    sources = {
        "rank": rank_var,
        "world_size": size_var,
        "local_rank": local_rank_var,
        "local_world_size": local_size_var,
    }
    node = _sagemaker_node_rank(env, sources)
    return _finish(env, launcher, rank, world, local_rank, local_world, node, sources)


def _slurm(env: Mapping[str, str]) -> LaunchInfo:
    launcher = SLURM
    size_var = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    nodes_var = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    tasks_var = _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    rank = _count(env, "SLURM_PROCID", launcher)
    world = _count(env, size_var, launcher, minimum=1)
    local_rank = _count(env, "SLURM_LOCALID", launcher)
    node = _count(env, "SLURM_NODEID", launcher)
    hosts = _parsed(env, nodes_var, launcher, parse_nodelist)
    tasks = _parsed(env, tasks_var, launcher, parse_tasks_per_node)
    if len(tasks) != len(hosts) or sum(tasks) != world:
        raise LaunchEnvError(
            f"{tasks_var}={show(env[tasks_var])} gives {len(tasks)} hosts and {sum(tasks)} tasks, "
            f"but {nodes_var} lists {len(hosts)} hosts and {size_var}={world}: the {launcher} "
            "variables disagree. Start the ranks with srun inside the allocation, which sets "
            "them together."
        )
    if node >= len(hosts):
        raise LaunchEnvError(
            f"SLURM_NODEID={node} is not below the {len(hosts)} hosts of {nodes_var}: the "
            f"{launcher} variables disagree."
        )
    sources = {
        "rank": "SLURM_PROCID",
        "world_size": size_var,
        "local_rank": "SLURM_LOCALID",
        "local_world_size": f"{tasks_var}[SLURM_NODEID]",
        "node_rank": "SLURM_NODEID",
    }
    first_host = hosts[0] if len(hosts) > 1 else None
    return _finish(
        env, launcher, rank, world, local_rank, tasks[node], node, sources, first_host=first_host
    )


def _sagemaker_node_rank(env: Mapping[str, str], sources: dict[str, str]) -> int | None:
    """This host's index in ``SM_HOSTS`` on SageMaker (``SM_CURRENT_HOST``), else None."""
    if "SM_HOSTS" not in env or "SM_CURRENT_HOST" not in env:
        return None
    hosts = _sagemaker_hosts(env)
    current = env["SM_CURRENT_HOST"]
    if current not in hosts:
        raise LaunchEnvError(
            f"SM_CURRENT_HOST={current!r} is not one of SM_HOSTS={hosts!r}: the SageMaker "
            "variables disagree."
        )
    sources["node_rank"] = "SM_HOSTS.index(SM_CURRENT_HOST)"
    return hosts.index(current)


def _sagemaker_hosts(env: Mapping[str, str]) -> list[str]:
    text = env["SM_HOSTS"]
    try:
        hosts = json.loads(text) if len(text) <= 1 << 20 else None
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise LaunchEnvError(
            f"SM_HOSTS={text[:200]!r} is not a JSON list of host names (SageMaker sets it, "
            'for example \'["algo-1","algo-2"]\'); unset it or fix its value.'
        )
    return hosts


# ------------------------------------------------------------------- shared checks


def _finish(
    env: Mapping[str, str],
    launcher: str,
    rank: int,
    world: int,
    local_rank: int | None,
    local_world: int | None,
    node: int | None,
    sources: dict[str, str],
    first_host: str | None = None,
) -> LaunchInfo:
    """Checks the ranks against each other and resolves the master address and port."""
    size_var, rank_var = sources["world_size"], sources["rank"]
    if rank >= world:
        raise LaunchEnvError(
            f"{rank_var}={rank} is not below {size_var}={world}: the {launcher} variables "
            "disagree (a rank must be in [0, world size))."
        )
    if local_rank is not None and local_world is not None:
        local_size_var = sources["local_world_size"]
        if local_world > world or local_rank >= local_world:
            raise LaunchEnvError(
                f"{sources['local_rank']}={local_rank}, {local_size_var}={local_world} and "
                f"{size_var}={world} disagree: the {launcher} variables must satisfy "
                "local rank < local size <= world size."
            )
    # Every host runs at least one rank, so a host index is below the world size. (Its value
    # only travels on, as GROUP_RANK, to tools that index by host.)
    if node is not None and node >= world:
        raise LaunchEnvError(
            f"{sources['node_rank']}={node} is not below {size_var}={world}: the {launcher} "
            "variables disagree (every host runs at least one rank, so a host index must be in "
            "[0, world size))."
        )
    addr, addr_source = _master_addr(env, launcher, world, local_world, first_host)
    port, port_source = _master_port(env, launcher)
    sources.update(master_addr=addr_source, master_port=port_source)
    return LaunchInfo(launcher, rank, world, local_rank, local_world, node, addr, port, sources)


def _master_addr(
    env: Mapping[str, str],
    launcher: str,
    world: int,
    local_world: int | None,
    first_host: str | None,
) -> tuple[str, str]:
    """Note [Master address]: the address and the variable (or rule) it came from."""
    for var in ("MASTER_ADDR", "SMDATAPARALLEL_SERVER_ADDR"):
        if env.get(var, "").strip():
            return env[var].strip(), var
    if first_host is not None:
        return first_host, "the first host of the SLURM node list"
    if world == 1:
        return LOCAL_HOST_ADDRESS, "a single rank"
    sagemaker_hosts = _sagemaker_hosts(env) if "SM_HOSTS" in env else []
    if len(sagemaker_hosts) > 1:
        return sagemaker_hosts[0], "the first host of SM_HOSTS"
    if local_world is not None and local_world == world:
        return LOCAL_HOST_ADDRESS, "every rank on this host"
    why = (
        f"{launcher} reports {local_world} of {world} ranks on this host"
        if local_world is not None
        else f"{launcher} does not say which ranks share this host"
    )
    raise LaunchEnvError(
        f"MASTER_ADDR is not set, and {why}: ranks on other hosts need rank 0's address. "
        "Export MASTER_ADDR=<rank 0's host> (and MASTER_PORT) to every rank, for example "
        "`mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...`."
    )


def _master_port(env: Mapping[str, str], launcher: str) -> tuple[int, str]:
    for var in ("MASTER_PORT", "SMDATAPARALLEL_SERVER_PORT"):
        if env.get(var, "").strip():
            port = _count(env, var, launcher, minimum=1)
            if port > 65535:
                raise LaunchEnvError(f"{var}={port} is not a TCP port: use 1 to 65535.")
            return port, var
    return DEFAULT_MASTER_PORT, f"the default {DEFAULT_MASTER_PORT}"


def _first_set(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set, else the first (so the error names it)."""
    return next((n for n in names if n in env), names[0])


def _count(env: Mapping[str, str], var: str, launcher: str, minimum: int = 0) -> int:
    """``env[var]`` as an integer in [minimum, MAX_COUNT], or an error naming it."""
    if var not in env:
        raise LaunchEnvError(
            f"{var} is not set: the {launcher} launcher sets it for every rank it starts. "
            f"Start the job with the launcher, or export {var} yourself."
        )
    text = env[var].strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 10):
        raise LaunchEnvError(
            f"{var}={env[var][:40]!r} is not a non-negative integer ({launcher} variable)."
        )
    value = int(text)
    if not minimum <= value <= MAX_COUNT:
        raise LaunchEnvError(
            f"{var}={value} is out of range: {launcher}'s {var} must be in "
            f"[{minimum}, {MAX_COUNT}]."
        )
    return value


def _parsed(env: Mapping[str, str], var: str, launcher: str, parse) -> list:
    if var not in env:
        raise LaunchEnvError(
            f"{var} is not set: srun sets it for every task. Start the ranks with srun."
        )
    try:
        return parse(env[var])
    except ValueError as e:
        raise LaunchEnvError(f"{var}: {e}") from None
