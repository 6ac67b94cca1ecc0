"""SMP's package ``torch.sagemaker.distributed``: only SMP's import paths live under it.

``checkpoint`` and ``fsdp.checkpoint`` re-export ``torch_sagemaker.checkpoint``, the one
checkpoint package; nothing here defines anything. The smddp backend's Python side is
``torch_sagemaker.smddp``, the mesh is built by ``torch_sagemaker.mesh`` and the launchers'
variables are read by ``torch_sagemaker.launch_env``.
"""
