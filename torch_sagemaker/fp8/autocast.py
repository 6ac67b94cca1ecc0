"""``fp8_autocast``: the region in which FP8 linear layers compute in FP8.

Same call as Transformer Engine's, which SMP's scripts make::

    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(...),
                      fp8_group=tsm.state.world_process_group):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()

The forward runs inside the region, the backward after it; the backward of a layer uses
the settings its forward ran with. ``autocast(recipe=..., amax_reduction_group=...)`` is
Transformer Engine 2's newer spelling of the same thing.

Regions nest: the innermost decides (``enabled=False`` inside an enabled region turns FP8
off for its part). Leaving the outermost region applies the amaxes its forward recorded
(Note [When scales update] in ``scaling.py``), a collective over each amax reduction group
when FP8 layers ran: every rank leaves its outermost region at the same points.

Where ``tsm.transform`` built Transformer Engine layers (its ``"te"`` tensor parallel
backend, on CUDA with ``transformer_engine`` installed), the region also enters Transformer
Engine's own ``fp8_autocast`` with the same settings (``te_bridge.py``), so one script runs
on either kind of layer. Where every FP8 layer is Transformer Engine's, a Transformer Engine
recipe this package does not implement (``MXFP8BlockScaling``, ``Float8BlockScaling``, FP8
attention options) goes through to it untouched; with our layers present it is refused,
naming the option.

Note [FP8 layers under torch.compile]: ``Fp8Linear.forward`` asks the autograd engine
whether a backward is running (Note [FP8 under recomputation] in ``linear.py``), which
Dynamo cannot trace: every FP8 layer would break the graph, and ``fullgraph=True`` would
fail, in scripts that never use FP8. So the layers first read ``entered()``, which returns
a plain module global set the first time an enabled or calibrating region is entered in
the process; while it is False the forward is ``nn.Linear.forward`` and nothing else.
Dynamo inlines ``entered()`` and guards on the global: a model compiled before FP8 was
first used is recompiled when it is (with graph breaks at the FP8 layers, whose forward
cannot be traced; ``fullgraph=True`` then fails).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from torch_sagemaker.fp8 import te_bridge
from torch_sagemaker.fp8.recipe import DelayedScaling, resolve_recipe
from torch_sagemaker.fp8.scaling import update_forward


@dataclass(frozen=True)
class Fp8Settings:
    """What a forward runs under.

    Attributes:
        enabled: Compute the FP8 layers in FP8.
        calibrating: Record amaxes (delayed scaling) even where ``enabled`` is False.
        recipe: The recipe.
        group: The amax reduction group (``None``: every rank).
    """

    enabled: bool
    calibrating: bool
    recipe: Any  # a Recipe; a Transformer Engine recipe where only its layers exist
    group: Any


OFF = Fp8Settings(enabled=False, calibrating=False, recipe=DelayedScaling(), group=None)
_STACK: list[Fp8Settings] = []
_ENTERED = False  # Note [FP8 layers under torch.compile]


def entered() -> bool:
    """Whether an enabled or calibrating region was ever entered in this process.

    Note [FP8 layers under torch.compile].
    """
    return _ENTERED


def active() -> Fp8Settings:
    """The settings of the innermost ``fp8_autocast`` region, ``OFF`` outside any."""
    return _STACK[-1] if _STACK else OFF


def is_fp8_enabled() -> bool:
    """Whether the current region computes FP8 layers in FP8."""
    return active().enabled


def get_fp8_recipe() -> Any:
    """The recipe of the current region (``DelayedScaling()`` outside any).

    Ours, or the Transformer Engine recipe passed through where only its layers exist.
    """
    return active().recipe


def _flag(name: str, value: Any) -> bool:
    # SMP's scripts pass their 0/1 argument (enabled=args.fp8), as Transformer Engine allows.
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"fp8_autocast({name}={value!r}): expected True/False (or 1/0).")


def _check_flags(group: Any, graph: Any) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"fp8_autocast(fp8_group={group!r}): expected a torch.distributed ProcessGroup "
            "(SMP's scripts pass tsm.state.world_process_group) or None (every rank)."
        )
    if graph:
        raise ValueError(
            "fp8_autocast(_graph=True): capturing FP8 layers in CUDA graphs is not supported "
            "by torch_sagemaker's FP8 layers; leave _graph=False."
        )


def _region_recipe(given: Any) -> Any:
    """The recipe a region runs: ours, resolved; or the given Transformer Engine recipe.

    A Transformer Engine recipe this package cannot run goes through as it is when every FP8
    layer that exists is Transformer Engine's (module docstring); otherwise the error of
    ``resolve_recipe`` names the option.
    """
    try:
        return resolve_recipe(given)
    except ValueError:
        if te_bridge.only_te_layers() and te_bridge.is_te_recipe(given):
            return given
        raise


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Any = None,
    fp8_group: dist.ProcessGroup | None = None,
    _graph: bool = False,
) -> Iterator[None]:
    """Runs the FP8 linear layers in FP8 inside the block (Transformer Engine's signature).

    Args:
        enabled: Compute in FP8. ``False`` leaves every layer in its own precision.
        calibrating: With ``enabled=False``: record the forward amaxes of a delayed-scaling
            recipe all the same, so scales are ready when FP8 is turned on.
        fp8_recipe: ``DelayedScaling`` (default ``DelayedScaling()``), ``Float8CurrentScaling``,
            or the Transformer Engine recipe of the same name; any Transformer Engine recipe
            where every FP8 layer is Transformer Engine's (module docstring).
        fp8_group: Group over which amaxes are reduced (``None``: every rank).
        _graph: Must be False (no CUDA graph capture).

    Raises:
        TypeError: For a flag that is not a bool (or 0/1), or a group that is not a ProcessGroup.
        ValueError: For an unsupported recipe or option (named), unless it is a Transformer
            Engine recipe and every FP8 layer is Transformer Engine's.

    Example:
        >>> with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID)):
        ...     loss = model(input_ids=ids, labels=ids).loss
        >>> loss.backward()
    """
    global _ENTERED
    enabled, calibrating = _flag("enabled", enabled), _flag("calibrating", calibrating)
    _check_flags(fp8_group, _graph)
    recipe = _region_recipe(fp8_recipe)
    _ENTERED = _ENTERED or enabled or calibrating
    _STACK.append(Fp8Settings(enabled, calibrating, recipe, fp8_group))
    try:
        with te_bridge.enter(enabled, calibrating, fp8_recipe, recipe, fp8_group):
            yield
    finally:
        _STACK.pop()
    if not _STACK:
        update_forward()  # Note [When scales update]; not after an exception (ranks may differ)


def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Any = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
    _graph: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """``fp8_autocast`` under Transformer Engine 2's newer argument names."""
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)


__all__ = [
    "OFF",
    "Fp8Settings",
    "active",
    "entered",
    "autocast",
    "fp8_autocast",
    "get_fp8_recipe",
    "is_fp8_enabled",
]
