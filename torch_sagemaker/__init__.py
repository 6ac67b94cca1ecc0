"""torch_sagemaker: SageMaker model parallelism v2 (``import torch.sagemaker as tsm``) on PyTorch.

Public surface: ``init``, ``is_initialized``, ``state``, ``transform``, ``offload_wrapper``,
``SMPConfig``, ``__version__`` and the submodule ``grad_norm`` (``tsm.grad_norm.clip_grad_norm_``,
as SMP's documentation writes it). Importing the package registers the native "smddp"
collective backend with torch.distributed when it was compiled.
"""

from __future__ import annotations

from torch_sagemaker import grad_norm
from torch_sagemaker._init import init, is_initialized
from torch_sagemaker._transform import transform
from torch_sagemaker._version import __version__
from torch_sagemaker.checkpoint import dcp_patches as _dcp_patches
from torch_sagemaker.config import ConfigError, SMPConfig
from torch_sagemaker.offload import offload_wrapper
from torch_sagemaker.smddp import fsdp2_buffers as _fsdp2_buffers
from torch_sagemaker.smddp.backend import register as _register_backend
from torch_sagemaker.state import state

_register_backend()
# SMP's scripts bind DCP's optimizer loader at import time, before tsm.init(): patch it now.
_dcp_patches.install()
# Every fully_shard on smddp reads its buffers in place (Note [Pool buffers for every FSDP2 user]).
_fsdp2_buffers.install()


__all__ = [
    "ConfigError",
    "SMPConfig",
    "__version__",
    "grad_norm",
    "init",
    "is_initialized",
    "offload_wrapper",
    "state",
    "transform",
]
