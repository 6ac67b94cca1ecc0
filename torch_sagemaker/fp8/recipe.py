"""FP8 formats and recipes, with Transformer Engine's names and arguments.

SMP's scripts build ``transformer_engine.common.recipe.DelayedScaling(fp8_format=
Format.HYBRID, amax_history_len=..., amax_compute_algo=...)`` and pass it to
``fp8_autocast``. The classes here take the same arguments (the same names, defaults and
meaning as Transformer Engine documents them), so a script swaps the import and nothing
else; ``resolve_recipe`` also accepts Transformer Engine's own recipe objects.

Supported: per-tensor ``DelayedScaling`` and ``Float8CurrentScaling`` in the ``E4M3`` and
``HYBRID`` formats. Everything else is refused with an error naming the option: pure
``E5M2`` (Transformer Engine refuses it too), FP8 attention (``fp8_dpa``/``fp8_mha``),
``backward_override``, ``override_linear_precision`` and ``interval`` other than their
defaults, and the block-scaled recipes (MXFP8, FP8 block, NVFP4).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class Format(enum.Enum):
    """FP8 formats, as Transformer Engine names them.

    ``E4M3``: every FP8 tensor in e4m3 (max 448); ``E5M2``: every one in e5m2 (max 57344);
    ``HYBRID``: e4m3 in the forward pass (inputs, weights), e5m2 in the backward pass
    (output gradients), whose range matters more than their precision.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        """Dtype of the tensors quantized in the forward pass."""
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """Dtype of the output gradients quantized in the backward pass."""
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


AmaxComputeAlgo = str | Callable[[torch.Tensor], torch.Tensor]


def _unsupported(recipe: str, option: str, value: Any, why: str) -> ValueError:
    return ValueError(
        f"{recipe}({option}={value!r}) is not supported by torch_sagemaker's FP8 linear "
        f"layers: {why}. Leave {option} at its default, or run Transformer Engine's layers "
        "(docs/fp8.md)."
    )


def _check_format(recipe: str, fmt: Any) -> Format:
    if not isinstance(fmt, Format):
        raise TypeError(
            f"{recipe}(fp8_format={fmt!r}): expected torch_sagemaker.fp8.Format.HYBRID or "
            "Format.E4M3."
        )
    if fmt is Format.E5M2:
        raise _unsupported(
            recipe, "fp8_format", fmt, "pure E5M2 training (Transformer Engine refuses it too)"
        )
    return fmt


def _check_common(recipe: str, fp8_dpa: bool, fp8_mha: bool, backward_override: Any) -> None:
    for option, value in (("fp8_dpa", fp8_dpa), ("fp8_mha", fp8_mha)):
        if value:
            raise _unsupported(recipe, option, value, "only linear layers run in FP8")
    if backward_override is not None:
        raise _unsupported(
            recipe, "backward_override", backward_override, "the backward always runs in FP8"
        )


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed per-tensor scaling: each tensor's scale comes from the amax of earlier steps.

    Arguments as Transformer Engine's ``DelayedScaling``. The rule (Note [Delayed scaling
    rule] in ``torch_sagemaker/fp8/scaling.py``): every FP8 tensor keeps an amax history of
    ``amax_history_len`` entries; at each update the step's amax (reduced over the amax
    reduction group) enters the history, ``amax`` is its maximum (``"max"``) or the step's
    own (``"most_recent"``), and ``scale = (fp8_max / amax) / 2**margin``.

    Args:
        margin: Power-of-two headroom below the format's largest value.
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        amax_history_len: Steps of amax history (>= 1).
        amax_compute_algo: ``"max"``, ``"most_recent"``, or ``fn(amax_history) -> amax``
            where ``amax_history`` is ``[amax_history_len, n]``, row 0 the current step's.
        scaling_factor_compute_algo: ``fn(amax, old_scale, fp8_max, recipe) -> scale``
            instead of the formula above.
        reduce_amax: Reduce each step's amaxes (max) over the ``fp8_group`` of
            ``fp8_autocast`` (default: every rank). ``False``: each rank keeps its own;
            ranks that hold shards of one tensor parallel layer still agree.
        fp8_dpa: Must be False (no FP8 attention).
        fp8_mha: Must be False.
        interval: Transformer Engine 1.x's recompute interval; must be 1.
        override_linear_precision: Transformer Engine 1.x's ``(fprop, dgrad, wgrad)``
            high-precision switches; must be all False.
        backward_override: Must be None.

    Raises:
        ValueError: For an unsupported option (named) or an out-of-range value.
        TypeError: For a value of the wrong type.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    scaling_factor_compute_algo: Callable[..., torch.Tensor] | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    interval: int = 1
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    backward_override: str | None = None

    def __post_init__(self) -> None:
        name = "DelayedScaling"
        # Recipes key the groups of layers updated together (``scaling._update_roles``), so
        # they must hash, which a list here would prevent.
        if isinstance(self.override_linear_precision, list):
            object.__setattr__(
                self, "override_linear_precision", tuple(self.override_linear_precision)
            )
        _check_format(name, self.fp8_format)
        _check_common(name, self.fp8_dpa, self.fp8_mha, self.backward_override)
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise TypeError(f"{name}(margin={self.margin!r}): expected an int such as 0.")
        history = self.amax_history_len
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            raise ValueError(
                f"{name}(amax_history_len={history!r}): must be an int >= 1 (SMP's scripts "
                "pass 1024)."
            )
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(
                f"{name}(amax_compute_algo={algo!r}): use 'max', 'most_recent' or a function "
                "of the amax history."
            )
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"{name}(reduce_amax={self.reduce_amax!r}): expected True or False.")
        compute = self.scaling_factor_compute_algo
        if compute is not None and not callable(compute):
            raise TypeError(
                f"{name}(scaling_factor_compute_algo={compute!r}): expected None or a "
                "function fn(amax, old_scale, fp8_max, recipe) -> scale."
            )
        if self.interval != 1:
            raise _unsupported(name, "interval", self.interval, "scales are updated at every step")
        if tuple(self.override_linear_precision) != (False, False, False):
            raise _unsupported(
                name,
                "override_linear_precision",
                self.override_linear_precision,
                "all three matrix products of a layer run in FP8",
            )


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Current per-tensor scaling: each tensor is scaled by its own amax when it is quantized.

    ``scale = fp8_max / amax`` (1 where amax is 0), rounded down to a power of two with
    ``use_power_2_scales``. Tensors split over tensor parallel ranks use the amax of the
    whole tensor (one all-reduce per quantization), so the shards agree; nothing is
    reduced across data-parallel ranks (as in Transformer Engine).

    Args:
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        use_power_2_scales: Round each scale down to a power of two.
        fp8_dpa: Must be False.
        fp8_mha: Must be False.
        backward_override: Must be None.

    Raises:
        ValueError: For an unsupported option (named).
        TypeError: For a value of the wrong type.
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        name = "Float8CurrentScaling"
        _check_format(name, self.fp8_format)
        _check_common(name, self.fp8_dpa, self.fp8_mha, self.backward_override)
        if not isinstance(self.use_power_2_scales, bool):
            raise TypeError(
                f"{name}(use_power_2_scales={self.use_power_2_scales!r}): expected True or False."
            )


