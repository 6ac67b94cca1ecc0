"""Private ``torch.nn`` helpers: swapping a module's parameters for the length of a call.

Checked on torch 2.11, 2.13.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module


def parameters_swapped(
    module: nn.Module, tensors: dict[str, torch.Tensor]
) -> AbstractContextManager[None]:
    """A context in which ``module``'s parameters named in ``tensors`` are those tensors.

    What ``torch.func.functional_call`` does around its call, without calling the module
    (its hooks would run twice when this is used inside the module's own forward). Autograd
    flows into the given tensors; the parameters are put back on exit.
    """
    return _reparametrize_module(module, tensors)
