"""``torch.sagemaker.grad_norm.clip_grad_norm_``: one total gradient norm across shard and TP axes.

PyTorch's ``clip_grad_norm_`` cannot mix DTensors of different meshes (FSDP2 + TP gives a
2-D (shard, tp) mesh for TP weights and a 1-D shard mesh for the rest) and FSDP1's method
only knows its own group. Here every gradient piece contributes ``||local||_p^p`` (or its
max) to a bucket keyed by the groups it is *sharded* over; each bucket is summed over
exactly those groups (replicated axes are not summed, so nothing is counted twice), and the
buckets are added up. Every rank reduces its groups in one shared order (Note [One order of
groups on every rank]).

Note [Norm on the device]: the per-piece norms stay on the parameters' device and only the
few bucket scalars are reduced; bringing each piece's norm to the CPU, as this once did,
waited for the device once per parameter on a GPU. Every rank picks that device from its
parameters, not from its gradients: a rank whose shards hold no gradient (frozen weights)
must reduce its buckets on the same device as its peers. Each piece's norm is taken as
PyTorch's ``clip_grad_norm_`` takes it, in float32 for half-precision gradients (on CUDA
without a copy; ``dtype=float64`` would copy the whole piece to float64 first) and in the
gradient's own dtype otherwise, and the pieces are summed in float64. The coefficient that
scales the gradients is computed on the device too: the only waits left are those of the
bucket reductions' backend (none with NCCL; smddp stages a CUDA tensor through the host).

| model | gradients | sharded over |
|-----------------------------|-----------------------------------|-----------------------------------------|
| FSDP2 / HSDP (+ TP) | DTensors, Shard on shard/tp axes | the mesh axes with a ``Shard``
  placement |
| DTensor TP without FSDP | DTensors, Shard on tp | the tp axis |
| DDP, single process | full tensors | nothing (local norm) |
| FSDP1 (+ TP) | slices of each FlatParameter shard | FSDP's shard group, plus the tp axis for the
  slices of TP weights |
| expert parallel experts | DTensors Shard(0) on ``ep`` (FSDP2: plus ``_StridedShard`` on the expert
  shard axis; FSDP1: own units, or outside FSDP) | the ``ep`` axis and the expert shard group |

Note [FSDP1 with tensor parallelism]: FSDP1 flattens the *local* tensor of a DTensor
parameter (``DTensorExtensions``), so one FlatParameter mixes slices of TP-sharded weights
(q/k/v/o, MLP) with slices of TP-replicated ones (norms). FSDP's own ``clip_grad_norm_``
sums the whole shard over its process group only: it misses the other TP ranks' halves of
the sharded weights (the norm then differs between TP ranks). The flat parameter records
each original parameter's DTensor spec (``_param_extensions``) and where it lies in this
rank's shard (``_shard_param_infos``), so each slice is bucketed by the groups it is really
sharded over.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate

from torch_sagemaker._torch_compat import dtensor as dtensor_compat
from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.smddp.direct import all_reduce_direct


class _Piece(NamedTuple):
    """Local gradient values and the groups they are sharded over."""

    local: torch.Tensor
    # Sort-stable name of the groups, identical on the ranks that share them:
    # ((axis name, ranks of the group), ...).
    key: tuple
    groups: tuple[dist.ProcessGroup, ...]


def _is_sharded(placement) -> bool:
    # FSDP2 shards a parameter that is already sharded on the same tensor dim (EP or TP
    # Shard(0)) with ``_StridedShard``, which is not a ``Shard`` and says ``is_shard() == False``.
    return placement.is_shard() or isinstance(placement, dtensor_compat.StridedShard)


def _axes_of(mesh, placements) -> tuple[tuple, tuple]:
    """Key and groups of the mesh axes with a ``Shard`` (or ``_StridedShard``) placement."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    axes = [i for i, p in enumerate(placements) if _is_sharded(p)]
    key = tuple((names[i], tuple(dist.get_process_group_ranks(mesh.get_group(i)))) for i in axes)
    return key, tuple(mesh.get_group(i) for i in axes)


