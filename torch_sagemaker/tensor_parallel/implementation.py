"""The two tensor parallel implementations behind one interface, and the automatic choice.

(``use_backend``/``select_backend`` call them backends, as SMP does; the collective backend
"smddp" is ``torch_sagemaker.smddp.backend``, unrelated.)

- ``DTensorBackend``: PyTorch-native (``parallelize_module`` with DTensor styles). Runs on
  any device, including CPU; this is what the test suite exercises.
- ``TransformerEngineBackend`` (``tensor_parallel.te``, name ``"te"``): swaps the plan's
  linear layers for Transformer Engine modules. Chosen automatically for
  tensor_parallel_degree > 1 when ``transformer_engine`` imports and CUDA is available;
  ``use_backend("dtensor")`` overrides the choice. At degree 1 nothing is split, and the
  layers become Transformer Engine's only with ``use_backend("te")`` (FP8 through
  Transformer Engine, ``torch_sagemaker/fp8/prepare.py``).

Both take the same arguments and leave module names and state_dict keys unchanged.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torch_sagemaker.policies import HeadSplit, ModelPolicy
from torch_sagemaker.tensor_parallel.plan import apply_tp_plan
from torch_sagemaker.tensor_parallel.random import RNGStatesTracker

# te.py imports transformer_engine only inside its functions: importing it is cheap and works
# without Transformer Engine.
from torch_sagemaker.tensor_parallel.te import TransformerEngineBackend
from torch_sagemaker.tensor_parallel.te import supports as te_supports


class TPBackend(Protocol):
    """A tensor parallel implementation."""

    name: str

    def apply(
        self,
        model: nn.Module,
        policy: ModelPolicy,
        heads: HeadSplit,
        *,
        tp_mesh: DeviceMesh,
        tracker: RNGStatesTracker,
        src_data_rank: int | None,
    ) -> None:
        """Tensor-parallelizes ``model`` in place (see ``plan.apply_tp_plan`` for the arguments)."""
        ...


class DTensorBackend:
    """PyTorch DTensor tensor parallelism (``plan.apply_tp_plan``)."""

    name = "dtensor"

    def apply(
        self,
        model: nn.Module,
        policy: ModelPolicy,
        heads: HeadSplit,
        *,
        tp_mesh: DeviceMesh,
        tracker: RNGStatesTracker,
        src_data_rank: int | None,
    ) -> None:
        """See ``TPBackend.apply``."""
        apply_tp_plan(model, tp_mesh, policy, heads, tracker=tracker, src_data_rank=src_data_rank)


_FORCED: str | None = None


def te_available() -> bool:
    """Whether Transformer Engine can be used: the package is installed and CUDA is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_backend(name: str | None) -> None:
    """Forces ``"dtensor"`` or ``"te"`` for later ``tsm.transform`` calls; ``None`` restores auto.

    Raises:
        ValueError: For another name, or ``"te"`` when Transformer Engine is unavailable.
    """
    global _FORCED
    if name not in (None, "dtensor", "te"):
        raise ValueError(
            f"tensor parallel backend {name!r}; use 'dtensor', 'te' or None (automatic)."
        )
    if name == "te" and not te_available():
        raise ValueError(
            "the 'te' backend needs transformer_engine and CUDA; neither is usable here."
        )
    _FORCED = name


def forced_backend() -> str | None:
    """The name ``use_backend`` forced (``"dtensor"`` or ``"te"``), ``None`` for automatic."""
    return _FORCED


def select_backend(policy: ModelPolicy | None = None) -> TPBackend:
    """The forced backend, else Transformer Engine or DTensor, chosen for ``policy``.

    Automatic choice: Transformer Engine when it is available and runs ``policy``'s styles
    (``te.supports``; a plan built from transformers' is not), else DTensor.
    """
    automatic = "te" if te_available() and (policy is None or te_supports(policy)) else "dtensor"
    name = _FORCED or automatic
    if name == "te":
        return TransformerEngineBackend()
    return DTensorBackend()


__all__ = [
    "DTensorBackend",
    "TPBackend",
    "forced_backend",
    "select_backend",
    "te_available",
    "use_backend",
]
