"""Hugging Face attention replacements with SMP's module paths
(``torch.sagemaker.nn.huggingface``)."""
