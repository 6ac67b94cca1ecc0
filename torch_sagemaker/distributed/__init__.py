"""Distributed pieces of torch_sagemaker: the smddp backend, the mesh, checkpoints."""

from torch_sagemaker.distributed.backend import BACKEND_NAME, is_available, register
from torch_sagemaker.distributed.options import SMDDPOptions

__all__ = ["BACKEND_NAME", "SMDDPOptions", "is_available", "register"]
