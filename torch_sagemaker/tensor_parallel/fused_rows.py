"""Fused ``nn.Linear`` projections kept whole, each rank computing the rows it needs.

Note [Fused projections computed by rows]: some models compute queries, keys and values in
one ``nn.Linear`` whose output rows are not laid out head by head, so no contiguous split of
the rows gives every rank whole heads:

- ``[q | k | v]`` blocks (MPT's ``Wqkv``, of equal widths; DBRX's, whose keys and values
  have fewer heads than its queries; transformers' ``packed_colwise`` on an ``nn.Linear``):
  rank ``r`` needs its part of each block, ``[q_r | k_r | v_r]``.
  On a ``Conv1D`` that part is a DTensor of its own (``_StridedShard``, Note [Packed
  projections]), but an ``nn.Linear`` keeps its output features on dimension 0, which
  FSDP2 shards too, and PyTorch 2.13 describes that double split wrongly;
- under multi-query attention (Falcon-7B's ``query_key_value``, GPT-BigCode's ``c_attn``),
  every query head and then one key and one value head that all query heads share:
  every rank needs the shared key and value, ``[q_r | k | v]`` (``shared_kv_colwise``).

So the weight and bias stay whole on the tensor parallel ranks (``Replicate`` DTensors:
FSDP shards them over the data-parallel ranks like any replicated parameter; checkpoints,
exports and resharding see the model's own layout), and each rank computes only its rows.
Its gradient covers those rows (for shared rows, its query heads' share); summed over the
TP ranks (``AllReduceGrad``), that is the whole gradient, the same on every rank. The
input is the whole activation; its gradient, a partial sum on each rank, is summed at the
DTensor boundary like a column split's.

The product runs in ``_RowsLinear``, which saves the whole weight (the parameter itself,
no new storage) and selects the rows again in backward: autograd through
``weight[rows]`` kept a copy of the selected rows alive from each layer's forward to its
backward, a weight-sized activation per layer (measured: 20% of a tiny Falcon's saved
activations; by arithmetic, a 4544-wide multi-query layout like Falcon-7B's at tp 2 in bf16
would keep about 22 MB per layer).

What this costs against a split weight: every TP rank holds the projection whole (MPT's
``3 x hidden x hidden`` per layer, a quarter of its layer; Falcon-7B's, by its sizes, about
9% of its parameters), and its gradient is all-reduced over the TP ranks each step. The compute is
split.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from torch_sagemaker.tensor_parallel.local_parameters import local_value
from torch_sagemaker.tensor_parallel.styles import (
    AllReduceGrad,
    distribute_params,
    to_local_partial_grad,
)


def fused_rows(
    out_features: int,
    blocks: int | Sequence[int],
    shared: int,
    rank: int,
    tp: int,
    head_dim: int = 1,
) -> torch.Tensor:
    """The output rows that rank ``rank`` of ``tp`` computes.

    Its part of each block, then the last ``shared`` rows (Note [Fused projections computed
    by rows]).

    Args:
        out_features: The projection's output features.
        blocks: The count of equal blocks before the shared rows, or the blocks' widths
            (``[q | k | v]`` of grouped-query attention: the keys and values narrower).
        shared: Output features at the end that every rank computes.
        rank: This rank among the TP ranks.
        tp: The TP degree.
        head_dim: The head size: each rank's part of a block must be whole heads (1: any
            even split).

    Raises:
        ValueError: The blocks do not fill the split part, or one does not split into whole
            heads over the ranks.
    """
    split = out_features - shared
    if isinstance(blocks, int):
        widths = [split // blocks] * blocks if blocks >= 1 and split % blocks == 0 else []
    else:
        widths = list(blocks)
    if shared < 0 or split <= 0 or not widths or sum(widths) != split:
        raise ValueError(
            f"{out_features} output features, {shared} of them shared, do not hold the "
            f"blocks {blocks} (Note [Fused projections computed by rows])."
        )
    if any(w <= 0 or w % (tp * head_dim) for w in widths):
        heads = f" of heads of {head_dim}" if head_dim > 1 else ""
        raise ValueError(
            f"{out_features} output features, {shared} of them shared, leave {split} in "
            f"blocks{heads} of widths {widths}, which do not divide over "
            f"tensor_parallel_degree={tp}: each rank computes whole heads of each block "
            "(Note [Fused projections computed by rows]); choose a degree that divides the "
            "heads of every block."
        )
    parts, start = [], 0
    for width in widths:
        local = width // tp
        parts.append(torch.arange(start + rank * local, start + (rank + 1) * local))
        start += width
    return torch.cat([*parts, torch.arange(split, out_features)])


class _RowsLinear(torch.autograd.Function):
    """``F.linear`` with the rows ``rows`` of ``weight`` and ``bias``, saving no copy of them.

    Autograd through ``weight.index_select`` would keep the selected rows, a copy the size
    of the rank's share of the weight, alive from each layer's forward to its backward; the
    backward here selects them again from the (saved, not copied) whole weight.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """``x @ weight[rows].T + bias[rows]``."""
        ctx.save_for_backward(x, weight, rows)
        ctx.has_bias = bias is not None
        mine = bias.index_select(0, rows) if bias is not None else None
        return F.linear(x, weight.index_select(0, rows), mine)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        """Gradients of ``x``, ``weight`` and ``bias`` (zero outside ``rows``)."""
        x, weight, rows = ctx.saved_tensors
        grad_x = grad @ weight.index_select(0, rows)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_rows = flat_grad.t() @ x.reshape(-1, x.shape[-1])
        grad_weight = weight.new_zeros(weight.shape).index_copy_(0, rows, grad_rows)
        grad_bias = None
        if ctx.has_bias:
            grad_bias = weight.new_zeros(weight.shape[0]).index_copy_(0, rows, flat_grad.sum(0))
        return grad_x, grad_weight, grad_bias, None


