"""``tsm.init()``: config -> process group -> layout -> sharding plan -> groups -> ``tsm.state``."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

import torch_sagemaker.offload  # noqa: F401  routes torch's offload_wrapper (offload/torch_patch.py)
from torch_sagemaker import config as config_lib
from torch_sagemaker import env_settings, launch_env, sharding_plan, topology
from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker.logger import log_rank0, warn_once
from torch_sagemaker.mesh import build_groups
from torch_sagemaker.sharding import ddp, fsdp1, fsdp1_state_dict
from torch_sagemaker.smddp import backend as backend_lib
from torch_sagemaker.state import ranks_per_host, state


def _read_launcher() -> launch_env.LaunchInfo | None:
    """Exports the torchrun variables the launcher implies, where unset (docs/launch.md).

    Whatever started the job (torchrun, mpirun, srun), ``env://``, ``_set_cuda_device`` and
    ``tsm.state.local_rank`` then read the same values under every launcher.

    Raises:
        LaunchEnvError: The launcher's variables are missing or inconsistent and there is no
            process group yet (a script that built its group itself is not held to them).
    """
    warning = launch_env.restart_warning()
    if warning:
        warn_once(warning)
    try:
        return launch_env.export_torch_variables()
    except launch_env.LaunchEnvError:
        if dist.is_initialized():
            return None
        raise


def _ensure_process_group(info: launch_env.LaunchInfo | None) -> None:
    """Initializes the default process group from the launcher's variables if there is none."""
    if dist.is_initialized():
        return
    if info is None:
        raise RuntimeError(
            "torch.sagemaker.init() needs a default process group. Either call "
            "torch.distributed.init_process_group('smddp') first, or start the job with a "
            "launcher: torchrun (RANK, WORLD_SIZE), mpirun (OMPI_COMM_WORLD_RANK or PMI_RANK) "
            "or srun (SLURM_PROCID); none of these variables is set here. docs/launch.md "
            "lists each way to start a job."
        )
    backend = backend_lib.default_backend(env_settings.cuda_backend())
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
    log_rank0(
        f"tsm.init: created the default process group on backend {backend!r} from "
        f"{info.launcher}'s environment (master {info.master_addr}:{info.master_port}, "
        f"from {info.sources['master_addr']})"
    )


def _set_cuda_device() -> None:
    """Makes GPU ``LOCAL_RANK`` (modulo the GPUs on the host) current, as torchrun users expect.

    Without ``LOCAL_RANK`` (a launcher that does not set it) the current device is left as the
    script set it; SMP's scripts call ``torch.cuda.set_device(rank % device_count)`` after
    ``tsm.init()``, which picks the same GPU on hosts with equal ranks per host.
    """
    if not torch.cuda.is_available():
        return
    local_rank = os.environ.get("LOCAL_RANK", "")  # noqa: TID251  set by torchrun, not a config
    # ASCII digits, at most as many as launch_env takes: isdigit() alone also takes "²", which
    # int() refused with a raw ValueError, as it refuses more than 4300 digits.
    if not (local_rank.isascii() and local_rank.isdigit() and len(local_rank) <= 10):
        return
    torch.cuda.set_device(int(local_rank) % torch.cuda.device_count())


