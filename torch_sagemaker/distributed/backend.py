"""Registers the native "smddp" collective backend with torch.distributed.

The backend itself is C++ (``csrc/``, compiled into ``torch_sagemaker._C``); this module
only decides whether it can be used and registers its creator under the name "smddp" for
CPU tensors. Importing ``torch_sagemaker`` (or the SMP compatibility shim
``smdistributed.dataparallel.torch.torch_smddp``) calls ``register()``.
"""

from __future__ import annotations

import torch.distributed as dist

BACKEND_NAME = "smddp"


def is_available() -> bool:
    """Whether the native smddp backend was compiled into ``torch_sagemaker._C``."""
    try:
        from torch_sagemaker import _C
    except ImportError:
        return False
    return bool(getattr(_C, "has_smddp_backend", False))


def is_registered() -> bool:
    """Whether "smddp" is a registered torch.distributed backend in this process."""
    return BACKEND_NAME in dist.Backend.backend_list


def register() -> bool:
    """Registers "smddp" with torch.distributed if it is available (idempotent).

    Returns:
        True if the backend is registered after the call.
    """
    if is_registered():
        return True
    if not is_available():
        return False
    from torch_sagemaker import _C

    dist.Backend.register_backend(BACKEND_NAME, _C.create_backend, extended_api=True, devices=["cpu"])
    return True


def default_backend() -> str:
    """The backend ``tsm.init`` uses when it creates the process group itself."""
    return BACKEND_NAME if register() else "gloo"
