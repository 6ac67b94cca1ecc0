"""Expert parallelism for a fused experts module: split over the EP ranks, tokens dispatched.

``split_experts(module, ep_mesh, ...)`` turns every parameter of a Hugging Face experts
module (fused 3-D tensors, expert dimension first: ``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I), biases (E, ...)) into a DTensor ``Shard(0)`` on the ``ep`` mesh:
EP rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)``. Names and global shapes stay
Hugging Face's, so DCP checkpoints reshard across EP degrees and a full export gathers the
fused tensors. The module keeps its call signature ``(hidden (N, H), top_k_index (N, k),
top_k_weights (N, k)) -> (N, H)`` and becomes:

- all-to-all (``moe_all_to_all_dispatcher=True``): the (token, expert) pairs are sorted by
  expert, the counts exchanged, the token rows sent to the ranks of their experts
  (``all_to_all_single``, uneven splits), run through the local experts, sent back, weighted
  and summed per token on the rank that owns the token. Only routed rows travel.
- all-gather (``False``): every rank's tokens, expert indices and weights are gathered, each
  rank runs its experts on the rows routed to them (others carry the sentinel index, which
  Hugging Face's expert kernels skip) and the weighted partial outputs are reduce-scattered.

Both run the module's own forward (``config._experts_implementation``: eager loop, grouped
or batched matmul) on the local experts, so the expert arithmetic stays the model's.

Note [Expert gradient scale]: an expert's gradient on its rank sums the contributions of
the tokens of every rank of the EP group (the dispatch backward brings them home). FSDP then
averages it over the expert-data-parallel ranks, ``dp_size / ep`` of them, while every
other gradient is averaged over ``dp_size`` ranks. The local expert weights therefore pass
through ``scale_grad(w, 1 / ep)`` in forward: the averaged expert gradient is the mean over
all data-parallel ranks, as for a single process on the concatenated batch. Any wrapper
that averages expert gradients over the expert-data-parallel group (FSDP1 units and FSDP2
modules built by ``torch_sagemaker.sharding``) gets the right result.
"""

from __future__ import annotations

import types
from typing import Any, SupportsInt, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker.moe import collectives as coll
from torch_sagemaker.moe.unused_experts import may_leave_weights_unused, tie_to

#: Attribute set on an experts module that ``split_experts`` prepared (the sharding looks for it).
EXPERTS_ATTR = "_tsm_expert_parallel"


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in forward; multiplies the gradient by ``scale`` (Note [Expert gradient scale])."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class _LocalExperts:
    """The experts module as its forward sees it on this rank: local experts only.

    Parameters read through it are the local tensors of the EP DTensors, with the gradient
    scale of Note [Expert gradient scale]; ``num_experts`` is the local count, and
    ``_is_expert_parallel`` tells Hugging Face's kernels that the index ``num_experts`` is a
    sentinel (rows routed to other ranks).
    """

    compute_dtype: torch.dtype | None  # set by the expert parallel forward before each call

    def __init__(
        self, module: nn.Module, num_local: int, grad_scale: float, param_names: frozenset[str]
    ) -> None:
        self._module = module
        self._grad_scale = grad_scale
        # FSDP1 with use_orig_params swaps parameters for plain tensor views during forward,
        # so parameters are recognized by name, not by ``module._parameters``.
        self._param_names = param_names
        self.num_experts = num_local
        self._is_expert_parallel = True

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, torch.Tensor) and name in self._param_names:
            local = value.to_local() if isinstance(value, DTensor) else value
            return scale_grad(local, self._grad_scale)
        return value


def _ep_parameter(param: nn.Parameter, mesh: DeviceMesh, src_data_rank: int | None) -> nn.Parameter:
    if (
        src_data_rank is None
    ):  # meta or rank-local weights: take this rank's slice, no communication
        n = param.shape[0] // mesh.size()
        local = param.detach().narrow(0, mesh.get_local_rank() * n, n).clone()
        value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    else:
        value = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=src_data_rank)
    return nn.Parameter(value, requires_grad=param.requires_grad)


