"""Checkpoint helpers with SMP's module paths (``torch.sagemaker.checkpoint``).

The save/load machinery itself lives in ``torch_sagemaker.distributed.checkpoint``.
"""
