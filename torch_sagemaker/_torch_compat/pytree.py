"""Private ``torch.utils._pytree``: flattening nested containers of tensors.

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from torch.utils._pytree import tree_leaves

__all__ = ["tree_leaves"]
