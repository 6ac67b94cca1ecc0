"""Private names of FSDP2 (``fully_shard``): its parameter group class and that group's groups.

``FSDPParamGroup`` is the class whose ``__init__`` the package wraps
(``smddp/fsdp2_buffers.py``); every ``fully_shard`` call with parameters builds one. A
module's group is reached through ``FSDPModule._get_fsdp_state()._fsdp_param_group``
(``sharding/replica_reduction.py`` hooks its sharded parameters). ``FSDPState._lazy_init``
is what the root's first forward runs first (``tensor_parallel/generation.py`` runs it before
``generate``).

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def all_gather_process_group(param_group: FSDPParamGroup) -> dist.ProcessGroup:
    """The process group the parameter group all-gathers its parameters over."""
    return param_group._all_gather_process_group


def reduce_scatter_process_group(param_group: FSDPParamGroup) -> dist.ProcessGroup:
    """The process group the parameter group reduce-scatters its gradients over."""
    return param_group._reduce_scatter_process_group


def param_group_of(module: Any) -> FSDPParamGroup | None:
    """The parameter group ``fully_shard(module)`` made, ``None`` when it holds no parameter."""
    return module._get_fsdp_state()._fsdp_param_group


def lazy_init_root(module: Any) -> None:
    """What the first forward of ``module`` runs first: FSDP2's lazy initialization.

    With no forward run yet, ``module`` becomes the root and the ``fully_shard`` modules
    below it are initialized as not roots. A no-op once any forward through ``module`` (or a
    root above it) has run.
    """
    module._get_fsdp_state()._lazy_init()


def sharded_params(param_group: FSDPParamGroup) -> list[Any]:
    """The group's sharded parameters: the objects whose ``.grad`` its reduction assigns.

    ``fully_shard`` registers them on the modules between forwards; FSDP2 replaces them when
    a state dict is loaded with ``assign=True``, so callers look them up again.
    """
    return [fsdp_param.sharded_param for fsdp_param in param_group.fsdp_params]


__all__ = [
    "FSDPParamGroup",
    "all_gather_process_group",
    "lazy_init_root",
    "param_group_of",
    "reduce_scatter_process_group",
    "sharded_params",
]
