"""Small helpers with SMP's module paths (``torch.sagemaker.utils.module_utils`` and friends)."""
