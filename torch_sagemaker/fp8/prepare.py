"""The one step of ``tsm.transform`` that makes a model's linear layers FP8-capable.

Internal: ``tsm.transform`` calls ``prepare_linears`` after tensor parallelism; users get the
layers from ``tsm.transform`` (or ``to_fp8_linear``). The layers it chooses are the linear
layers of the policy's tensor parallel plan (styles ``colwise``, ``rowwise``,
``kv_colwise``): the attention projections and the MLP, in every transformer layer. It
leaves the embedding, the LM head and the norms in their precision, as Transformer Engine's
layers do, and also leaves modules that are not plain ``nn.Linear`` or that a parallel
style gave a forward of its own (key/value projections replicated because the model has
fewer kv heads than tensor parallel ranks, MoE routers and experts).

- Our layers by default: each chosen layer becomes an ``Fp8Linear`` (``to_fp8_linear``),
  which is ``nn.Linear`` outside an enabled ``fp8_autocast``, same class, parameters and
  state-dict keys for every user, FP8 or not.
- Transformer Engine's (backend ``"te"``): at tensor_parallel_degree > 1 the backend built
  ``te.Linear`` modules; at degree 1 the layers become unsplit ``te.Linear`` only when the
  script asked for that backend (``use_backend("te")``), because a ``te.Linear`` is not an
  ``nn.Linear`` (Hugging Face's weight init, PEFT and exports see another module, and its
  state dict gains ``_extra_state`` keys), and only on CUDA or meta parameters, where
  Transformer Engine's modules live. ``fp8_autocast`` then also enters Transformer Engine's
  region (``te_bridge.py``). NOT RUN: no Transformer Engine where this is developed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch_sagemaker.fp8 import te_bridge
from torch_sagemaker.fp8.linear import Fp8Linear, to_fp8_linear
from torch_sagemaker.policies import ModelPolicy
from torch_sagemaker.tensor_parallel.plan import matching_modules
from torch_sagemaker.tensor_parallel.te import unsplit_te_linears

FP8_STYLES = frozenset({"colwise", "rowwise", "kv_colwise"})


@dataclass(frozen=True)
class Fp8Report:
    """What ``prepare_linears`` did.

    Attributes:
        kind: ``"native"`` (``Fp8Linear``) or ``"te"`` (Transformer Engine's ``te.Linear``).
        layers: Names of the modules that run in FP8 inside ``fp8_autocast``.
        skipped: Names of plan layers left in their precision (own forward or not a Linear).
    """

    kind: str
    layers: tuple[str, ...]
    skipped: tuple[str, ...]


def _plan_layers(model: nn.Module, policy: ModelPolicy) -> list[str]:
    names: list[str] = []
    for pattern, style in policy.tp_plan.items():
        if style in FP8_STYLES:
            names += [n for n in matching_modules(model, pattern) if n not in names]
    return names


def _check_te_devices(model: nn.Module, names: list[str]) -> None:
    """Refuses to build unsplit ``te.Linear`` layers from parameters off CUDA and meta."""
    for name in names:
        module = model.get_submodule(name)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type not in ("cuda", "meta"):
            raise ValueError(
                f"use_backend('te') at tensor_parallel_degree 1 makes the plan's linear layers "
                f"Transformer Engine's te.Linear, which keeps its parameters on CUDA; {name!r} "
                f"is on {weight.device}. Pass device='cuda' to tsm.transform (or build the "
                "model on CUDA or meta), or call use_backend(None) before tsm.transform for "
                "torch_sagemaker's FP8 layers."
            )


def prepare_linears(
    model: nn.Module, policy: ModelPolicy, *, backend: str, tp: int, backend_forced: bool = False
) -> Fp8Report:
    """Makes the plan's linear layers of ``model`` FP8-capable, in place (module docstring).

    Args:
        model: The model ``tsm.transform`` is building (tensor parallelism applied).
        policy: Its policy.
        backend: Name of the tensor parallel backend (``"dtensor"``, ``"te"``).
        tp: The tensor parallel degree.
        backend_forced: Whether the script chose the backend (``use_backend``) rather than
            the automatic choice; Transformer Engine layers at degree 1 need it.

    Returns:
        An ``Fp8Report``.

    Raises:
        ValueError: For Transformer Engine layers at degree 1 from parameters that are
            neither on CUDA nor meta.
    """
    if backend == "te" and tp > 1:
        layers = [
            n
            for n in _plan_layers(model, policy)
            if type(model.get_submodule(n)).__module__.startswith("transformer_engine")
        ]
        te_bridge.note_te_layers()
        return Fp8Report("te", tuple(layers), ())
    if backend == "te" and backend_forced:
        _check_te_devices(model, _plan_layers(model, policy))
        layers = unsplit_te_linears(model, policy)
        te_bridge.note_te_layers()
        return Fp8Report("te", tuple(layers), ())
    layers, skipped = [], []
    for name in _plan_layers(model, policy):
        module = model.get_submodule(name)
        if type(module) is nn.Linear and "forward" not in vars(module):
            to_fp8_linear(module)
            layers.append(name)
        elif not isinstance(module, Fp8Linear):
            skipped.append(name)
    return Fp8Report("native", tuple(layers), tuple(skipped))


__all__ = ["FP8_STYLES", "Fp8Report", "prepare_linears"]
