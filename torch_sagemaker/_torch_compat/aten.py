"""Private ATen operators (``torch.ops.aten._*``), called directly.

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

import torch

#: The CPU flash-attention kernel behind ``F.scaled_dot_product_attention``: returns the
#: output and the row-wise log-sum-exp, takes grouped kv heads.
FLASH_ATTENTION_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

#: Its backward; accepts an output and log-sum-exp computed elsewhere.
FLASH_ATTENTION_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

__all__ = ["FLASH_ATTENTION_CPU", "FLASH_ATTENTION_CPU_BACKWARD"]
