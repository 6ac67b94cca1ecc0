"""What a rank actually holds, counted the way the memory model predicts it.

The validation of the memory model (tests/distributed/test_planner_memory.py and
``python -m benchmarks planner``) compares the planner's predictions with
these counts, taken on a real training step:

- ``census``: the bytes of the storages behind the parameters, gradients and optimizer
  state: DTensors count their local tensor, FSDP1 its flat parameters (the shard each rank
  keeps, padding included; the original parameters are views of it), FSDP2 the padded shard
  storage each parameter is a view of, gradients the buffers FSDP reduced them into.
  Storages are counted once however many tensors view them.
- ``SavedActivations``: a ``saved_tensors_hooks`` that counts the distinct storages autograd
  saves for backward, leaving out parameters (and views of them) and the model's buffers,
  which live anyway.

Note [Counting storages]
    Memory is held by storages, not tensors: a saved view of a larger tensor keeps the
    whole storage alive, and two views of one storage are one allocation. Both counters
    key storages by (device, data pointer) and add each one's ``nbytes`` once. A tensor
    subclass that wraps another (a DTensor's local shard, a functional collective's waited
    result) is looked through to the tensor that owns the storage.

Note [Saved tensors the forward frees]
    Autograd frees the saved tensors of graph parts that no output reaches (an MoE router's
    group selection, which only picks indices; auxiliary scores nothing uses) while the
    forward still runs. Such storages hold no memory between forward and backward, which is
    what the planner predicts (its probe drops them the same way: Note [Storages the forward
    frees] in ``torch_sagemaker/planner/probe_runs.py``). ``SavedActivations`` keeps a weak
    reference to every tensor it saw saved and counts a storage only while autograd still
    holds one of them; it holds the storages themselves, so no later storage takes a freed
    one's address.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.offload import hooks as offload_hooks


def storage_owner(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage holds ``tensor``'s data (Note [Counting storages])."""
    local, _ = offload_hooks.split_dtensor(tensor)
    inner = getattr(local, "elem", None)
    while type(local) not in (torch.Tensor, nn.Parameter) and isinstance(inner, torch.Tensor):
        local = inner  # a functional collective's result wraps the real tensor
        inner = getattr(local, "elem", None)
    return local


def _key(local: torch.Tensor) -> tuple[torch.device, int] | None:
    storage = local.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return local.device, storage.data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (Note [Counting storages])."""
    seen: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        local = storage_owner(tensor)
        key = _key(local)
        if key is not None:
            seen[key] = local.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class Census:
    """Bytes one rank holds for its model state.

    Attributes:
        parameters: Parameter storages (sharded, padded as the FSDP version keeps them).
        gradients: Gradient storages.
        optimizer: Optimizer state storages (every tensor in ``optimizer.state``).
    """

    parameters: int
    gradients: int
    optimizer: int


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters; FSDP1 units contribute their flat parameters."""
    found: list[torch.Tensor] = list(model.parameters())
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = fsdp1_compat.handle(unit)
        if handle is not None:
            found.append(handle.flat_param)
    return found


def census(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Census:
    """Counts the parameter, gradient and optimizer-state storages of this rank.

    Call it after ``backward`` (gradients exist) and before ``zero_grad``.
    """
    params = _parameters(model)
    grads = [p.grad for p in params if p.grad is not None]
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return Census(storage_bytes(params), storage_bytes(grads), storage_bytes(state))


def _state_storages(model: nn.Module) -> set[tuple[torch.device, int]]:
    """Keys of the storages of the model's parameters and buffers as they are now."""
    state = [*model.parameters(), *model.buffers(), *_parameters(model)]
    return {k for t in state if (k := _key(storage_owner(t))) is not None}


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages autograd saves for backward while it is active.

    Parameters, leaves that require grad, views of either, and storages of the model's
    parameters and buffers are left out: they live as long as the model. Use it around the
    forward pass of one step; ``bytes`` is then what the saved activations hold (Note
    [Counting storages]). Hooks nest innermost-first, so tensors that an inner hook takes
    (the offload engine's, or a non-reentrant checkpoint's inside its region) are not seen:
    with checkpointing this counts what each layer keeps (its inputs), as PyTorch keeps it.

    Args:
        model: The model whose parameters and buffers are left out.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._module_state = _state_storages(model)
        # The storages themselves: their size is read when asked, so a storage that FSDP
        # freed after the forward (a view of an all-gathered parameter) counts as what it
        # holds then.
        self.storages: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        # The saved tensors of each storage: one that autograd no longer holds any of when
        # asked was freed during the forward (Note [Saved tensors the forward frees]).
        self._saved: dict[tuple[Any, ...], list[weakref.ref]] = {}

        def pack(tensor: torch.Tensor) -> Any:
            self._record(tensor)
            return tensor

        super().__init__(pack, lambda packed: packed)

    def _record(self, tensor: torch.Tensor) -> None:
        local = storage_owner(tensor)
        if offload_hooks.is_parameter_like(tensor) or offload_hooks.is_parameter_like(local):
            return
        found = _key(local)
        if found is None or found in self._module_state:
            return
        key: tuple[Any, ...] = found
        held = self.storages.get(key)
        if held is not None and held.nbytes() == 0:
            # A storage saved earlier was freed since (FSDP resizes an unsharded parameter's
            # storage to nothing after its unit's forward) and its address now holds another
            # one: the freed one moves aside, so that every later save of the new storage
            # finds it under the address and counts it once.
            aside = (*key, "freed", len(self.storages))
            self.storages[aside] = self.storages.pop(key)
            self._saved[aside] = self._saved.pop(key, [])
        self.storages.setdefault(key, local.untyped_storage())
        self._saved.setdefault(key, []).append(weakref.ref(tensor))

    @property
    def bytes(self) -> int:
        """Bytes the distinct storages saved so far hold now.

        Storages that are the model's parameters now are left out too: FSDP1 keeps its root
        unit unsharded from forward to backward, and under tensor parallelism autograd saves
        DTensor views of it that do not look like parameters.
        """
        state = _state_storages(self._model)
        return sum(
            s.nbytes()
            for k, s in self.storages.items()
            if k[:2] not in state and any(ref() is not None for ref in self._saved[k])
        )


__all__ = ["Census", "SavedActivations", "census", "storage_bytes", "storage_owner"]
