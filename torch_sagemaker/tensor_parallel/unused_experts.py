"""Gradients for a rank's experts, and their inputs, when none of its tokens chose them.

Note [Experts without a token on this rank]: tensor parallelism splits an experts module's
weights whole over the TP ranks (``ExpertsParallel``); each rank runs only the choices of its
own experts. transformers' eager expert loop (``experts_implementation="eager"``) computes
nothing on a rank where no choice is one of its experts: its output is zeros that depend
neither on the weights nor on the inputs. Two things then differ from the rank's peers:

- Its TP peers. The hidden states and routing weights enter the experts as local values
  whose gradients are partial sums over the TP ranks (``to_local_partial_grad``); the
  collective that sums them runs in backward only on the ranks whose graph reaches them.
- Its data-parallel peers. FSDP2 reduce-scatters only the parameters that have a gradient,
  so the rank reduced another set than peers whose tokens did choose those experts.

Either way the collectives of the ranks no longer match. Seen with tiny Mixtral (eager
experts) at tp 2 x hybrid shard 2, one data-parallel rank's choices all routed to the first
TP rank's experts: gloo aborted ("Received data size doesn't match expected size"); FSDP2's
``set_reduce_scatter_unused_params`` alone does not help, the TP collectives still differ.

Such a forward gets a zero added to its output that depends on one element of each
parameter and of each input, so all of them get (zero) gradients as on the peers. It is
added only when no choice is this rank's, which the eager loop checks on the host anyway
(``nonzero``). transformers' grouped and batched implementations (its default) pass the
whole weights and inputs to one kernel, so they always have gradients: no check there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def may_leave_weights_unused(module: nn.Module) -> bool:
    """Whether ``module``'s forward may use nothing when it runs no expert.

    True for transformers' eager loop and for any forward this cannot tell (a custom
    experts class); False for transformers' grouped and batched kernels.
    """
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    return implementation in (None, "eager")


def _first(t: torch.Tensor) -> torch.Tensor | None:
    return t[(0,) * t.dim()] if t.numel() else None  # one element: no copy of the tensor


def zero_depending_on(view: Any, module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """A zero that depends on one element of each of ``module``'s parameters and ``inputs``.

    Args:
        view: The module as its forward sees it (its parameters as local tensors, children
            as views of their own), from which each parameter is read.
        module: The module whose parameters (its own and its children's) are read.
        *inputs: Tensors the forward was given.

    Returns:
        A 0-dim zero; its gradient reaches every parameter and input that has an element.
    """
    parts = []
    for name, _ in module.named_parameters():
        holder = view
        *path, leaf = name.split(".")
        for part in path:
            holder = getattr(holder, part)
        parts.append(_first(getattr(holder, leaf)))
    parts.extend(_first(t) for t in inputs)
    present = [p for p in parts if p is not None]
    if not present:
        raise ValueError(f"{type(module).__name__}: no parameter or input has an element")
    return torch.stack([p.float() for p in present]).sum() * 0
