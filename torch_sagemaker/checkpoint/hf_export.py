"""Full export to a Hugging Face directory.

The directory counterpart of what SMP's ``FullStateDictConfig(translate_on_save=True)`` gives
an FSDP1 ``FULL_STATE_DICT`` (``sharding/fsdp1_state_dict.py``, the one implementation of that
keyword): full tensors under Hugging Face keys. ``tsm.transform`` keeps the Hugging Face
names, so nothing needs renaming; ``translate_fn`` is there for models whose parallel form
does rename or fuse tensors.

``save_hf_checkpoint`` gathers the sharded (FSDP1, FSDP2, TP) model into full tensors with
``torch.distributed.checkpoint.state_dict.get_model_state_dict``, which also strips wrapper
prefixes, so the keys are the Hugging Face module names. The coordinator then writes
``config.json`` and ``model.safetensors`` (or shards plus an index) into a staging directory
and publishes it atomically; ``AutoModelForCausalLM.from_pretrained(dir)`` loads it.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from huggingface_hub import constants as hub_constants
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from torch_sagemaker.checkpoint import atomic_dir
from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.marker import CheckpointError


def _unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside any wrappers (FSDP2 keeps the object).

    The outermost module holding a ``config`` of its own: FSDP1, activation-checkpointing
    and ``torch.compile`` wrappers only pass the attribute through. A model without one is
    taken from inside FSDP1 / DDP wrappers.
    """
    found = next((m for m in model.modules() if "config" in vars(m)), None)
    if found is not None:
        return found
    while (
        hasattr(model, "module")
        and isinstance(model.module, nn.Module)
        and not hasattr(model, "config")
    ):
        model = model.module
    return model


def _drop_shared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keeps the first key of tensors sharing storage (tied weights; safetensors refuses them)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in state_dict.items():
        ident = (v.untyped_storage().data_ptr(), cast(int, v.storage_offset()))  # eager: int
        if ident in seen and v.numel() > 0:
            continue
        seen.add(ident)
        out[k] = v
    return out


def _write_weights(
    state_dict: dict[str, torch.Tensor],
    directory: os.PathLike[str] | str,
    max_shard_size: int | str,
) -> None:
    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        save_file(
            {k: state_dict[k].contiguous() for k in keys},
            os.path.join(directory, filename),
            metadata={"format": "pt"},
        )
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(directory, hub_constants.SAFETENSORS_INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def save_hf_checkpoint(
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    *,
    config: Any = None,
    translate_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    max_shard_size: int | str = "5GB",
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
) -> None:
    """Writes the full model as a Hugging Face directory (config + safetensors), atomically.

    Every rank must call it (the gather is collective); only the coordinator writes.

    Args:
        model: The model, possibly FSDP1/FSDP2-wrapped and tensor parallel.
        output_dir: Target directory (replaced atomically if it exists).
        config: A ``PretrainedConfig``; default the model's own ``config``.
        translate_fn: Optional ``fn(state_dict) -> state_dict`` applied to the gathered
            state dict on the writing rank, for models whose parallel form renames or fuses
            tensors (a transformed model keeps its Hugging Face names and needs none).
        max_shard_size: Largest safetensors file; bigger models get several plus an index.
        process_group: Ranks that hold the model; default all ranks.
        coordinator_rank: Global rank that writes; default the group's first rank.

    Raises:
        ValueError: If no config is given and the model has none, the directory is an S3
            URI, or CUDA parameters are to be written by a rank other than global rank 0.
        CheckpointError: If writing failed on the coordinator (on every rank), an empty
            state dict included.
    """
    inner = _unwrap(model)
    own_config = config is None
    config = config if config is not None else getattr(inner, "config", None)
    if config is None:
        raise ValueError(
            f"{type(inner).__name__} has no .config; pass config=PretrainedConfig(...)."
        )
    path = atomic_dir.checkpoint_path(output_dir)  # refused before the gather
    participants = Participants(process_group, coordinator_rank)
    # On CPU every rank gathers (FSDP1's CPU offload of full state dicts crashes on CPU-only
    # jobs); with CUDA tensors the gather offloads to CPU on global rank 0 only, and every
    # other rank gets an empty dict: rank 0 must be the one that writes.
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda and participants.distributed and participants.coordinator != 0:
        raise ValueError(
            f"save_hf_checkpoint with CUDA parameters gathers the full model on global rank 0 "
            f"only, but rank {participants.coordinator} would write it: pass "
            "coordinator_rank=0 and a process_group that holds rank 0 (default: all ranks)."
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_cuda)
    # A model's state dict holds tensors only (ValueType also covers optimizer states).
    full = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))

    def write() -> None:
        if not full:
            raise CheckpointError(
                f"save_hf_checkpoint {path}: the gathered state dict is empty on the writing "
                "rank; nothing was written."
            )
        weights = full if translate_fn is None else translate_fn(full)  # the writer's only
        staging = atomic_dir.prepare_staging(path)
        described = _described(config, _model_class_name(model), weights, own=own_config)
        described.save_pretrained(staging)
        generation_config = getattr(inner, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(staging)
        weights = _drop_shared({k: v.detach().cpu() for k, v in weights.items()})
        _write_weights(weights, staging, max_shard_size)
        atomic_dir.commit(staging, path, {"kind": "hugging_face", "keys": len(weights)})

    participants.run_on_coordinator(write)


def _model_class_name(model: nn.Module) -> str:
    """The Hugging Face model's class name under any wrappers (``_unwrap``).

    FSDP2 swaps in a subclass named ``FSDP<class>``.
    """
    module = _unwrap(model)
    name = type(module).__name__
    return name.removeprefix("FSDP") if isinstance(module, FSDPModule) else name


def _described(
    config: Any, model_class: str, weights: dict[str, torch.Tensor], *, own: bool
) -> Any:
    """A copy of ``config`` saying what the export holds, as ``save_pretrained`` writes it.

    ``architectures`` (the class serving stacks and ``AutoModel`` pick: the model's, as
    ``save_pretrained`` sets it; a config the caller passed keeps the one it names) and
    ``dtype`` (the floating dtype most of the written weights have). The caller's config is
    not changed.
    """
    described = copy.deepcopy(config)
    if own or not getattr(described, "architectures", None):
        described.architectures = [model_class]
    counts: dict[torch.dtype, int] = {}
    for tensor in weights.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    if counts:
        described.dtype = max(counts, key=lambda d: counts[d])
    return described


__all__ = ["save_hf_checkpoint"]