Recipe = DelayedScaling | Float8CurrentScaling

# Transformer Engine's recipe classes this package does not implement, by class name.
_BLOCK_RECIPES = (
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "MXFP4QATMXFP8BlockScaling",
    "MXFP4QATFloat8BlockScaling",
)


def _format_of(value: Any) -> Format:
    """Our ``Format`` for ours or Transformer Engine's (an enum member named E4M3, ...)."""
    if isinstance(value, Format):
        return value
    name = getattr(value, "name", None)
    if isinstance(name, str) and name in Format.__members__:
        return Format[name]
    raise ValueError(f"fp8_format={value!r}: not an FP8 format this package knows (E4M3, HYBRID).")


def _from_transformer_engine(recipe: Any) -> Recipe:
    """Our recipe with the settings of a Transformer Engine recipe object (by its class name)."""
    kind = type(recipe).__name__
    if kind == "DelayedScaling":
        return DelayedScaling(
            margin=recipe.margin,
            fp8_format=_format_of(recipe.fp8_format),
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
            scaling_factor_compute_algo=recipe.scaling_factor_compute_algo,
            reduce_amax=getattr(recipe, "reduce_amax", True),
            fp8_dpa=getattr(recipe, "fp8_dpa", False),
            fp8_mha=getattr(recipe, "fp8_mha", False),
            interval=getattr(recipe, "interval", 1),
            override_linear_precision=tuple(
                getattr(recipe, "override_linear_precision", (False, False, False))
            ),
            backward_override=getattr(recipe, "backward_override", None),
        )
    if kind == "Float8CurrentScaling":
        for option in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            eps = getattr(getattr(recipe, option, None), "amax_epsilon", 0.0)
            if eps:
                raise _unsupported(kind, f"{option}.amax_epsilon", eps, "amax is used as is")
        return Float8CurrentScaling(
            fp8_format=_format_of(recipe.fp8_format),
            use_power_2_scales=bool(getattr(recipe, "use_power_2_scales", False)),
            fp8_dpa=getattr(recipe, "fp8_dpa", False),
            fp8_mha=getattr(recipe, "fp8_mha", False),
            backward_override=getattr(recipe, "backward_override", None),
        )
    raise ValueError(
        f"FP8 recipe {kind} is not supported by torch_sagemaker's FP8 linear layers, which "
        "scale per tensor: use DelayedScaling (SMP's recipe) or Float8CurrentScaling"
        + (
            " (block-scaled recipes need Transformer Engine's layers)."
            if kind in _BLOCK_RECIPES
            else "."
        )
    )


def resolve_recipe(recipe: Any) -> Recipe:
    """The recipe ``fp8_autocast`` runs.

    ``None`` means ``DelayedScaling()``, as in Transformer Engine; one of Transformer Engine's
    recipe objects is translated.

    Raises:
        ValueError: For a recipe class or option this package does not implement, naming it.
    """
    if recipe is None:
        return DelayedScaling()
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return recipe
    return _from_transformer_engine(recipe)


__all__ = ["DelayedScaling", "Float8CurrentScaling", "Format", "Recipe", "resolve_recipe"]
