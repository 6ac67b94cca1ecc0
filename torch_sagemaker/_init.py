"""``tsm.init()``: config -> process group -> layout -> mesh and groups -> ``tsm.state``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import torch_sagemaker.offload  # noqa: F401  routes torch's offload_wrapper (offload/torch_patch.py)
from torch_sagemaker import config as config_lib
from torch_sagemaker import topology
from torch_sagemaker.distributed import backend as backend_lib
from torch_sagemaker.distributed.mesh import build_groups
from torch_sagemaker.logger import log_rank0, warn_once
from torch_sagemaker.sharding import fsdp1, fsdp1_state_dict
from torch_sagemaker.state import state

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _ensure_process_group() -> None:
    """Initializes the default process group from torchrun's variables if there is none."""
    if dist.is_initialized():
        return
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]  # noqa: TID251
    if missing:
        raise RuntimeError(
            "torch.sagemaker.init() needs a default process group. Either call "
            "torch.distributed.init_process_group('smddp') first, or launch with torchrun, which sets "
            f"{', '.join(_TORCHRUN_VARS)} (missing here: {', '.join(missing)})."
        )
    backend = backend_lib.default_backend()
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
    log_rank0(f"tsm.init: created the default process group on backend {backend!r} from torchrun's environment")


def init(config: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
    """Initializes SMP: validates the config and builds the rank layout, mesh and groups.

    Args:
        config: A dict of SMP parameters, a path to a JSON file holding one, or ``None``.
            Values from the ``SM_HP_MP_PARAMETERS`` environment variable win over it, and
            values assigned on ``tsm.state`` before ``init`` win over both.

    Raises:
        ConfigError: Every problem in the config at once (a ``ValueError``).
        RuntimeError: If there is no process group and no torchrun environment, or if
            ``init`` was already called with a different config.

    Example:
        >>> import torch.sagemaker as tsm
        >>> tsm.init({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2})
    """
    # 1. Merge the sources (argument < environment < pre-init overrides).
    raw = config_lib.load_raw(config, overrides=state.overrides)
    # 2. Make sure there is a default process group.
    _ensure_process_group()
    # 3. Validate everything against the world size, reporting all problems together.
    cfg = config_lib.validate(raw, world_size=dist.get_world_size())
    if state.initialized:
        if cfg == state.config:
            return
        raise RuntimeError(
            "torch.sagemaker.init() was already called with a different config:\n"
            f"  before: {state.config}\n  now:    {cfg}\n"
            "Call it once per process (tsm.state.reset() exists for tests)."
        )
    # 4. Resolve the layout (pure arithmetic), then 5. build the mesh and groups (collective).
    layout = topology.resolve(
        dist.get_world_size(),
        hybrid_shard_degree=cfg.hybrid_shard_degree,
        tensor_parallel_degree=cfg.tensor_parallel_degree,
        context_parallel_degree=cfg.context_parallel_degree,
        expert_parallel_degree=cfg.expert_parallel_degree,
    )
    groups = build_groups(layout)
    # 6. Publish the state, make FSDP1 follow it (and accept SMP's translate_on_save), and log
    # the layout once.
    state._set(cfg, layout, groups)
    fsdp1.install()
    fsdp1_state_dict.install()
    log_rank0(f"tsm.init on backend {dist.get_backend()!r}:\n{layout.describe()}")
    if cfg.allow_empty_shards:
        warn_once("allow_empty_shards=true has no effect here: FSDP1's and FSDP2's sharded state "
                  "dicts are DTensors, which DCP saves and loads with empty shards anyway.")


def is_initialized() -> bool:
    """Whether ``torch.sagemaker.init()`` has completed in this process."""
    return state.initialized
