"""Hugging Face attention replacements with SMP's module paths.

The package is ``torch.sagemaker.nn.huggingface``.
"""
