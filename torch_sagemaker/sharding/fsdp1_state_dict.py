"""FSDP1 full state dicts of tensor-parallel models: full tensors with Hugging Face keys.

SMP adds ``translate_on_save`` (default ``True``) to PyTorch's ``FullStateDictConfig``: a
``FULL_STATE_DICT`` of a model that went through ``tsm.transform`` is a plain Hugging Face
state dict, so SMP's example scripts can ``torch.save`` it as ``pytorch_model.bin`` and
``from_pretrained`` loads it. Our transformed models already keep Hugging Face names; what
is left is gathering the tensor-parallel DTensors into full tensors (Note [Full state dict
under TP]). ``install()`` (called by ``tsm.init``) adds the keyword; ``attach(fsdp_module)``
(called for every FSDP1 unit ``tsm.init``'s patch builds around DTensor parameters) adds the
hooks.

Note [Full state dict under TP]
-------------------------------
With ``rank0_only=True`` FSDP1 frees the unsharded parameters on every rank but 0 right
after its all-gather, so rank 0 would hold only its own TP shard of each parameter (a
DTensor whose ``to_local()`` is half the tensor). So, for each FSDP unit, a pre-hook placed
before FSDP's own asks FSDP for ``rank0_only=False, offload_to_cpu=False``; the post-hook
(after FSDP's) gathers every TP value of the unit over its TP group (all ranks take part),
then applies what the caller asked: ranks other than 0 drop the unit's entries when
``rank0_only``, and tensors move to CPU when ``offload_to_cpu``. Peak memory is one unit's
full parameters at a time; ``translate_on_save=False`` keeps FSDP's own result (DTensors).
``NO_SHARD`` units hold TP-local plain tensors (Note [FSDP1 NO_SHARD with DTensor
parameters] in ``fsdp1_layout``); their flat parameter's recorded DTensor specs say how the
full tensors are made of them. A tied parameter's later names (``lm_head.weight`` of a model
with tied embeddings) have no spec of their own (Note [Tied DTensor parameters under FSDP1]
in ``fsdp1_tied``): they get their primary's full tensor, one object under both keys as in
the unsharded model's state dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel,
    StateDictType,
)
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker.sharding import fsdp1_tied

_TRANSLATE_ATTR = "translate_on_save"
# On an FSDP1 unit: the config its state_dict() call asked for while the hooks translate.
_REQUESTED_ATTR = "_tsm_requested_config"
_original_config_init = FullStateDictConfig.__init__


def _config_init(
    self: FullStateDictConfig, *args: Any, translate_on_save: bool = True, **kwargs: Any
) -> None:
    _original_config_init(self, *args, **kwargs)
    setattr(self, _TRANSLATE_ATTR, translate_on_save)


def install() -> None:
    """Adds SMP's ``translate_on_save=True`` keyword to ``FullStateDictConfig`` (idempotent)."""
    FullStateDictConfig.__init__ = _config_init  # type: ignore[method-assign]
    setattr(FullStateDictConfig, _TRANSLATE_ATTR, True)  # instances made before install()


def uninstall() -> None:
    """Restores PyTorch's ``FullStateDictConfig``."""
    FullStateDictConfig.__init__ = _original_config_init  # type: ignore[method-assign]
    if _TRANSLATE_ATTR in vars(FullStateDictConfig):
        delattr(FullStateDictConfig, _TRANSLATE_ATTR)


def _translating(unit: FullyShardedDataParallel) -> bool:
    config = fsdp1_compat.state_dict_config(unit)
    return fsdp1_compat.state_dict_type(unit) is StateDictType.FULL_STATE_DICT and getattr(
        config, _TRANSLATE_ATTR, True
    )


def _pre_state_dict(unit: FullyShardedDataParallel, prefix: str, keep_vars: bool) -> None:
    if _translating(unit):
        setattr(unit, _REQUESTED_ATTR, fsdp1_compat.state_dict_config(unit))
        fsdp1_compat.set_state_dict_config(
            unit, FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        )


def _full_values(unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str) -> None:
    """Replaces the unit's TP/EP values by full tensors (collectives over their groups)."""
    handle = fsdp1_compat.handle(unit)
    # A tied parameter's later names (the primary is in ``fqns``) get the primary's full value.
    shared: dict[str, str] = {}
    if handle is not None:
        flat_param = handle.flat_param
        shared = {
            prefix + fsdp1_compat.clean_tensor_name(name): prefix
            + fsdp1_compat.clean_tensor_name(primary)
            for name, primary in fsdp1_tied.shared_fqns(flat_param)
        }
        for fqn, spec in zip(
            fsdp1_compat.fqns(flat_param), fsdp1_compat.param_extensions(flat_param), strict=True
        ):
            key = prefix + fsdp1_compat.clean_tensor_name(fqn)
            value = state_dict.get(key)
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and spec is not None
            ):
                state_dict[key] = DTensor.from_local(
                    value,
                    spec.mesh,
                    spec.placements,
                    shape=spec.shape,
                    stride=spec.stride,
                    run_check=False,
                ).full_tensor()
    # Flattened DTensors, and those FSDP leaves alone (ignored modules, e.g. experts held
    # whole by their EP rank); the keys come in the same order on every rank.
    for key in [
        k
        for k, v in state_dict.items()
        if k.startswith(prefix) and isinstance(v, DTensor) and k not in shared
    ]:
        state_dict[key] = state_dict[key].full_tensor()
    for key, primary in shared.items():
        if key in state_dict and primary in state_dict:
            state_dict[key] = state_dict[primary]


def _post_state_dict(
    unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    requested = getattr(unit, _REQUESTED_ATTR)
    if requested is None:
        return
    fsdp1_compat.set_state_dict_config(unit, requested)
    setattr(unit, _REQUESTED_ATTR, None)
    _full_values(unit, state_dict, prefix)
    if requested.rank0_only and dist.get_rank() != 0:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
    elif requested.offload_to_cpu:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if isinstance(state_dict[key], torch.Tensor):
                state_dict[key] = state_dict[key].cpu()


def attach(unit: FullyShardedDataParallel) -> None:
    """Adds the full-state-dict hooks of this module to one FSDP1 unit of a TP or EP model.

    Args:
        unit: An FSDP1 unit whose parameters include DTensors (flattened or left to FSDP).
    """
    setattr(unit, _REQUESTED_ATTR, None)
    pre = unit.register_state_dict_pre_hook(_pre_state_dict)
    # Before FSDP's own pre-hook, which unshards according to the config we adjust.
    nn_compat.state_dict_pre_hooks(unit).move_to_end(pre.id, last=False)
    nn_compat.register_state_dict_hook(unit, _post_state_dict)  # after FSDP's post-hook


__all__ = ["attach", "install", "uninstall"]
