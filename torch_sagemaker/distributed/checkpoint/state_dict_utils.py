"""SMP's module path: re-exports ``torch_sagemaker.checkpoint.state_dict_utils``.

SMP's scripts import ``torch.sagemaker.distributed.checkpoint.state_dict_utils``. The code
lives in the home module; nothing is defined here (tests/unit/test_smp_api_surface.py checks
that each name is the home module's own object).
"""

from torch_sagemaker.checkpoint.state_dict_utils import (
    SMP_IS_LOAD_INFO_KEY,
    SMP_IS_PARTIAL_KEY,
    SMLocalStateDict,
    SMStateDictType,
    _Interval,
    compute_auto_checkpoint_interval,
    current_layout,
    init_optim_state,
    load_local_optim_state_dict,
    load_local_state_dict,
    local_optim_state_dict,
    local_state_dict,
    local_subdir,
    resolve_stateful,
    shard_coordinates,
    sm_state_dict_type,
)

__all__ = [
    "SMP_IS_LOAD_INFO_KEY",
    "SMP_IS_PARTIAL_KEY",
    "SMLocalStateDict",
    "_Interval",
    "compute_auto_checkpoint_interval",
    "SMStateDictType",
    "current_layout",
    "init_optim_state",
    "load_local_optim_state_dict",
    "load_local_state_dict",
    "local_optim_state_dict",
    "local_state_dict",
    "local_subdir",
    "resolve_stateful",
    "shard_coordinates",
    "sm_state_dict_type",
]
