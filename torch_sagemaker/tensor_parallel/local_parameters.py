"""Running a module's forward on the local values of its replicated DTensor parameters.

Styles that compute a replicated module locally (``styles.ReplicateParallel``,
``replicated_styles.ReplicatedLocal``) swap each DTensor parameter for its local tensor
around the module's own forward.

Note [Replicated parameters under FSDP1]: for its forward, FSDP1 with
``use_orig_params=True`` sets each unsharded parameter as an instance attribute of its module
(a DTensor for a TP parameter), which attribute lookup finds before the registered parameter
of the same name (a stale sharded view); ``named_parameters()`` lists the registered ones.
Swapping those left the forward with DTensor weights and plain activations ("mixed
torch.Tensor and DTensor": Qwen3 and Gemma on their transformers plans, Mixtral's router).
So the parameters are named once, when the style is applied, then read as attributes at
each call, and an instance attribute is swapped in the instance's dictionary. Outside FSDP
the attribute is the registered parameter itself, swapped as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import nn as nn_compat


def parameter_names(module: nn.Module) -> list[str]:
    """Every name of ``module``'s parameters (tied ones under each of their names)."""
    return [n for n, _ in module.named_parameters(remove_duplicate=False)]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _to_local(param: DTensor) -> torch.Tensor:
    return param.to_local()


@contextlib.contextmanager
def local_parameters(
    module: nn.Module,
    names: list[str],
    local_of: Callable[[DTensor], torch.Tensor] = _to_local,
) -> Iterator[None]:
    """``module``'s DTensor parameters ``names`` are their local tensors inside the block.

    Autograd flows from the local tensors into the DTensors. Note [Replicated parameters
    under FSDP1].

    Args:
        module: The module whose forward runs in the block.
        names: Its parameters' names (``parameter_names``, taken when the style was applied).
        local_of: The tensor that stands for a DTensor parameter (default: its local tensor).
    """
    registered: dict[str, torch.Tensor] = {}
    shadowed: list[tuple[nn.Module, str, DTensor]] = []
    for name in names:
        owner, leaf = _owner(module, name)
        value = getattr(owner, leaf, None)
        if not isinstance(value, DTensor):
            continue
        if leaf in vars(owner):  # FSDP1's instance attribute hides the registered parameter
            shadowed.append((owner, leaf, value))
        else:
            registered[name] = local_of(value)
    with nn_compat.parameters_swapped(module, registered):
        try:
            for owner, leaf, value in shadowed:
                vars(owner)[leaf] = local_of(value)
            yield
        finally:
            for owner, leaf, value in reversed(shadowed):
                vars(owner)[leaf] = value


__all__ = ["local_parameters", "parameter_names"]
