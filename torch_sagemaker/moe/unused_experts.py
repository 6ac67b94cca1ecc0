"""Gradients for a rank's experts, and their inputs, when none of its tokens chose them.

Note [Experts without a token on this rank]: both ways of splitting an experts module give
each rank whole experts, and each rank runs only the choices of its own:

- tensor parallelism (``ExpertsParallel`` in ``tensor_parallel/styles.py``) runs every token
  of the TP group on each rank's experts (others get Hugging Face's sentinel index);
- expert parallelism (``moe/experts.py``) sends each rank the rows routed to its experts
  (all-to-all; possibly none) or gathers every rank's tokens with the sentinel on the
  others' choices (all-gather).

transformers' eager expert loop (``experts_implementation="eager"``) computes nothing on a
rank where no choice is one of its experts: its output is zeros that depend neither on the
weights nor on the inputs, and backward skips what its peers run:

- the collectives that carry the inputs' gradients back: the TP sum of the hidden states' and
  routing weights' partial gradients (``to_local_partial_grad``), or EP's backward
  all-to-all, all-gather and reduce-scatter;
- FSDP2's reduce-scatter of the expert weights, which covers only parameters with a gradient.

The ranks' collectives then no longer match. Seen with tiny Mixtral (eager experts): at tp 2 x
hybrid shard 2 with one data-parallel rank's choices all on the first TP rank's experts, gloo
aborted ("Received data size doesn't match expected size"); at ep 2 with every choice on the
first EP rank's experts, both dispatchers hung under FSDP1 and FSDP2. FSDP2's
``set_reduce_scatter_unused_params`` alone does not help: the TP and EP collectives still
differ.

Such a rank's output is tied (``tie_to``) to one element of each parameter and input (an
empty input, such as the rows an all-to-all brought none of, whole): the output passes through
unchanged, and backward gives each tied element an exact zero, which autograd spreads into a
zero gradient of the whole tensor. Nothing is computed with the tied values, so an fp16
gradient sum or an inf in a weight cannot turn into NaN (adding ``x * 0`` would). The tie is
made only where it is needed: a rank without a local choice (one host-side check per layer;
the eager loop makes its own ``nonzero``, and the all-to-all knows its row counts on the host)
of an implementation that may leave its weights out. transformers' ``grouped_mm`` and
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
        ``out``'s values; in backward every tied tensor gets a zero gradient.
    """
    tied = []
    for name, _ in module.named_parameters():
        holder = view
        *path, leaf = name.split(".")
        for part in path:
            holder = getattr(holder, part)
        tied.append(getattr(holder, leaf))
    tied.extend(inputs)
    # One element of each (a 0-dim view, so the tie copies nothing in forward); an empty
    # tensor whole, so the collective that made it still runs its backward.
    firsts = [t[(0,) * t.dim()] if t.numel() else t for t in tied if t.requires_grad]
    return _Tie.apply(out, *firsts)