def split_experts(
    module: nn.Module, ep_mesh: DeviceMesh, *, all_to_all: bool, src_data_rank: int | None = 0
) -> nn.Module:
    """Splits the experts of ``module`` over ``ep_mesh`` and makes its forward dispatch tokens.

    Args:
        module: A fused experts module with ``num_experts`` and 3-D parameters (expert dim 0),
            called as ``module(hidden, top_k_index, top_k_weights)``.
        ep_mesh: 1-D mesh of the expert parallel group.
        all_to_all: Dispatch by all-to-all (else all-gather + reduce-scatter).
        src_data_rank: EP rank whose full weights are scattered; ``None`` keeps each rank's
            own slice (meta models, weights loaded later).

    Returns:
        ``module``, changed in place.

    Raises:
        ValueError: If the expert count is not divisible by the EP degree.
    """
    ep = ep_mesh.size()
    num_experts = int(cast(SupportsInt, module.num_experts))
    if num_experts % ep:
        raise ValueError(
            f"{type(module).__name__}: {num_experts} experts cannot be split over "
            f"expert_parallel_degree={ep} ranks; use a degree that divides {num_experts}."
        )
    holders = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    if holders:  # (DBRX's experts keep (experts x ffn, hidden) weights on a child)
        raise ValueError(
            f"{type(module).__name__} keeps expert weights on its child module(s) {holders}; "
            "expert parallelism splits fused (num_experts, ...) parameters the experts module "
            "holds itself. Split these experts with tensor_parallel_degree instead (whole "
            "experts per rank), or set expert_parallel_degree=1."
        )
    for name, param in list(module.named_parameters(recurse=False)):
        if param.dim() == 0 or param.shape[0] != num_experts:
            raise ValueError(
                f"{type(module).__name__}.{name} has shape {tuple(param.shape)}; expert "
                f"parallelism needs the expert dimension ({num_experts}) first."
            )
        # Assigned directly: SMP's scripts call tsm.transform under accelerate's
        # init_empty_weights(), whose patched register_parameter cannot rebuild a DTensor.
        nn_compat.own_parameters(module)[name] = _ep_parameter(param, ep_mesh, src_data_rank)
    num_local = num_experts // ep
    first = ep_mesh.get_local_rank() * num_local
    group = ep_mesh.get_group()
    names = frozenset(n for n, _ in module.named_parameters(recurse=False))
    local_view = _LocalExperts(module, num_local, 1.0 / ep, names)
    run_local = type(module).forward  # the model's own (implementation-dispatching) forward

    def forward(
        mod: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        local_view.compute_dtype = hidden.dtype if hidden.is_floating_point() else None
        if ep == 1:
            return run_local(local_view, hidden, top_k_index, top_k_weights)
        if all_to_all:
            return _dispatch_all_to_all(
                hidden, top_k_index, top_k_weights, run_local, local_view, num_experts, ep, group
            )
        return _dispatch_all_gather(
            hidden, top_k_index, top_k_weights, run_local, local_view, first, num_local, group
        )

    module.forward = types.MethodType(forward, module)
    setattr(module, EXPERTS_ATTR, True)
    return module


def _dispatch_all_to_all(
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    run_local: Any,
    local_view: _LocalExperts,
    num_experts: int,
    ep: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    num_local = num_experts // ep
    k = index.shape[1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) slots grouped by expert
    token = order // k
    counts = torch.bincount(flat, minlength=num_experts)
    # received[s * num_local + j]: rows source rank s sends to local expert j.
    received = coll.exchange_counts(counts, group)
    recv_per_expert = coll.checked_counts(received, "expert token counts")
    recv_rows = [sum(recv_per_expert[s * num_local : (s + 1) * num_local]) for s in range(ep)]
    send_rows = counts.view(ep, num_local).sum(1).tolist()
    x = coll.all_to_all_rows(hidden[token], recv_rows, send_rows, group)
    local_index = torch.repeat_interleave(
        torch.arange(num_local, device=hidden.device).repeat(ep),
        torch.tensor(recv_per_expert, device=hidden.device),
    )
    ones = torch.ones((x.shape[0], 1), dtype=weights.dtype, device=x.device)
    y = run_local(local_view, x, local_index[:, None], ones)
    if not x.shape[0] and may_leave_weights_unused(local_view._module):
        # Note [Experts without a token on this rank]: no row came here.
        y = tie_to(y, local_view, local_view._module, x)
    back = coll.all_to_all_rows(y, send_rows, recv_rows, group)
    weighted = (back * weights.reshape(-1)[order][:, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, token, weighted)


def _dispatch_all_gather(
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    run_local: Any,
    local_view: _LocalExperts,
    first: int,
    num_local: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    n = torch.tensor([hidden.shape[0]], dtype=torch.long, device=hidden.device)
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.long, device=hidden.device)
    with coll.DispatchTimer.measure(group):
        c10d_compat.all_gather_single(sizes, n, group=group)
    rows = coll.checked_counts(sizes, "token counts")
    x = coll.all_gather_rows(hidden, rows, group)
    all_index = coll.all_gather_rows(index, rows, group)
    all_weights = coll.all_gather_rows(weights, rows, group)
    local = all_index - first
    elsewhere = (local < 0) | (local >= num_local)
    local = local.masked_fill(elsewhere, num_local)  # the sentinel: skipped by the kernels
    all_weights = all_weights.masked_fill(elsewhere, 0.0)
    y = run_local(local_view, x, local, all_weights)
    module = local_view._module
    if may_leave_weights_unused(module) and bool(elsewhere.all()):
        # Note [Experts without a token on this rank]: every choice is another rank's.
        y = tie_to(y, local_view, module, x, all_weights)
    return coll.reduce_scatter_rows(y, rows, group)


def is_split(module: nn.Module) -> bool:
    """Whether ``split_experts`` prepared ``module``."""
    return bool(getattr(module, EXPERTS_ATTR, False))


__all__ = ["EXPERTS_ATTR", "is_split", "scale_grad", "split_experts"]
