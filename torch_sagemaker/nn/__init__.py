"""SMP's attention modules (``torch.sagemaker.nn``).

``attn`` and ``huggingface.llama_flashattn``.
"""
