"""Transformer Engine's FP8 region next to ours: entered with ours, or noticed without it.

NOT RUN with Transformer Engine: it is not installed on any machine this package is
developed or checked on (docs/fp8.md, "What ran where"); the tests stand in for its modules.
Written against Transformer Engine's documented API: ``transformer_engine.pytorch.
fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)``, ``transformer_engine.common.
recipe.{DelayedScaling, Float8CurrentScaling, Format}``, and its region's state,
``FP8GlobalStateManager.is_fp8_enabled()`` (``transformer_engine.pytorch.quantization``,
``transformer_engine.pytorch.fp8`` before it).

Which layers exist decides what a region does:

- Transformer Engine layers (``tsm.transform`` with ``use_backend("te")``, on CUDA with
  ``transformer_engine``) only switch to FP8 inside Transformer Engine's own region. A
  script written against ``torch.sagemaker.fp8.fp8_autocast`` gets that region too, with
  its recipe translated (or passed through when it is one of Transformer Engine's). Scripts
  that call Transformer Engine themselves, as SMP's do, never come here.
- Our ``Fp8Linear`` layers only switch to FP8 inside ours. A script that enters Transformer
  Engine's region around them (SMP's, unchanged) would silently train in high precision;
  ``te_fp8_enabled`` lets the layer warn once instead.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from torch_sagemaker.fp8.recipe import DelayedScaling, Float8CurrentScaling, Recipe

# Which kinds of FP8 layers were built in this process (never reset: a process that built
# ours once keeps refusing recipes they cannot run, the safe side).
_TE_LAYERS_BUILT = False
_NATIVE_LAYERS_BUILT = False

# Where Transformer Engine keeps its region's state, newest first.
_TE_STATE_MODULES = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")


def note_te_layers() -> None:
    """Records that a model now holds Transformer Engine layers (``prepare.prepare_linears``)."""
    global _TE_LAYERS_BUILT
    _TE_LAYERS_BUILT = True


def note_native_layers() -> None:
    """Records that ``Fp8Linear`` layers exist (``linear.to_fp8_linear``)."""
    global _NATIVE_LAYERS_BUILT
    _NATIVE_LAYERS_BUILT = True


def only_te_layers() -> bool:
    """Whether Transformer Engine layers were built in this process and ours never were."""
    return _TE_LAYERS_BUILT and not _NATIVE_LAYERS_BUILT


def is_te_recipe(recipe: Any) -> bool:
    """Whether ``recipe`` is one of Transformer Engine's recipe objects."""
    return type(recipe).__module__.startswith("transformer_engine")


def te_fp8_enabled() -> bool:
    """Whether Transformer Engine's ``fp8_autocast`` is active here with ``enabled=True``.

    Looks only at modules already imported: a script that entered Transformer Engine's region
    imported it.
    """
    for name in _TE_STATE_MODULES:
        manager = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
        if manager is not None:
            return bool(manager.is_fp8_enabled())
    return False


def _to_te(recipe: Recipe) -> Any:
    """Transformer Engine's recipe object with ``recipe``'s settings."""
    from transformer_engine.common import recipe as te_recipe

    fmt = te_recipe.Format[recipe.fp8_format.name]
    if isinstance(recipe, Float8CurrentScaling):
        extra = {"use_power_2_scales": True} if recipe.use_power_2_scales else {}
        return te_recipe.Float8CurrentScaling(fp8_format=fmt, **extra)
    extra = {} if recipe.reduce_amax else {"reduce_amax": False}
    return te_recipe.DelayedScaling(
        margin=recipe.margin,
        fp8_format=fmt,
        amax_history_len=recipe.amax_history_len,
        amax_compute_algo=recipe.amax_compute_algo,
        scaling_factor_compute_algo=recipe.scaling_factor_compute_algo,
        **extra,
    )


def enter(
    enabled: bool, calibrating: bool, given: Any, recipe: Any, group: Any
) -> contextlib.AbstractContextManager[Any]:
    """Transformer Engine's region for these settings (a no-op without its layers).

    Args:
        enabled: As ``fp8_autocast``.
        calibrating: As ``fp8_autocast``.
        given: The recipe object the script passed (a Transformer Engine one goes through).
        recipe: What the region runs (``autocast._region_recipe``).
        group: The amax reduction group.
    """
    if not _TE_LAYERS_BUILT:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    ours = given is None or isinstance(given, (DelayedScaling, Float8CurrentScaling))
    return te.fp8_autocast(
        enabled=enabled,
        calibrating=calibrating,
        fp8_recipe=_to_te(recipe) if ours else given,
        fp8_group=group,
    )


__all__ = [
    "enter",
    "is_te_recipe",
    "note_native_layers",
    "note_te_layers",
    "only_te_layers",
    "te_fp8_enabled",
]
