"""Routes PyTorch's ``offload_wrapper`` to the prefetching offloader after ``tsm.init()``.

SMP v2 training scripts import ``offload_wrapper`` from
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` and get SMP's prefetching
offloader once SMP is initialized. This module is the one place that reproduces that: it
replaces the module attribute with a dispatcher that decides *at call time*:

* ``tsm.init()`` has run and ``sm_activation_offloading`` is true: ``PrefetchOffloadWrapper``;
* ``tsm.init()`` has run and the flag is false: ``NativeOffloadWrapper``, PyTorch's wrapper
  able to save DTensors (Note [DTensors under PyTorch's offload wrapper] in ``native.py``);
* before ``tsm.init()``: PyTorch's own function, unchanged.

The patch is installed when ``torch_sagemaker`` is imported (``torch_sagemaker/_init.py``
imports this package), so a script must import ``torch.sagemaker`` (or ``torch_sagemaker``)
before it runs ``from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import
offload_wrapper``; a name bound earlier keeps PyTorch's function. Processes that never call
``tsm.init()`` see no change in behaviour.

The prefetching wrapper is handed to ``install`` (``offload/__init__.py`` does it) instead of
imported here: ``wrapper`` imports this module for PyTorch's function, so this module must
not import ``wrapper``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from torch_sagemaker._torch_compat import checkpoint_wrapper as cw_compat
from torch_sagemaker.offload.native import NativeOffloadWrapper
from torch_sagemaker.state import state

# ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, the owner of the attribute.
_torch_module = cw_compat.TORCH_MODULE

# PyTorch's function, captured before the patch (installing twice keeps the first capture).
_native = getattr(_torch_module.offload_wrapper, "__tsm_native__", _torch_module.offload_wrapper)

# The prefetching ``offload_wrapper`` the dispatcher routes to, set by ``install``.
_route: Callable[..., nn.Module] | None = None


def _use_prefetching() -> bool:
    return _route is not None and state.initialized and bool(state.sm_activation_offloading)


@functools.wraps(_native)
def _dispatching_offload_wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    if _use_prefetching():
        assert _route is not None
        return _route(module, *args, **kwargs)
    if state.initialized:  # tensor parallelism may be on: PyTorch's wrapper fails on DTensors
        return NativeOffloadWrapper(module, *args, **kwargs)
    return _native(module, *args, **kwargs)


_dispatching_offload_wrapper.__tsm_native__ = _native  # type: ignore[attr-defined]


def install(route: Callable[..., nn.Module]) -> None:
    """Replaces ``checkpoint_wrapper.offload_wrapper`` with the dispatcher (idempotent).

    Args:
        route: What the dispatcher calls after ``tsm.init()`` with offloading on
            (``torch_sagemaker.offload.offload_wrapper``), with the caller's arguments.
    """
    global _route
    _route = route
    _torch_module.offload_wrapper = _dispatching_offload_wrapper


def uninstall() -> None:
    """Restores PyTorch's ``offload_wrapper`` attribute."""
    _torch_module.offload_wrapper = _native


def is_installed() -> bool:
    """Whether the dispatcher is the module attribute."""
    return _torch_module.offload_wrapper is _dispatching_offload_wrapper
