"""Column- and row-parallel styles for transformers' ``Conv1D``, packed outputs included.

PyTorch's ``ColwiseParallel``/``RowwiseParallel`` split an ``nn.Linear`` and refuse other
module types. transformers' ``Conv1D`` (GPT-2 and its relatives) is a Linear with its weight
stored transposed, ``(in_features, out_features)``, computing ``x @ weight + bias``: the
styles here split it on the matching dimensions and compute with the local values, in the
replicated-activation layout of the plans (Note [Plan-driven layout]): plain tensors in and
out. The column style takes the whole input (its gradient, a partial sum on each rank, is
summed at the input boundary) and returns this rank's features; the row style takes this
rank's features, all-reduces the product and adds the bias once, to the whole output.

Note [Packed projections]: a packed projection computes several outputs in one product,
its output features laid out as equal blocks: GPT-2's ``c_attn`` is ``[q | k | v]``, each
block ``embed_dim`` wide. A contiguous split would give rank 0 of two the queries and half
the keys, not heads. It is split block by block instead: rank ``r`` holds its part of every
block, ``[q_r | k_r | v_r]``, so it computes whole heads of the queries, keys and values,
and the attention module splits that output by its per-rank width (``split_size``, rescaled
with the head counts: ``plan._set_head_counts``). The weight is a DTensor with PyTorch's
``_StridedShard(1, split_factor=blocks)``, the placement of exactly that layout
(transformers uses it for its packed styles too): ``full_tensor()``, ``distribute_tensor``
(full state dicts, rank-0 loading) and FSDP2, which shards the other dimension, see the
model's own layout; the values are not reordered. PyTorch's distributed checkpoint cannot
save that placement by itself (Note [Packed shards in checkpoints] in
``checkpoint/strided_shards.py``). The bias stays replicated (one row of
``3 x embed_dim``), each rank adding its part and summing the gradients of the parts:
FSDP2 shards dimension 0 too, and its placement for a second split of the dimension
``_StridedShard`` already splits (``(_StridedShard(0, 2), _StridedShard(0, 3))`` on a 2 x 2
mesh) does not describe the shard it holds: training ran right, but ``full_tensor()`` of
the bias and of its gradient came out reordered (GPT-2, tp 2 x hybrid shard 2, torch 2.13).
For the same reason an ``nn.Linear``'s packed weight, split on dimension 0, is not offered.
"""

from __future__ import annotations

import types
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torch_sagemaker._torch_compat.dtensor import StridedShard
from torch_sagemaker.tensor_parallel.local_parameters import local_value
from torch_sagemaker.tensor_parallel.replicated_styles import whole_local
from torch_sagemaker.tensor_parallel.styles import (
    AllReduceGrad,
    distribute_params,
    to_local_partial_grad,
)
from torch_sagemaker.utils.projections import conv1d_features, is_conv1d


def _check_conv1d(module: nn.Module, style: str) -> None:
    if not is_conv1d(module):
        raise TypeError(f"{style} applies to transformers' Conv1D, got {type(module).__name__}.")


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``Conv1D``'s computation with the given weight and bias (``None``: without bias)."""
    rows = x.reshape(-1, x.shape[-1])
    out = rows @ weight if bias is None else torch.addmm(bias, rows, weight)  # as Conv1D does
    return out.view(*x.shape[:-1], weight.shape[-1])


class Conv1DColwise(ParallelStyle):
    """Output features of a ``Conv1D`` split over the TP ranks, block by block.

    Args:
        blocks: Equal blocks its output features are packed in (Note [Packed projections]);
            each is split over the ranks. ``1``: an ordinary column split.
    """

    def __init__(self, *, blocks: int = 1) -> None:
        super().__init__()
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, "conv1d_colwise")
        width, tp, blocks = conv1d_features(module)[1], device_mesh.size(), self.blocks
        if width % (blocks * tp):
            raise ValueError(
                f"{type(module).__name__}: {width} output features in {blocks} packed "
                f"block(s) cannot be split over tensor_parallel_degree={tp} ranks."
            )
        weight: Placement = Shard(1) if blocks == 1 else StridedShard(1, split_factor=blocks)
        distribute_params(module, device_mesh, [weight], self.src_data_rank, ["weight"])
        bias = Shard(0) if blocks == 1 else Replicate()
        distribute_params(module, device_mesh, [bias], self.src_data_rank, ["bias"])
        rank, group = device_mesh.get_local_rank(), device_mesh.get_group()

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x = to_local_partial_grad(x, device_mesh)  # its gradient summed over the ranks
            w = local_value(mod, "weight", cast(DTensor, mod.weight))
            b = local_value(mod, "bias", cast(DTensor, mod.bias))
            if blocks > 1:  # this rank's part of each block; the parts' gradients summed
                b = AllReduceGrad.apply(b, group).view(blocks, tp, -1)[:, rank].reshape(-1)
            return _product(x, w, b)

        module.forward = types.MethodType(forward, module)
        return module


class Conv1DRowwise(ParallelStyle):
    """Input features of a ``Conv1D`` split over the TP ranks; the output all-reduced.

    The input is this rank's features (heads, MLP columns) as a plain tensor; the output is
    whole on every rank. The bias is replicated and added once, after the sum, so its
    gradient is the same on every rank.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, "conv1d_rowwise_allreduce")
        distribute_params(module, device_mesh, [Shard(0)], self.src_data_rank, ["weight"])
        distribute_params(module, device_mesh, [Replicate()], self.src_data_rank, ["bias"])

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            w = local_value(mod, "weight", cast(DTensor, mod.weight))
            partial = _product(whole_local(x, device_mesh), w, None)
            summed = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False)
            # The bias add makes the output a tensor of its own (Note [Outputs of the
            # replicated layout]): no copy of the sum first, as summed_output makes.
            bias = local_value(mod, "bias", cast(DTensor, mod.bias))
            return summed.redistribute(device_mesh, [Replicate()]).to_local() + bias

        module.forward = types.MethodType(forward, module)
        return module


#: Style names ``make_projection_style`` defines (documented in ``policies.STYLES``).
PROJECTION_STYLES = ("conv1d_colwise", "conv1d_packed_colwise", "conv1d_rowwise_allreduce")


def make_projection_style(name: str, *, blocks: int = 1) -> ParallelStyle:
    """The style of ``name`` (``PROJECTION_STYLES``).

    Args:
        name: Style name.
        blocks: Equal blocks of a packed projection's output (``conv1d_packed_colwise``).

    Raises:
        ValueError: For a name this module does not define.
    """
    if name == "conv1d_packed_colwise":
        return Conv1DColwise(blocks=blocks)
    if name == "conv1d_colwise":
        return Conv1DColwise()
    if name == "conv1d_rowwise_allreduce":
        return Conv1DRowwise()
    raise ValueError(f"unknown projection style {name!r}.")


__all__ = ["PROJECTION_STYLES", "Conv1DColwise", "Conv1DRowwise", "make_projection_style"]
