"""Distributed pieces of torch_sagemaker: the smddp backend, the mesh, checkpoints."""

from torch_sagemaker.distributed.backend import BACKEND_NAME, is_available, register

__all__ = ["BACKEND_NAME", "is_available", "register"]
