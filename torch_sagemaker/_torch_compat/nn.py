"""Private ``torch.nn`` names: module internals and swapping parameters for one call.

A module's own parameter and buffer dictionaries, its ``state_dict`` hooks, and
``_reparametrize_module``.

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

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


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The dictionary of ``module``'s own (non-recursive) parameters, itself, not a copy.

    Assigning an entry replaces the parameter without ``register_parameter``'s checks and
    hooks (and without ``__setattr__``'s).
    """
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The dictionary of ``module``'s own (non-recursive) buffers, itself, not a copy."""
    return module._buffers


def state_dict_pre_hooks(module: nn.Module) -> OrderedDict[int, Callable[..., Any]]:
    """The module's ``state_dict`` pre-hooks by handle id, in calling order (reorderable)."""
    return cast(OrderedDict, module._state_dict_pre_hooks)


def register_state_dict_hook(module: nn.Module, hook: Callable[..., Any]) -> None:
    """Adds a ``state_dict`` post-hook ``hook(module, state_dict, prefix, local_metadata)``.

    The hook runs after those registered before it (FSDP1's own, for an FSDP unit) and may
    change ``state_dict`` in place.
    """
    module._register_state_dict_hook(hook)
