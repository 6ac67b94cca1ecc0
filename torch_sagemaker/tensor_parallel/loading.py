"""``load_state_dict_from_rank0``: rank 0 holds the real weights, every other rank a meta model.

Order of operations (see ``_transform.transform``):

1. ``capture_rank0_state`` (before TP): rank 0 keeps a reference to each full parameter and
   buffer by name. Nothing is copied.
2. The TP plan is applied on every rank with ``src_data_rank=None`` (a local split, no
   communication): rank 0's parameters become real local shards of its weights, the other
   ranks' parameters meta shards.
3. ``broadcast_from_rank0``: the other ranks allocate their shards (``to_empty``); then,
   one tensor at a time, rank 0 broadcasts the full value and every rank copies its own
   shard out of it. Peak extra memory on a receiving rank is one full tensor, not the
   model. Buffers are broadcast too: non-persistent ones such as RoPE's ``inv_freq`` are
   not in any checkpoint and would otherwise stay uninitialized after ``to_empty``.

Broadcasting to every rank (rather than only to rank 0's TP group) makes FSDP1's
``sync_module_states`` unnecessary and works the same with FSDP2, which has no such option.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers, each shared tensor once, in a rank-independent order."""
    return [*model.named_parameters(), *model.named_buffers()]


def capture_rank0_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """References to rank 0's full parameters and buffers, by name (call before TP, on every rank).

    Collective: rank 0 tells every rank whether its weights are real and what its tensors
    are (names and shapes, in order: one broadcast), and every rank says whether its own
    model has the same (one all-gather). So a rank-0 model on the meta device, or a model
    built differently on some rank (a weight tied on rank 0 but not elsewhere gives one
    parameter fewer), stops every rank with the same error, instead of the weight broadcast
    pairing different tensors.

    Returns:
        The references on rank 0, ``None`` on the other ranks.

    Raises:
        ValueError: On every rank, if a tensor of rank 0's model is on the meta device, or
            if some rank's tensors differ from rank 0's in name, shape or order.
    """
    is_src = dist.get_rank() == 0
    named = _named_tensors(model)
    tensors = dict(named) if is_src else {}
    meta = [name for name, t in tensors.items() if t.is_meta]
    layout = [(name, tuple(t.shape)) for name, t in named]
    problem: list = [None, layout if is_src else None]
    if meta:
        problem[0] = (
            f"load_state_dict_from_rank0=True needs real weights on rank 0, but {len(meta)} "
            f"of rank 0's tensors are on the meta device ({meta[:4]}). Load the weights on "
            "rank 0 (e.g. from_pretrained) and build the model on meta only on the other "
            "ranks."
        )
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ValueError(problem[0])
    if dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, _first_difference(layout, problem[1]))
        for rank, difference in enumerate(every):
            if difference is not None:
                raise ValueError(
                    f"load_state_dict_from_rank0=True needs the same model on every rank, but "
                    f"rank {rank}'s differs from rank 0's: {difference}. Build it from the "
                    "same config everywhere (from_pretrained on rank 0, from_config under "
                    "init_empty_weights elsewhere) with the same weights tied."
                )
    return {name: t.detach() for name, t in tensors.items()} if is_src else None


def _first_difference(
    mine: list[tuple[str, tuple[int, ...]]], rank0: list[tuple[str, tuple[int, ...]]]
) -> str | None:
    """Where this rank's tensors (name, shape; in order) first differ from rank 0's."""
    for i, (a, b) in enumerate(zip(mine, rank0)):
        if a != b:
            return f"tensor {i} is {a[0]} {list(a[1])} here and {b[0]} {list(b[1])} on rank 0"
    if len(mine) != len(rank0):
        return f"{len(mine)} tensors here and {len(rank0)} on rank 0"
    return None


def broadcast_from_rank0(
    model: nn.Module, rank0_state: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Gives every rank its shard of rank 0's weights (collective over the default group).

    Args:
        model: The model after TP (DTensor or plain parameters).
        rank0_state: ``capture_rank0_state`` on rank 0; ignored elsewhere.
        device: Where the receiving ranks allocate their tensors.
    """
    is_src = dist.get_rank() == 0
    if not is_src:
        model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            if is_src:
                assert rank0_state is not None  # capture_rank0_state's result on rank 0
                full = rank0_state[name].to(tensor.device).contiguous()
            else:
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            dist.broadcast(full, src=0)
            if isinstance(tensor, DTensor):
                shard = distribute_tensor(
                    full, tensor.device_mesh, tensor.placements, src_data_rank=None
                ).to_local()
                tensor.to_local().copy_(shard)
            else:
                tensor.copy_(full)


__all__ = ["broadcast_from_rank0", "capture_rank0_state"]
