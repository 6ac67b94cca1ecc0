"""Materializing parameters and buffers of meta-device modules.

This is ``torch.sagemaker.utils.module_utils``.

These are the building blocks of delayed parameter initialization: a model created on the
meta device (or under ``accelerate.init_empty_weights()``) has parameters without storage.
``empty_module_params`` gives them storage on a real device and ``move_buffers_to_device``
does the same for buffers; neither writes values, which is the job of the init function that
follows (see ``torch_sagemaker.delayed_param``).

Both functions are non-recursive by default because FSDP1 calls ``param_init_fn`` once per
module and expects it to touch that module's own tensors only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import nn as nn_compat

#: A getter of a module's own parameter or buffer dictionary.
_OwnTensors = Callable[[nn.Module], dict[str, Any]]


def default_device() -> torch.device:
    """The device delayed init materializes on: the current CUDA device if any, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized storage with ``t``'s shape, dtype and (for DTensor) sharding."""
    if isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), device=device)
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return torch.empty_like(t, device=device)


def _owners(module: nn.Module, recurse: bool, kind: Callable[[nn.Module], dict]):
    """Yields ``(owner_module, attribute_name, tensor)`` for direct or all tensors of ``kind``.

    ``kind`` is ``nn_compat.own_parameters`` or ``nn_compat.own_buffers``.
    """
    modules = module.modules() if recurse else [module]
    for owner in modules:
        for name, tensor in list(kind(owner).items()):
            if tensor is not None:
                yield owner, name, tensor


def empty_module_params(
    module: nn.Module, device: torch.device | str | None = None, recurse: bool = False
) -> nn.Module:
    """Gives meta-device parameters uninitialized storage on ``device``.

    Parameters that already have storage are left alone, so calling this twice is harmless.
    Parameters shared between modules (tied weights) stay shared when they are visited in the
    same call; ``DelayedParamIniter`` also keeps ties across calls.

    Args:
        module: The module whose parameters to materialize.
        device: Target device; ``None`` means the current CUDA device, or CPU without CUDA.
        recurse: Also materialize the parameters of all submodules.

    Returns:
        ``module`` (modified in place).
    """
    device = torch.device(device) if device is not None else default_device()
    replaced: dict[int, nn.Parameter] = {}
    for owner, name, param in _owners(module, recurse, nn_compat.own_parameters):
        if not param.is_meta:
            continue
        new = replaced.get(id(param))
        if new is None:
            new = nn.Parameter(_empty_like(param, device), requires_grad=param.requires_grad)
            # Keep user attributes (e.g. markers set by a TP plan) on the new parameter.
            new.__dict__.update({k: v for k, v in param.__dict__.items() if k not in new.__dict__})
            replaced[id(param)] = new
        nn_compat.own_parameters(owner)[name] = new
    return module


def to_empty_keeping_ties(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module.to_empty(device=device)``, but a tensor several modules share stays shared.

    ``nn.Module.to_empty`` replaces each module's plain (non-DTensor) parameters one module
    at a time, so a parameter held by two modules (``lm_head.weight`` tied to
    ``embed_tokens.weight``) comes out as two parameters. Here every alias after the first
    is set aside while ``to_empty`` runs (it skips ``None`` entries, so the shared tensor is
    allocated once) and then pointed at the first holder's new tensor: the model keeps as
    many parameters as it had, and ``to_empty``'s own handling of each tensor is unchanged.

    Args:
        module: The module to give uninitialized storage, recursively.
        device: Where the storage goes.

    Returns:
        ``module`` (modified in place).
    """
    # (own-tensor dictionary getter, alias's module, its name, first holder, its name)
    getters: tuple[_OwnTensors, _OwnTensors] = (nn_compat.own_parameters, nn_compat.own_buffers)
    aliases: list[tuple[_OwnTensors, nn.Module, str, nn.Module, str]] = []
    for getter in getters:
        first: dict[int, tuple[nn.Module, str]] = {}
        for owner, name, tensor in _owners(module, True, getter):
            holder, holder_name = first.setdefault(id(tensor), (owner, name))
            if holder is not owner or holder_name != name:
                aliases.append((getter, owner, name, holder, holder_name))
    for getter, owner, name, _, _ in aliases:
        getter(owner)[name] = None
    try:
        module.to_empty(device=device)
    finally:
        for getter, owner, name, holder, holder_name in aliases:
            getter(owner)[name] = getter(holder)[holder_name]
    return module


def move_buffers_to_device(
    module: nn.Module, device: torch.device | str | None, recurse: bool = False
) -> nn.Module:
    """Moves buffers to ``device``; meta buffers get uninitialized storage there.

    Values of meta buffers are unknown (they were never computed), so the caller must
    recompute them; ``DelayedParamIniter`` does, and fails loudly if it cannot.

    Args:
        module: The module whose buffers to move.
        device: Target device; ``None`` means the current CUDA device, or CPU without CUDA.
        recurse: Also move the buffers of all submodules.

    Returns:
        ``module`` (modified in place; persistence of each buffer is unchanged).
    """
    device = torch.device(device) if device is not None else default_device()
    for owner, name, buf in _owners(module, recurse, nn_compat.own_buffers):
        if buf.is_meta:
            nn_compat.own_buffers(owner)[name] = _empty_like(buf, device)
        elif buf.device != device:
            nn_compat.own_buffers(owner)[name] = buf.to(device)
    return module


__all__ = [
    "default_device",
    "empty_module_params",
    "move_buffers_to_device",
    "to_empty_keeping_ties",
]