class FusedRowsColwise(ParallelStyle):
    """A fused ``nn.Linear`` kept whole; each rank computes its rows of it.

    Note [Fused projections computed by rows].

    Args:
        blocks: Equal blocks of the split part of the output (3 for ``[q | k | v]``), or
            their widths where they differ (grouped-query ``[q | k | v]``); each block is
            split over the ranks.
        shared: Output features at the end that every rank computes (the shared key and
            value of multi-query attention); 0 for none.
        head_dim: The head size, where the blocks are heads: each rank's part of a block
            must be whole heads (1: any even split).
        name: The module's name (messages).
    """

    def __init__(
        self,
        *,
        blocks: int | Sequence[int] = 1,
        shared: int = 0,
        head_dim: int = 1,
        name: str = "",
    ) -> None:
        super().__init__()
        self.blocks, self.shared, self.head_dim, self.name = blocks, shared, head_dim, name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = self.name or type(module).__name__
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"{name}: a fused projection style applies to nn.Linear, not {type(module)}."
            )
        try:
            rows = fused_rows(
                module.out_features,
                self.blocks,
                self.shared,
                device_mesh.get_local_rank(),
                device_mesh.size(),
                self.head_dim,
            )
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        distribute_params(module, device_mesh, [Replicate()], self.src_data_rank)
        group = device_mesh.get_group()
        on_device: dict[torch.device, torch.Tensor] = {}  # (no copy to a GPU per forward)

        def whole(mod: nn.Module, pname: str) -> torch.Tensor | None:
            """The whole parameter, its gradient summed over the TP ranks."""
            param = getattr(mod, pname)
            if param is None:
                return None
            return AllReduceGrad.apply(local_value(mod, pname, cast(DTensor, param)), group)

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x = to_local_partial_grad(x, device_mesh)  # its gradient summed over the ranks
            weight = cast(torch.Tensor, whole(mod, "weight"))
            index = on_device.get(weight.device)
            if index is None:
                index = on_device[weight.device] = rows.to(weight.device)
            return _RowsLinear.apply(x, weight, whole(mod, "bias"), index)

        styled: nn.Module = module  # (a Linear's forward is a method of its class)
        styled.forward = types.MethodType(forward, module)
        return styled


__all__ = ["FusedRowsColwise", "fused_rows"]
