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

Such a rank's output is tied (``tie_to``) to one element of each parameter and input: the
output passes through unchanged, and backward gives each tied element an exact zero, which
autograd spreads into a zero gradient of the whole tensor. Nothing is computed with the
tied values, so an fp16 gradient sum or an inf in a weight cannot turn into NaN (adding
``x * 0`` would). The tie is made only where it is needed: a rank without a local choice
(one host-side check per layer, beside the eager loop's own ``nonzero``) of an
implementation that may leave its weights out. transformers' ``grouped_mm`` and
``batched_mm`` reach every weight and input whatever the choices (the second gathers the
weights by clamped expert ids), so they are neither checked nor tied; any other
implementation is (eager, a custom registered one, or an experts class transformers does
not dispatch, such as DBRX's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# transformers' experts implementations whose forward reaches every weight and input even
# when no choice is this rank's.
_ALWAYS_CONNECTED = frozenset({"grouped_mm", "batched_mm"})


def may_leave_weights_unused(module: nn.Module) -> bool:
    """Whether ``module``'s forward may reach no weight or input when it runs no expert.

    Args:
        module: An experts module; transformers' dispatching ones carry ``config``.

    Returns:
        False for transformers' ``grouped_mm`` and ``batched_mm``; True otherwise.
    """
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) not in _ALWAYS_CONNECTED


class _Tie(torch.autograd.Function):
    """``out`` unchanged; backward gives ``out`` its gradient and each tied tensor a zero."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *tied: torch.Tensor) -> torch.Tensor:
        ctx.tied = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = (torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.tied)
        return (grad, *zeros)


def tie_to(out: torch.Tensor, view: Any, module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """``out``, tied to one element of each of ``module``'s parameters and of ``inputs``.

    Args:
        out: The experts' output on this rank.
        view: The module as its forward sees it (its parameters as local tensors, children
            as views of their own), from which each parameter is read.
        module: The module whose parameters (its own and its children's) are tied.
        *inputs: Tensors the forward was given.

    Returns:
        ``out``'s values; in backward every tied tensor with an element gets a zero gradient.
    """
    tied = []
    for name, _ in module.named_parameters():
        holder = view
        *path, leaf = name.split(".")
        for part in path:
            holder = getattr(holder, part)
        tied.append(getattr(holder, leaf))
    tied.extend(inputs)
    # One element of each: a 0-dim view, so the tie copies nothing in forward.
    firsts = [t[(0,) * t.dim()] for t in tied if t.numel() and t.requires_grad]
    return _Tie.apply(out, *firsts)
