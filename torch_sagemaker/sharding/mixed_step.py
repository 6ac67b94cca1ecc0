"""Optimizer steps over an FSDP1 model whose experts stayed DTensors beside plain parameters.

Note [Optimizer steps over DTensor and plain parameters]: with FSDP1 and one rank per expert
group (Note [FSDP1 experts on one rank] in ``experts.py``) the experts stay DTensors on the
expert mesh, and every other parameter is a plain tensor that FSDP1 exposes. On CUDA,
PyTorch's optimizers default to their ``foreach`` implementation (and use ``fused`` when
asked): each list operation takes every parameter of a device and dtype at once, and DTensor
refuses a list that mixes DTensors with plain tensors ("got mixed torch.Tensor and DTensor").
SMP's scripts build ``AdamW`` without ``foreach``, so they failed at the first
``optimizer.step()`` on a GPU; on the CPU (single-tensor default) they ran.

So once such a model is wrapped, global step hooks turn DTensor's implicit replication on
while an optimizer whose parameters mix the two kinds steps (its closure included), and put
the previous setting back after. The plain tensors then count as replicated on the mesh of
the list's DTensors. PyTorch's optimizers compute element-wise per parameter: a list position
reads only its own parameter's tensors, so a plain tensor meets only replicated ones, nothing
is redistributed and no value crosses ranks (an optimizer that reduced across parameters
would take a plain shard for a full tensor). The values are those of the single-tensor path;
but an out-of-place list result at a plain position comes back as a replicated DTensor, and
SGD keeps one as its momentum buffer, so after the step every DTensor state of a plain
parameter is put back as its local tensor. A step that raised leaves the switch on until that
optimizer's next step begins (which restores the setting from before the failed one).

The optimizer's parameters are looked at on every step (no registry: a weak reference to a
DTensor parameter makes ``module.to()`` refuse to swap it, and parameters can be replaced).
What runs outside the step is not covered: ``GradScaler.unscale_`` and PyTorch's own
``clip_grad_norm_`` (``foreach`` on CUDA) still refuse the mix; ``tsm``'s ``clip_grad_norm_``
takes it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torch_sagemaker._torch_compat import dtensor as dtensor_compat

# An optimizer whose step is under way -> the implicit-replication setting before it.
_BEFORE: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
_hooks_installed = False


def install() -> None:
    """Installs the global optimizer step hooks (once per process)."""
    global _hooks_installed
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


def _mixes(optimizer: torch.optim.Optimizer) -> bool:
    kinds = {isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]}
    return len(kinds) == 2


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _after_step(optimizer, args, kwargs)  # a step that raised left its switch on
    if _mixes(optimizer):
        _BEFORE[optimizer] = dtensor_compat.implicit_replication_allowed()
        dtensor_compat.allow_implicit_replication(True)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    before = _BEFORE.pop(optimizer, None)
    if before is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and not isinstance(p, DTensor):
                for key, value in state.items():
                    if isinstance(value, DTensor):
                        state[key] = value.to_local()
    dtensor_compat.allow_implicit_replication(before)
