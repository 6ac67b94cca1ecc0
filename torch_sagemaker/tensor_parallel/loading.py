"""``load_state_dict_from_rank0``: rank 0 holds the real weights, every other rank a meta model.

Order of operations (see ``_transform.transform``):

1. ``capture_rank0_state`` (before TP): rank 0 keeps a reference to each full parameter and
   buffer by name. Nothing is copied.
2. The TP plan is applied on every rank with ``src_data_rank=None`` (a local split, no
   communication): rank 0's parameters become real local shards of its weights, the other
   ranks' parameters meta shards.
3. ``broadcast_from_rank0``: the other ranks allocate their shards (``to_empty``, keeping
   tied weights tied); the ranks check that they hold the same tensors (Note [One tensor
   list for the broadcast]); then, one tensor at a time, rank 0 broadcasts the full value
   and every rank copies its own shard out of it. Peak extra memory on a receiving rank is
   one full tensor, not the model. Buffers are broadcast too: non-persistent ones such as
   RoPE's ``inv_freq`` are not in any checkpoint and would otherwise stay uninitialized
   after ``to_empty``.

Broadcasting to every rank (rather than only to rank 0's TP group) makes FSDP1's
``sync_module_states`` unnecessary and works the same with FSDP2, which has no such option.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torch_sagemaker.utils.module_utils import to_empty_keeping_ties


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
    mine: list[tuple], rank0: list[tuple], here: str = "here", there: str = "on rank 0"
) -> str | None:
    """Where this rank's tensors (name, shape[, dtype]; in order) first differ from rank 0's.

    ``here`` and ``there`` say where each list comes from, for the message.
    """

    def describe(entry: tuple) -> str:
        return " ".join([entry[0], str(list(entry[1])), *entry[2:]])

    for i, (a, b) in enumerate(zip(mine, rank0)):
        if a != b:
            return f"tensor {i} is {describe(a)} {here} and {describe(b)} {there}"
    if len(mine) != len(rank0):
        return f"{len(mine)} tensors {here} and {len(rank0)} {there}"
    return None


def _entry(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """(name, global shape, dtype): what a broadcast of ``tensor`` must agree on."""
    return name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")


def _check_broadcast_pairs(
    named: list[tuple[str, torch.Tensor]], rank0_state: dict[str, torch.Tensor] | None
) -> None:
    """Raises on every rank unless every rank will receive what rank 0 sends, tensor by tensor.

    Note [One tensor list for the broadcast]: ``broadcast_from_rank0`` makes one broadcast
    per tensor of ``_named_tensors``, paired by position only. If one rank's list is longer
    (a tie lost on some ranks: ``to_empty`` once untied ``lm_head.weight`` from
    ``embed_tokens.weight`` on the receiving ranks with tensor parallel degree 1), the
    ranks with more tensors wait forever for a broadcast rank 0 never makes; if a shape or
    dtype differs, a broadcast pairs buffers of different sizes. ``capture_rank0_state``
    compares the models before TP, but TP, EP and the receivers' allocation all come after
    it, so the lists are compared again right before the first broadcast: one all-gather of
    (name, shape, dtype) per tensor, with rank 0's source tensors checked against its own
    list too (a name TP renamed would fail on rank 0 alone, in the middle of the loop). Every
    rank sees all the lists and so raises the same error, or none.
    """
    layout = [_entry(name, t) for name, t in named]
    source_problem = None
    if dist.get_rank() == 0:
        assert rank0_state is not None  # capture_rank0_state's result on rank 0
        missing = [name for name, _ in named if name not in rank0_state]
        if missing:
            source_problem = f"no weight captured for {missing[:4]}"
        else:
            source = [_entry(name, rank0_state[name]) for name, _ in named]
            source_problem = _first_difference(
                source, layout, "in its captured weights", "in its model"
            )
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (layout, source_problem))
    rank0_layout, source_problem = every[0]
    problems = []
    if source_problem is not None:
        problems.append(f"on rank 0, {source_problem}")
    for rank, (other, _) in enumerate(every):
        difference = _first_difference(other, rank0_layout, f"on rank {rank}")
        if difference is not None:
            problems.append(difference)
    if problems:
        raise RuntimeError(
            "load_state_dict_from_rank0=True: the tensors rank 0 broadcasts and those the other "
            f"ranks receive do not pair up after sharding ({'; '.join(problems[:4])}); no "
            "weights were sent. Build the model from the same config and dtype on every rank "
            "(Note [One tensor list for the broadcast])."
        )


def broadcast_from_rank0(
    model: nn.Module, rank0_state: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Gives every rank its shard of rank 0's weights (collective over the default group).

    Args:
        model: The model after TP (DTensor or plain parameters).
        rank0_state: ``capture_rank0_state`` on rank 0; ignored elsewhere.
        device: Where the receiving ranks allocate their tensors.

    Raises:
        RuntimeError: On every rank, before any weight is sent, if some rank's tensors
            (names, shapes, dtypes, in order) differ from rank 0's.
    """
    is_src = dist.get_rank() == 0
    if not is_src:
        to_empty_keeping_ties(model, device)
    named = _named_tensors(model)
    _check_broadcast_pairs(named, rank0_state)
    with torch.no_grad():
        for name, tensor in named:
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
