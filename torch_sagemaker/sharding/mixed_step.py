"""Optimizer steps over an FSDP1 model whose experts stayed DTensors beside plain parameters.

Note [Optimizer steps over DTensor and plain parameters]: with FSDP1 and one rank per expert
group (Note [FSDP1 experts on one rank] in ``experts.py``) the experts stay DTensors on the
expert mesh, and every other parameter is a plain tensor that FSDP1 exposes. On CUDA,
PyTorch's optimizers default to their ``foreach`` implementation (and use ``fused`` when
asked): each list operation takes every parameter of a device and dtype at once, and DTensor
refuses a list that mixes DTensors with plain tensors ("got mixed torch.Tensor and DTensor").
SMP's scripts build ``AdamW`` without ``foreach``, so they failed at the first
``optimizer.step()`` on a GPU; on the CPU (single-tensor default) they ran.

So while an optimizer that holds such experts steps, DTensor's ``implicit_replication`` is on
and the plain tensors count as replicated on the experts' mesh. That is exact for what
PyTorch's optimizers compute: element-wise arithmetic per parameter, where each list position
reads only its own parameter's tensors, so a plain tensor meets only replicated ones and no
value crosses ranks (for an optimizer that reduced across parameters, a plain shard would be
taken for a full tensor). The switch is scoped by global step hooks to the optimizers that
hold a registered expert parameter; a step that raised leaves it on until that optimizer's
next step begins (and turns it off).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch.distributed.tensor.experimental import implicit_replication
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# The ids of live parameters that stay DTensors beside plain ones in the same model (by id:
# a tensor's == is element-wise, so tensors cannot be weak set members).
_DTENSOR_BESIDE_PLAIN: set[int] = set()
# An optimizer whose step is under way -> the implicit replication it entered.
_ENTERED: weakref.WeakKeyDictionary[torch.optim.Optimizer, contextlib.AbstractContextManager] = (
    weakref.WeakKeyDictionary()
)
_hooks_installed = False


def register(parameters: list[torch.Tensor]) -> None:
    """Marks ``parameters`` as DTensors that share optimizers with plain tensors.

    Installs the global step hooks once per process.
    """
    global _hooks_installed
    for p in parameters:
        if id(p) not in _DTENSOR_BESIDE_PLAIN:
            _DTENSOR_BESIDE_PLAIN.add(id(p))
            weakref.finalize(p, _DTENSOR_BESIDE_PLAIN.discard, id(p))
    if parameters and not _hooks_installed:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


def _holds_registered(optimizer: torch.optim.Optimizer) -> bool:
    return any(
        id(p) in _DTENSOR_BESIDE_PLAIN for group in optimizer.param_groups for p in group["params"]
    )


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _after_step(optimizer, args, kwargs)  # a step that raised left its switch on
    if _holds_registered(optimizer):
        context = implicit_replication()
        context.__enter__()
        _ENTERED[optimizer] = context


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    context = _ENTERED.pop(optimizer, None)
    if context is not None:
        context.__exit__(None, None, None)
