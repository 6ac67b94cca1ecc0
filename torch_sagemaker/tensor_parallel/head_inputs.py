"""A style for attention modules whose inputs are indexed by head (ALiBi biases).

Note [Head-indexed inputs]: most attention modules get everything per head from their own
projections, which the plan splits, so a rank computes its heads from its own slices.
ALiBi families (BLOOM, MPT, Falcon's ALiBi variant) instead build one bias per head *outside*
the attention module, from the full head count, and pass it in: ``alibi`` of shape
``[batch x heads, 1, keys]`` (batch-major, head-minor rows; BLOOM) or ``[batch, heads, 1,
keys]`` (Falcon), MPT's ``position_bias`` of shape ``[heads, 1, keys]`` for every batch
element, and Falcon also folds it into a 4-D ``attention_mask`` of shape
``[batch, heads, queries, keys]``. A rank that computes
heads ``[r x H/T, (r + 1) x H/T)`` (a column split keeps each rank's heads contiguous and
in order) must add those heads' biases, so this style cuts both inputs to them before the
module's forward: the ``alibi`` rows of the rank's heads within each batch element, and
``attention_mask``'s head dimension where it has one (a broadcast mask, size 1 there, is
left alone). The biases carry no gradient.

The batch size comes from the module's first input (the hidden states), so ``alibi``'s
rows are split without guessing. A bias is found by its parameter's name in the module's
forward, passed by keyword (BLOOM, Falcon, MPT) or by position (CPM-Ant's
``position_bias``, ``[batch, heads, queries, keys]``); the attention mask by keyword only.
An ``alibi`` given any other way fails the shape check in the model (as it would without
this style), not silently.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

#: Inputs holding per-head biases: BLOOM's and Falcon's ``alibi``, MPT's and CPM-Ant's
#: ``position_bias``.
_BIASES = ("alibi", "position_bias")


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The hidden states: the first positional tensor, else ``hidden_states``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    return hidden if isinstance(hidden, torch.Tensor) else None


class HeadInputs(ParallelStyle):
    """Cuts an attention module's head-indexed inputs to this rank's heads.

    Note [Head-indexed inputs]. The module's own projections are split by their entries.

    Args:
        num_heads: The model's query head count (all ranks together).
        name: The module's name (messages).
    """

    def __init__(self, num_heads: int, *, name: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ranks = device_mesh.size()
        if self.num_heads <= 0 or self.num_heads % ranks:
            raise ValueError(
                f"tsm.transform: {self.name or type(module).__name__} takes per-head inputs "
                f"(ALiBi or relative-position biases) for {self.num_heads} heads, which do "
                f"not divide over tensor_parallel_degree {ranks}: each rank must hold whole "
                "heads. Choose a "
                f"tensor_parallel_degree that divides {self.num_heads}."
            )
        local = self.num_heads // ranks
        start = device_mesh.get_local_rank() * local
        heads = self.num_heads
        name = self.name or type(module).__name__

        def cut_alibi(alibi: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
            batch = hidden.shape[0] if hidden is not None else -1
            # (in this order: a batch as large as the head count is read as a batch)
            if alibi.dim() > 1 and alibi.shape[:2] == (batch, heads):  # [batch, heads, ...]
                return alibi[:, start : start + local]
            if alibi.shape[0] == batch * heads:  # [batch x heads, ...]
                rows = alibi.view(batch, heads, *alibi.shape[1:])
                return rows[:, start : start + local].reshape(-1, *alibi.shape[1:])
            if alibi.shape[0] == heads:  # [heads, ...] for every batch element (MPT's)
                return alibi[start : start + local]
            raise ValueError(
                f"{name}: its ALiBi input of shape {tuple(alibi.shape)} is not laid out as "
                f"[{heads} heads, ...], [batch x {heads} heads, ...] or [batch, {heads} heads, "
                "...] for a batch of "
                f"{batch} (the hidden states, its first input), so it cannot be cut to this "
                f"rank's heads over {ranks} tensor parallel ranks (Note [Head-indexed inputs])."
            )

        # (the forward's parameter names, to find a bias passed by position: CPM-Ant's)
        positional = list(inspect.signature(module.forward).parameters)

        def cut(
            _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            hidden = _first_tensor(args, kwargs)
            args = tuple(
                cut_alibi(a, hidden)
                if i < len(positional) and positional[i] in _BIASES and torch.is_tensor(a)
                else a
                for i, a in enumerate(args)
            )
            for key in _BIASES:
                bias = kwargs.get(key)
                if isinstance(bias, torch.Tensor):
                    kwargs[key] = cut_alibi(bias, hidden)
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == heads:
                kwargs["attention_mask"] = mask[:, start : start + local]
            return args, kwargs

        module.register_forward_pre_hook(cut, with_kwargs=True)
        return module


__all__ = ["HeadInputs"]
