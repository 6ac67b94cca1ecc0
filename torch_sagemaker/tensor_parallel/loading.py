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

    Collective: rank 0 tells every rank whether its weights are real (one small broadcast),
    so that a rank-0 model on the meta device stops every rank with the same error instead
    of rank 0 alone while the others wait in the weight broadcast.

    Returns:
        The references on rank 0, ``None`` on the other ranks.

    Raises:
        ValueError: On every rank, if a tensor of rank 0's model is on the meta device.
    """
    is_src = dist.get_rank() == 0
    tensors = dict(_named_tensors(model)) if is_src else {}
    meta = [name for name, t in tensors.items() if t.is_meta]
    problem: list[str | None] = [None]
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
    return {name: t.detach() for name, t in tensors.items()} if is_src else None


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
