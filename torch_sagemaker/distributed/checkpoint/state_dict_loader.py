"""SMP's module path: re-exports ``torch_sagemaker.checkpoint.state_dict_loader``.

SMP's scripts import ``torch.sagemaker.distributed.checkpoint.state_dict_loader``. The code
lives in the home module; nothing is defined here (tests/unit/test_smp_api_surface.py checks
that each name is the home module's own object).
"""

from torch_sagemaker.checkpoint.state_dict_loader import (
    check_state_dict_matches,
    load,
    read_metadata,
)

__all__ = ["check_state_dict_matches", "load", "read_metadata"]