def init(config: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
    """Initializes SMP: validates the config and builds the rank layout, mesh and groups.

    Args:
        config: A dict of SMP parameters, a path to a JSON file holding one, or ``None``.
            Values from the ``SM_HP_MP_PARAMETERS`` environment variable win over it, and
            values assigned on ``tsm.state`` before ``init`` win over both.

    Raises:
        ConfigError: Every problem in the config at once (a ``ValueError``), on every rank;
            also when ranks call it with different configs (naming the ranks and keys).
        LaunchEnvError: There is no process group and the launcher's variables are missing
            or inconsistent (a ``RuntimeError`` naming the variable).
        RuntimeError: If there is no process group and no launcher's variables, or if
            ``init`` was already called with a different config.

    Example:
        >>> import torch.sagemaker as tsm
        >>> tsm.init({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2})
    """
    # 1. Read the launcher, pick this rank's GPU, and make sure there is a default group.
    launcher = _read_launcher()
    _set_cuda_device()
    _ensure_process_group(launcher)
    # 2. Merge the sources (argument < environment < pre-init overrides) and 3. validate
    # everything against the world size, reporting all problems together; 4. every rank must
    # have the same config (or the same problems), checked with one small collective.
    try:
        cfg, error = (
            config_lib.validate(
                config_lib.load_raw(config, overrides=state.overrides),
                world_size=dist.get_world_size(),
            ),
            None,
        )
    except config_lib.ConfigError as e:
        cfg, error = None, e
    hosts_of = ranks_per_host(dist.get_world_size())
    _same_on_every_rank(cfg, error, hosts_of)
    assert cfg is not None  # _same_on_every_rank raised this rank's error
    if state.initialized:
        if cfg == state.config:
            return
        raise RuntimeError(
            "torch.sagemaker.init() was already called with a different config:\n"
            f"  before: {state.config}\n  now:    {cfg}\n"
            "Call it once per process (tsm.state.reset() exists for tests)."
        )
    # 5. Resolve the layout and the sharding plan (pure), then 6. build every group the plan
    # uses, host-local ones included (collective).
    plan = _resolve_plan(cfg, dist.get_world_size(), hosts_of)
    layout = plan.layout
    groups = build_groups(plan)
    # With degree 0 and TP 1 on several hosts, the one-host candidate too (Note [Degree 0
    # with a hybrid strategy] in sharding_plan.py): the first FSDP1 root picks one.
    host = None
    if plan.host_plan is not None:
        host = (plan.host_plan, build_groups(plan.host_plan))
    # 7. Publish the state, make FSDP1 follow it (and accept SMP's translate_on_save), make
    # DDP refuse DTensor parameters (Note [DDP and DTensor parameters]), and log the layout
    # and the plan once.
    state._set(cfg, plan, groups, host)
    fsdp1.install()
    fsdp1_state_dict.install()
    ddp.install()
    log_rank0(
        f"tsm.init on backend {dist.get_backend()!r}:\n{layout.describe()}\n{plan.describe()}"
    )
    if cfg.allow_empty_shards:
        warn_once(
            "allow_empty_shards=true has no effect here: FSDP1's and FSDP2's sharded state "
            "dicts are DTensors, which DCP saves and loads with empty shards anyway."
        )


def _resolve_plan(
    cfg: config_lib.SMPConfig, world_size: int, ranks_per_host: int
) -> sharding_plan.ShardingPlan:
    """The layout and the sharding plan of a validated config: pure arithmetic, no groups."""
    layout = topology.resolve(
        world_size,
        hybrid_shard_degree=cfg.hybrid_shard_degree,
        tensor_parallel_degree=cfg.tensor_parallel_degree,
        context_parallel_degree=cfg.context_parallel_degree,
        expert_parallel_degree=cfg.expert_parallel_degree,
    )
    return sharding_plan.resolve(layout, ranks_per_host)


def dry_run(
    config: str | os.PathLike[str] | Mapping[str, Any] | None,
    *,
    world_size: int,
    ranks_per_host: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[config_lib.SMPConfig, sharding_plan.ShardingPlan]:
    """What ``tsm.init(config)`` checks and decides on ``world_size`` ranks, with no group.

    The same steps as ``init`` (merge the sources, validate, resolve the layout and the
    sharding plan), with the world size and the ranks per host given instead of read from the
    process group and the launcher. No process group is needed or created and ``tsm.state``
    is left alone (values assigned on it before ``init`` win, as in ``init``); a config this
    accepts is one ``init`` accepts on such a job (the parallelism planner checks its output
    with it).

    Args:
        config: As for ``init``: a dict, a JSON file path, or ``None``.
        world_size: Number of ranks of the job.
        ranks_per_host: Ranks on one host (``LOCAL_WORLD_SIZE``); default ``world_size``.
        environ: Environment whose ``SM_HP_MP_PARAMETERS`` is merged as ``init`` merges it
            (default ``os.environ``; pass ``{}`` to leave it out).

    Returns:
        The validated config and the sharding plan ``init`` would publish.

    Raises:
        ConfigError: Every problem in the config at once, as ``init`` raises it.
        TypeError: If ``world_size`` or ``ranks_per_host`` is not an integer.
        ValueError: If ``world_size`` or ``ranks_per_host`` is not in [1, 2**31 - 1], or
            ``ranks_per_host`` exceeds ``world_size``.
    """
    for name, value in (("world_size", world_size), ("ranks_per_host", ranks_per_host)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"dry_run({name}={value!r}): must be an integer.")
        if value is not None and not 1 <= value <= config_lib.MAX_COUNT:
            raise ValueError(
                f"dry_run({name}={config_lib.show_value(value)}): must be in [1, 2**31 - 1]."
            )
    if ranks_per_host is not None and ranks_per_host > world_size:
        raise ValueError(
            f"dry_run(ranks_per_host={ranks_per_host}): must be at most world_size={world_size} "
            "(the ranks of one host are ranks of the job)."
        )
    cfg = config_lib.validate(
        config_lib.load_raw(config, environ=environ, overrides=state.overrides),
        world_size=world_size,
    )
    return cfg, _resolve_plan(cfg, world_size, ranks_per_host or world_size)


#: The key under which ``_same_on_every_rank`` compares the ranks per host.
_LOCAL_SIZE = "LOCAL_WORLD_SIZE"


def _same_on_every_rank(
    cfg: config_lib.SMPConfig | None, error: config_lib.ConfigError | None, local_size: int
) -> None:
    """Raises on every rank unless every rank validated the same config on equal hosts.

    One all-gather of a 64-bit digest of this rank's config (or of its problems) and of its
    host's rank count (``LOCAL_WORLD_SIZE``); only when the digests differ are the configs
    themselves gathered, to name the ranks and keys. The layout has one number of ranks per
    host: ranks that disagree on it (``srun -n 10 -N 3`` puts 4, 4 and 2 on the hosts) would
    build different sharding plans and run mismatched collectives.

    Raises:
        ConfigError: This rank's own problems; or, on a rank whose config is valid, which
            ranks have an invalid one, which keys differ between ranks, or that hosts hold
            different numbers of ranks.
    """
    # Exactly one of cfg and error is set.
    mine = (
        {**cfg.to_dict(), _LOCAL_SIZE: local_size}
        if cfg is not None
        else {"problems": cast(config_lib.ConfigError, error).problems}
    )
    text = json.dumps(mine, sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    device = c10d_compat.object_collective_device()
    digests = [
        torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())
    ]
    dist.all_gather(digests, torch.tensor([digest], dtype=torch.int64, device=device))
    if len({int(d.item()) for d in digests}) == 1:
        if error is not None:
            raise error
        return
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    if error is not None:
        raise error
    invalid = [r for r, v in enumerate(views) if "problems" in v]
    if invalid:
        raise config_lib.ConfigError(
            [
                f"ranks {invalid} got an invalid config (rank {invalid[0]}: "
                f"{views[invalid[0]]['problems'][0]}) while this rank's is valid. Every rank must "
                "call tsm.init with the same config (the same dict or file, and the same "
                f"{config_lib.ENV_VAR})."
            ],
            "SMP config across ranks",
        )
    problems = []
    for key in (*config_lib.FIELD_NAMES, _LOCAL_SIZE):
        ranks_by_value: dict[Any, list[int]] = {}
        for r, v in enumerate(views):
            ranks_by_value.setdefault(v[key], []).append(r)
        if len(ranks_by_value) > 1:
            spread = ", ".join(
                f"{config_lib.show_value(value)} on ranks {ranks}"
                for value, ranks in ranks_by_value.items()
            )
            if key == _LOCAL_SIZE:
                problems.append(
                    f"hosts hold different numbers of ranks ({_LOCAL_SIZE}: {spread}): "
                    "tsm's layout needs the same number on every host. Start as many "
                    "processes on each host (torchrun --nproc-per-node, srun "
                    "--ntasks-per-node, mpirun -npernode)."
                )
                continue
            problems.append(
                f"{key} differs across ranks: {spread}. Every rank must call tsm.init "
                "with the same config (the same dict or file, and the same "
                f"{config_lib.ENV_VAR})."
            )
    raise config_lib.ConfigError(problems, "SMP config across ranks")


def is_initialized() -> bool:
    """Whether ``torch.sagemaker.init()`` has completed in this process."""
    return state.initialized
