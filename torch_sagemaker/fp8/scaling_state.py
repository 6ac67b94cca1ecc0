"""The FP8 layers' delayed-scaling state as a checkpoint item of its own.

A resumed run that started its scales again from 1 and empty amax histories would quantize
its first steps differently from the run it continues (the first step's output gradients
partly flush to zero at scale 1). Transformer Engine keeps this state in each module's
``_extra_state`` entry of the model's state dict; here the model's state-dict keys stay
``nn.Linear``'s (Hugging Face exports, PEFT and loading plain weights see nothing new), and
the state is a separate item, ``"fp8"`` in ``TrainingState``'s checkpoints::

    {"<layer name>.amax_history": [amax_history_len, 3], "<layer name>.scale": [3]}

one pair per FP8 layer that ran with ``DelayedScaling`` (columns: input, weight, output
gradient), under the layer's Hugging Face name (FSDP1 and checkpoint wrapper prefixes left
out), as plain tensors. With the amaxes reduced over every rank (``reduce_amax=True``, the
default) every rank holds the same state, and DCP writes one copy; with ``reduce_amax=False``
ranks differ and a checkpoint keeps one rank's. A script that saves its own DCP dictionary
adds ``"fp8": scaling_state_dict(model)`` and, after ``dcp.load``, calls
``load_scaling_state_dict``; to load into layers that have not run yet, allocate the item
from the checkpoint's metadata (``empty_like_saved``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.fp8.linear import Fp8Linear

ITEM = "fp8"  # the item's name in TrainingState's checkpoints


def _fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    """The model's FP8 layers under their names without wrapper prefixes."""
    return {
        fsdp1_compat.clean_tensor_name(name): module
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear)
    }


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds ``Fp8Linear`` layers."""
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def scaling_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The delayed-scaling state of ``model``'s FP8 layers (module docstring); not copied.

    Layers that have not run with ``DelayedScaling`` have no state and no entry.
    """
    out: dict[str, torch.Tensor] = {}
    for name, layer in _fp8_layers(model).items():
        state = layer.fp8_scaling
        if state.history is not None and state.scale is not None:
            out[f"{name}.amax_history"], out[f"{name}.scale"] = state.history, state.scale
    return out


def load_scaling_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Restores what ``scaling_state_dict`` returned into ``model``'s FP8 layers.

    The next FP8 forward moves the state to its device and resizes the history if the
    recipe's ``amax_history_len`` changed (keeping the newest entries).

    Raises:
        ValueError: For an entry that names no FP8 layer of ``model`` or is malformed.
    """
    layers = _fp8_layers(model)
    names = {key.rpartition(".")[0] for key in state_dict}
    for name in sorted(names):
        history = state_dict.get(f"{name}.amax_history")
        scale = state_dict.get(f"{name}.scale")
        if name not in layers or history is None or scale is None:
            raise ValueError(
                f"FP8 scaling state entry {name!r}: expected '<FP8 layer name>.amax_history' "
                f"and '.scale' for a layer of this model ({len(layers)} FP8 layers, e.g. "
                f"{next(iter(layers), None)!r}); was the checkpoint written for another model?"
            )
        if history.ndim != 2 or history.shape[1] != 3 or tuple(scale.shape) != (3,):
            raise ValueError(
                f"FP8 scaling state of {name!r}: amax_history {tuple(history.shape)} and scale "
                f"{tuple(scale.shape)}; expected [amax_history_len, 3] and [3]."
            )
        layers[name].fp8_scaling.load(history, scale)


def empty_like_saved(shapes: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors to load a saved item into: ``{key: empty tensor of its saved size}``.

    Args:
        shapes: The item's keys and their saved sizes (``torch.Size`` or tuples of ints).
    """
    return {key: torch.empty(tuple(size), dtype=torch.float32) for key, size in shapes.items()}


__all__ = [
    "ITEM",
    "empty_like_saved",
    "has_fp8_layers",
    "load_scaling_state_dict",
    "scaling_state_dict",
]
