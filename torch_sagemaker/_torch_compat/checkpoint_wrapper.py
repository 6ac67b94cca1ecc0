"""The private module ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``.

Activation checkpointing and offloading wrappers (``checkpoint_wrapper``,
``offload_wrapper``, their classes, ``apply_activation_checkpointing``) and the wrapped
module of a wrapper (``_checkpoint_wrapped_module``). ``TORCH_MODULE`` is the module itself:
the package replaces its ``offload_wrapper`` attribute (``offload/torch_patch.py``), so that
function is not re-exported here (a name bound at import would miss the patch).

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as _cw
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

#: The module object; the owner of the patched ``offload_wrapper`` attribute.
TORCH_MODULE = _cw


def wrapped_module(wrapper: ActivationWrapper) -> nn.Module:
    """The module inside a checkpoint or offload wrapper."""
    return wrapper._checkpoint_wrapped_module


def wrapped_module_or_none(module: nn.Module) -> nn.Module | None:
    """``wrapped_module(module)`` for an activation wrapper, ``None`` for other modules."""
    return getattr(module, "_checkpoint_wrapped_module", None)


__all__ = [
    "TORCH_MODULE",
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "OffloadWrapper",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "wrapped_module",
    "wrapped_module_or_none",
]
