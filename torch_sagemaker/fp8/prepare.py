"""The one step of ``tsm.transform`` that makes a model's linear layers FP8-capable.

``prepare_linears`` runs after tensor parallelism. The layers it chooses are the linear
layers of the policy's tensor parallel plan (styles ``colwise``, ``rowwise``,
``kv_colwise``): the attention projections and the MLP, in every transformer layer. It
leaves the embedding, the LM head and the norms in their precision, as Transformer Engine's
layers do, and also leaves modules that are not plain ``nn.Linear`` or that a parallel
style gave a forward of its own (key/value projections replicated because the model has
fewer kv heads than tensor parallel ranks, MoE routers and experts).

- DTensor backend or no tensor parallelism: each chosen layer becomes an ``Fp8Linear``
  (``to_fp8_linear``), which is ``nn.Linear`` outside an enabled ``fp8_autocast``.
- Transformer Engine backend: the layers are ``te.Linear`` modules (split ones from the
  backend, unsplit ones made here at tensor_parallel_degree 1), and ``fp8_autocast`` also
  enters Transformer Engine's region (``te_bridge.py``). NOT RUN: no Transformer Engine
  where this is developed.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torch_sagemaker.fp8 import te_bridge
from torch_sagemaker.fp8.linear import to_fp8_linear
from torch_sagemaker.policies import ModelPolicy
from torch_sagemaker.tensor_parallel.plan import matching_modules
from torch_sagemaker.tensor_parallel.te import unsplit_te_linears

FP8_STYLES = frozenset({"colwise", "rowwise", "kv_colwise"})


@dataclass(frozen=True)
class Fp8Report:
    """What ``prepare_linears`` did.

    Attributes:
        kind: ``"native"`` (``Fp8Linear``) or ``"transformer_engine"``.
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


def prepare_linears(model: nn.Module, policy: ModelPolicy, *, backend: str, tp: int) -> Fp8Report:
    """Makes the plan's linear layers of ``model`` FP8-capable, in place (module docstring).

    Args:
        model: The model ``tsm.transform`` is building (tensor parallelism applied).
        policy: Its policy.
        backend: Name of the tensor parallel backend (``"dtensor"``, ``"transformer_engine"``).
        tp: The tensor parallel degree.

    Returns:
        An ``Fp8Report``.
    """
    if backend == "transformer_engine":
        if tp == 1:
            layers = unsplit_te_linears(model, policy)
        else:
            layers = [
                n
                for n in _plan_layers(model, policy)
                if type(model.get_submodule(n)).__module__.startswith("transformer_engine")
            ]
        te_bridge.note_te_layers()
        return Fp8Report("transformer_engine", tuple(layers), ())
    layers, skipped = [], []
    for name in _plan_layers(model, policy):
        module = model.get_submodule(name)
        if type(module) is nn.Linear and "forward" not in vars(module):
            to_fp8_linear(module)
            layers.append(name)
        elif type(module).__name__ != "Fp8Linear":
            skipped.append(name)
    return Fp8Report("native", tuple(layers), tuple(skipped))


__all__ = ["FP8_STYLES", "Fp8Report", "prepare_linears"]
