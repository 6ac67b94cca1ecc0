"""Transformer Engine's ``fp8_autocast``, entered with ours where its layers were built.

NOT RUN: Transformer Engine is not installed on any machine this package is developed or
checked on (docs/fp8.md, "What ran where"). Written against Transformer Engine's documented
API: ``transformer_engine.pytorch.fp8_autocast(enabled, calibrating, fp8_recipe,
fp8_group)`` and ``transformer_engine.common.recipe.{DelayedScaling, Float8CurrentScaling,
Format}``.

With Transformer Engine's backend (CUDA and ``transformer_engine`` present) the policy's
linear layers are ``te.Linear`` modules, which only Transformer Engine's own region
switches to FP8. A script written against ``torch.sagemaker.fp8.fp8_autocast`` then gets
that region too, with its recipe translated (or passed through, when it already is a
Transformer Engine recipe). Scripts that call Transformer Engine themselves, as SMP's do,
never come here.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch_sagemaker.fp8.recipe import DelayedScaling, Float8CurrentScaling, Recipe

_TE_LAYERS_BUILT = False


def note_te_layers() -> None:
    """Records that a model now holds Transformer Engine layers (``prepare.prepare_linears``)."""
    global _TE_LAYERS_BUILT
    _TE_LAYERS_BUILT = True


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
    enabled: bool, calibrating: bool, given: Any, recipe: Recipe, group: Any
) -> contextlib.AbstractContextManager[Any]:
    """Transformer Engine's region for these settings (a no-op without its layers).

    Args:
        enabled: As ``fp8_autocast``.
        calibrating: As ``fp8_autocast``.
        given: The recipe object the script passed (a Transformer Engine one goes through).
        recipe: Its resolved form (``recipe.resolve_recipe``).
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


__all__ = ["enter", "note_te_layers"]
