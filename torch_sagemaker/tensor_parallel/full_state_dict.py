"""``model.load_state_dict(full_state_dict)`` into a tensor-parallel model.

Note [Loading full tensors into tensor-parallel parameters]
    After ``tsm.transform`` with ``tensor_parallel_degree > 1`` the sharded parameters are
    DTensors, and ``nn.Module.load_state_dict`` copies each value with ``param.copy_(value)``,
    which DTensor refuses for a plain tensor ("mixed torch.Tensor and DTensor"). So a
    Hugging Face state dict (``AutoModelForCausalLM.from_pretrained(...).state_dict()``,
    ``safetensors.torch.load_file``, the full export of ``FullStateDictConfig``) did not load
    into the model it came from; PyTorch's answer is ``set_model_state_dict(...,
    full_state_dict=True)``, which users of plain ``load_state_dict`` do not know to look for.

    ``accept_full_tensors(model)`` registers a load pre-hook on the transformed model: a plain
    tensor whose key names a DTensor parameter or buffer of the model, with that tensor's
    global shape, is split into the same placements before the copy. Every rank holds the
    full value, so each takes its own shard with no communication (``distribute_tensor``
    with ``src_data_rank=None``). DTensor values, other shapes (PyTorch's size-mismatch
    error follows) and plain parameters pass through unchanged. Parameters FSDP2 shards over
    the data-parallel ranks too are DTensors on its 2-D mesh and get the same treatment;
    under FSDP1 the module's parameters are plain views, and FSDP's own state-dict types
    apply.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _as_placed_like(value: torch.Tensor, target: DTensor) -> DTensor:
    """``value`` (the full tensor, equal on every rank) split as ``target`` is."""
    mesh = target.device_mesh
    if value.device.type != mesh.device_type:
        value = value.to(target.to_local().device)
    return distribute_tensor(value, mesh, target.placements, src_data_rank=None)


def _split_full_tensors(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, target in named:
        key = prefix + name
        value = state_dict.get(key)
        if (
            isinstance(target, DTensor)
            and type(value) is torch.Tensor
            and value.shape == target.shape
        ):
            state_dict[key] = _as_placed_like(value, target)


def accept_full_tensors(model: nn.Module) -> None:
    """Lets ``model.load_state_dict`` take full tensors for its DTensor parameters.

    Note [Loading full tensors into tensor-parallel parameters].

    Args:
        model: The model ``tsm.transform`` made tensor parallel.
    """
    model.register_load_state_dict_pre_hook(_split_full_tensors)


__all__ = ["accept_full_tensors"]
