"""``torch.sagemaker.grad_norm.clip_grad_norm_``: one total gradient norm across shard and TP axes.

PyTorch's ``clip_grad_norm_`` cannot mix DTensors of different meshes (FSDP2 + TP gives a
2-D (shard, tp) mesh for TP weights and a 1-D shard mesh for the rest) and FSDP1's method
only knows its own group. Here every gradient contributes ``||local||_p^p`` (or its max)
to a bucket keyed by the mesh axes it is *sharded* on; each bucket is summed over exactly
those axes' groups (replicated axes are not summed, so nothing is counted twice), and the
buckets are added up. Every rank issues the same collectives in the same (sorted) order.

| model                       | gradients                         | handled as                              |
|-----------------------------|-----------------------------------|-----------------------------------------|
| FSDP2 / HSDP (+ TP)         | DTensors, Shard on shard/tp axes  | buckets per sharded axes                |
| DTensor TP without FSDP     | DTensors, Shard on tp             | buckets per sharded axes                |
| DDP, single process         | full tensors                      | local norm                              |
| FSDP1                       | FlatParameter shards              | ``FullyShardedDataParallel.clip_grad_norm_`` |
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate


def _local_and_sharded_axes(grad: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """Local values of ``grad`` and a sort-stable key naming the mesh axes it is sharded on."""
    if not isinstance(grad, DTensor):
        return grad, ()
    placements = grad.placements
    if any(p.is_partial() for p in placements):
        # Partial sums must be reduced before a norm can be taken.
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in placements])
        placements = grad.placements
    mesh = grad.device_mesh
    axes = tuple(i for i, p in enumerate(placements) if p.is_shard())
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    key = tuple((names[i], tuple(dist.get_process_group_ranks(mesh.get_group(i)))) for i in axes)
    return grad.to_local(), (key, mesh, axes)


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Norm of all ``grads`` together, reduced over the axes each one is sharded on.

    Args:
        grads: Gradients (plain tensors or DTensors).
        norm_type: p of the p-norm; ``inf`` for the max norm.

    Returns:
        A 0-d float64 tensor, identical on every rank.
    """
    is_inf = math.isinf(norm_type)
    buckets: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    meshes: dict[tuple, tuple] = {}
    for grad in grads:
        local, info = _local_and_sharded_axes(grad)
        key = info[0] if info else ()
        if info and info[2]:
            meshes[key] = (info[1], info[2])
        values = local.detach().to(torch.float64)
        if values.numel() == 0:
            buckets[key] += 0
            continue
        if is_inf:
            buckets[key] = torch.maximum(buckets[key], values.abs().max().cpu())
        else:
            buckets[key] += torch.linalg.vector_norm(values, norm_type).cpu() ** norm_type
    result = torch.zeros((), dtype=torch.float64)
    for key in sorted(buckets):
        value = buckets[key]
        if key:
            mesh, axes = meshes[key]
            op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
            for axis in axes:
                dist.all_reduce(value, op=op, group=mesh.get_group(axis))
        result = torch.maximum(result, value) if is_inf else result + value
    return result if is_inf else result ** (1.0 / norm_type)


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clips the gradients of ``model`` in place to a total norm of ``max_norm``.

    Correct for FSDP1, FSDP2 (incl. HSDP), DDP and tensor parallel (DTensor) parameters.

    Args:
        model: The (wrapped) model.
        max_norm: Largest allowed total norm.
        norm_type: p of the p-norm (``float("inf")`` for max).
        error_if_nonfinite: Raise if the total norm is nan or inf.

    Returns:
        The total norm before clipping (float64, same value on every rank).

    Raises:
        RuntimeError: If ``error_if_nonfinite`` and the norm is not finite.

    Example:
        >>> norm = tsm.grad_norm.clip_grad_norm_(model, 1.0)
    """
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm, norm_type).to(torch.float64)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"the total gradient norm is {norm.item()}; gradients contain nan or inf. Lower the "
            "learning rate, check the loss, or pass error_if_nonfinite=False to clip anyway."
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.dtype))
    return norm