def _piece(grad: torch.Tensor) -> _Piece:
    """A gradient (plain tensor or DTensor) as one piece."""
    if not isinstance(grad, DTensor):
        return _Piece(grad, (), ())
    placements = grad.placements
    if any(p.is_partial() for p in placements):
        # Partial sums must be reduced before a norm can be taken.
        grad = grad.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in placements]
        )
    key, groups = _axes_of(grad.device_mesh, grad.placements)
    return _Piece(grad.to_local(), key, groups)


def _device_of(model: nn.Module) -> torch.device:
    """Where the norm is accumulated: the first parameter's (Note [Norm on the device])."""
    for param in model.parameters():
        return (param.to_local() if isinstance(param, DTensor) else param).device
    return torch.device("cpu")


def _piece_norm(values: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The p-norm of one piece, as PyTorch's ``clip_grad_norm_`` takes it (float32 at least)."""
    if values.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(values, norm_type, dtype=torch.float32)
    return torch.linalg.vector_norm(values, norm_type)


def _reduce(pieces: list[_Piece], norm_type: float, device: torch.device) -> torch.Tensor:
    """Total p-norm of ``pieces``; each bucket is reduced over its groups (see module doc)."""
    is_inf = math.isinf(norm_type)
    buckets: dict[tuple, torch.Tensor] = defaultdict(
        lambda: torch.zeros((), dtype=torch.float64, device=device)
    )
    groups: dict[tuple, tuple] = {}
    for piece in pieces:
        groups[piece.key] = piece.groups
        values = piece.local.detach()
        if values.numel() == 0:
            buckets[piece.key] += 0  # the bucket must exist: its peers reduce it
        elif is_inf:
            largest = values.abs().max().to(device=device, dtype=torch.float64)
            buckets[piece.key] = torch.maximum(buckets[piece.key], largest)
        else:
            norm = _piece_norm(values, norm_type).to(device=device, dtype=torch.float64)
            buckets[piece.key] += norm**norm_type
    # Note [One order of groups on every rank]: a bucket is reduced over its groups in the
    # order of its key (FSDP's shard group, then TP or EP): the groups of its ranks form a
    # grid, and a rank that summed over the EP group before its peers summed over their shard
    # group would get a partial sum. The reductions run in phases, one per position in the
    # keys; in a phase each group is reduced once, for every bucket that has it at that
    # position, and the groups go in one order that every rank shares: sorted by their ranks
    # (then axis name). Walking the buckets in the order of their keys instead deadlocked: a
    # key names a rank's own groups, so with experts sharded over (0, 1) on ranks 0-1 and
    # over (2, 3) on ranks 2-3, ranks 0-1 reduced the expert bucket first and ranks 2-3 the
    # world's, and each waited for the other (FSDP1 FULL_SHARD with EP 2).
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for position in range(max((len(k) for k in groups), default=0)):
        by_group: dict[tuple, dist.ProcessGroup] = {}
        users: dict[tuple, list[tuple]] = defaultdict(list)
        for key, bucket_groups in groups.items():
            if position < len(key):
                axis, ranks = key[position]
                by_group[(ranks, axis)] = bucket_groups[position]
                users[(ranks, axis)].append(key)
        for group_id in sorted(by_group):
            keys = users[group_id]
            values = torch.stack([buckets[k] for k in keys])
            all_reduce_direct(values, op=op, group=by_group[group_id])
            for k, value in zip(keys, values.unbind(), strict=True):
                buckets[k] = value
    result = torch.zeros((), dtype=torch.float64, device=device)
    for key in sorted(buckets):
        value = buckets[key]
        result = torch.maximum(result, value) if is_inf else result + value
    return result if is_inf else result ** (1.0 / norm_type)


def _fsdp1_pieces(model: nn.Module) -> Iterator[_Piece]:
    """The gradient slices of every FSDP1 unit in ``model`` (Note [FSDP1 with tensor parallelism]).

    Yields a piece for every original parameter, also those outside this rank's shard (with
    no values), so that every rank creates the same buckets.
    """
    seen: set[int] = set()
    for fsdp in FullyShardedDataParallel.fsdp_modules(model):
        handle = fsdp1_compat.handle(fsdp)
        if handle is None:  # a unit that manages no parameters
            continue
        flat = handle.flat_param
        shard_key: tuple = ()
        shard_groups: tuple = ()
        if handle.uses_sharded_strategy:
            # HYBRID_SHARD's process_group is the shard group; replicas hold equal shards.
            shard_key = (("fsdp1_shard", tuple(dist.get_process_group_ranks(fsdp.process_group))),)
            shard_groups = (fsdp.process_group,)
        params = fsdp1_compat.original_params(flat)
        extensions = fsdp1_compat.param_extensions(flat)
        for i, info in enumerate(fsdp1_compat.shard_param_infos(flat)):
            if params is not None:  # use_orig_params: gradients are views per parameter
                if id(params[i]) in seen:
                    continue
                seen.add(id(params[i]))
                grad = params[i].grad if info.in_shard else None
            elif info.in_shard and flat.grad is not None:
                start, numel = info.offset_in_shard, info.numel_in_shard
                assert start is not None and numel is not None  # FSDP sets both when in_shard
                grad = flat.grad[start : start + numel]
            else:
                grad = None
            key, groups = shard_key, shard_groups
            spec = extensions[i]  # DTensorSpec of a TP parameter, else None
            if spec is not None:
                tp_key, tp_groups = _axes_of(spec.mesh, spec.placements)
                key, groups = key + tp_key, groups + tp_groups
            local = grad if grad is not None else torch.zeros(0)
            yield _Piece(local.to_local() if isinstance(local, DTensor) else local, key, groups)


def _fsdp1_managed(model: nn.Module) -> set[int]:
    handles = [fsdp1_compat.handle(fsdp) for fsdp in FullyShardedDataParallel.fsdp_modules(model)]
    return {
        id(p)
        for handle in handles
        if handle is not None
        for p in [handle.flat_param, *(fsdp1_compat.original_params(handle.flat_param) or ())]
    }


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clips the gradients of ``model`` in place to a total norm of ``max_norm``.

    Correct for FSDP1 (incl. HYBRID_SHARD and DTensor tensor parallelism inside FSDP1),
    FSDP2 (incl. HSDP and TP), DDP and tensor parallel (DTensor) parameters.

    Args:
        model: The (wrapped) model.
        max_norm: Largest allowed total norm.
        norm_type: p of the p-norm (``float("inf")`` for max).
        error_if_nonfinite: Raise if the total norm is nan or inf.

    Returns:
        The total norm before clipping: a float64 scalar on the parameters' device, the same
        value on every rank.

    Raises:
        RuntimeError: If ``error_if_nonfinite`` and the norm is not finite.
        ValueError: If ``norm_type`` is not positive.

    Example:
        >>> norm = tsm.grad_norm.clip_grad_norm_(model, 1.0)
    """
    if not norm_type > 0:
        raise ValueError(
            f"clip_grad_norm_(norm_type={norm_type}): the norm must be a p-norm with p > 0 or "
            "float('inf'); pass 2.0 (the default) for the Euclidean norm."
        )
    pieces = list(_fsdp1_pieces(model))
    managed = _fsdp1_managed(model) if pieces else set()
    grads = [p.grad for p in model.parameters() if id(p) not in managed and p.grad is not None]
    norm = _reduce(pieces + [_piece(g) for g in grads], norm_type, _device_of(model))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"the total gradient norm is {norm.item()}; gradients contain nan or inf. Lower the "
            "learning rate, check the loss, or pass error_if_nonfinite=False to clip anyway."
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # FSDP1 pieces are views into the flat gradient shards; other gradients are scaled through
    # their local tensors (a Partial DTensor's piece is a reduced copy, not the gradient).
    targets = [piece.local for piece in pieces]
    targets += [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for local in targets:
        if local.numel():
            local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return norm
