"""Every private PyTorch name the package uses, behind one layer, one module per torch area.

The package supports torch 2.11 to 2.14 (docs/compatibility.md). A private name (a leading
underscore, or a module PyTorch does not document) may change in any release; reaching it
only through these modules means a new release is ported here, and each entry says on which
versions it was checked and what it does where versions differ.
"""

from __future__ import annotations

import torch

from torch_sagemaker._torch_compat.version import TORCH_VERSION, torch_at_least

__all__ = ["TORCH_VERSION", "torch", "torch_at_least"]
