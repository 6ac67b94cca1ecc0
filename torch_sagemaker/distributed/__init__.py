"""SMP's package ``torch.sagemaker.distributed``: only SMP's import paths live under it.

``checkpoint`` and ``fsdp.checkpoint`` re-export ``torch_sagemaker.checkpoint``, the one
checkpoint package; nothing here defines anything. The smddp backend's Python side is
``torch_sagemaker.smddp``, the mesh is built by ``torch_sagemaker.mesh`` and the launchers'
variables are read by ``torch_sagemaker.launch_env``. The backend's names are re-exported
here too, where they lived before ``torch_sagemaker.smddp`` (scripts written then import
``SMDDPOptions`` from this package).
"""

from torch_sagemaker.smddp import BACKEND_NAME, SMDDPOptions, is_available, register

__all__ = ["BACKEND_NAME", "SMDDPOptions", "is_available", "register"]
