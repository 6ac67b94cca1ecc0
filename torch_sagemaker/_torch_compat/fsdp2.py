"""Private names of FSDP2 (``fully_shard``): its parameter group class and that group's groups.

``FSDPParamGroup`` is the class whose ``__init__`` the package wraps
(``smddp/fsdp2_buffers.py``); every ``fully_shard`` call with parameters builds one.

Checked on torch 2.11, 2.13.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def all_gather_process_group(param_group: FSDPParamGroup) -> dist.ProcessGroup:
    """The process group the parameter group all-gathers its parameters over."""
    return param_group._all_gather_process_group


def reduce_scatter_process_group(param_group: FSDPParamGroup) -> dist.ProcessGroup:
    """The process group the parameter group reduce-scatters its gradients over."""
    return param_group._reduce_scatter_process_group


__all__ = ["FSDPParamGroup", "all_gather_process_group", "reduce_scatter_process_group"]
