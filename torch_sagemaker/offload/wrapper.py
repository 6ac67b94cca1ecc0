"""``offload_wrapper``: the root-module wrapper of prefetching activation offloading.

SMP applies ``offload_wrapper`` to the *root* module after activation checkpointing: the
root tells where a forward pass ends (and prefetching can start), the checkpointed layers
are the units whose saved inputs are offloaded. The wrapper subclasses PyTorch's
``OffloadWrapper`` so that state dict keys, attribute forwarding and ``isinstance`` checks
behave exactly as with the native wrapper.

Note [Offloading without checkpointing]
    SMP's scripts call ``offload_wrapper`` whenever ``sm_activation_offloading`` is true, its
    default, also with ``--activation_checkpointing 0``. Without checkpointing a layer saves
    all its intermediate tensors, not just its input; the engine offloads and prefetches those
    the same way (per layer, per storage), so the transformer layers serve as the units. Only
    a model with no layers we can recognise falls back to PyTorch's wrapper, as PyTorch's
    ``offload_wrapper`` would wrap it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from torch_sagemaker._torch_compat.checkpoint_wrapper import CheckpointWrapper, OffloadWrapper
from torch_sagemaker.logger import warn_once
from torch_sagemaker.offload.engine import DEFAULT_MAX_STASH_BYTES, OffloadEngine
from torch_sagemaker.offload.native import NativeOffloadWrapper
from torch_sagemaker.offload.stats import OffloadStats
from torch_sagemaker.policies import registered_policies
from torch_sagemaker.state import state
from torch_sagemaker.tensor_parallel.transformer import TransformerLayer

# Storages below this many bytes stay on the device: copying them costs more in launch
# latency than the memory they free.
DEFAULT_MIN_OFFLOAD_BYTES = 1024

LayerSpec = Iterable[nn.Module] | Callable[[nn.Module], bool] | None


def find_layers(root: nn.Module, layers: LayerSpec = None) -> list[nn.Module]:
    """The modules whose calls are the units of offloading.

    Args:
        root: The module that will be wrapped.
        layers: ``None`` for the checkpointed layers (``CheckpointWrapper`` modules from
            ``checkpoint_transformer_layers`` or PyTorch's ``apply_activation_checkpointing``,
            else Hugging Face layers with gradient checkpointing enabled), a predicate on
            modules, or the modules themselves.

    Raises:
        ValueError: If no layer was found.
    """
    if layers is None:
        found: list[nn.Module] = [m for m in root.modules() if isinstance(m, CheckpointWrapper)]
        if not found:
            found = [m for m in root.modules() if _is_hf_checkpointed_layer(m)]
        source = "checkpointed layers"
    elif callable(layers):
        found = [m for m in root.modules() if layers(m)]
        source = "modules matching the `layers` predicate"
    else:
        found = list(layers)
        source = "modules passed as `layers`"
    if not found:
        raise ValueError(
            f"offload_wrapper found no {source} in {type(root).__name__}: activation "
            "offloading moves the saved inputs of activation-checkpointed layers, so apply "
            "activation checkpointing first (torch_sagemaker.sharding."
            "checkpoint_transformer_layers, PyTorch's apply_activation_checkpointing, or "
            "model.gradient_checkpointing_enable() for Hugging Face models), pass "
            "layers=[...] explicitly, or set sm_activation_offloading=False to use PyTorch's "
            "offload-everything wrapper."
        )
    return found


def default_layers(root: nn.Module) -> list[nn.Module]:
    """The layers ``offload_wrapper`` uses when none are given.

    The checkpointed layers if there are any, else the model's transformer layers (those
    ``tsm.transform`` marked, or those of the model family's policy); may be empty. See
    Note [Offloading without checkpointing].
    """
    found: list[nn.Module] = [m for m in root.modules() if isinstance(m, CheckpointWrapper)]
    if not found:
        found = [m for m in root.modules() if _is_hf_checkpointed_layer(m)]
    if not found:
        found = [m for m in root.modules() if isinstance(m, TransformerLayer)]
    if not found:
        for module in root.modules():
            policy = next((p for p in registered_policies() if p.matches(module)), None)
            if policy is not None:
                found = [m for m in module.modules() if type(m).__name__ == policy.layer_class]
                break
    return found


def _is_hf_checkpointed_layer(module: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers is optional
        return False
    return isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing


class PrefetchOffloadWrapper(OffloadWrapper):
    """Offloads the saved activations of the wrapped layers and prefetches them for backward.

    Args:
        module: The root module (after tensor parallelism, checkpointing and FSDP).
        horizon: Layers kept resident ahead of the layer whose backward runs
            (``activation_loading_horizon``).
        min_offload_bytes: Storages smaller than this stay on the device.
        layers: Which modules are the layers; see ``find_layers``.
        offload: ``False`` only measures (the no-offload baseline of the statistics).
        max_stash_bytes: Device bytes whose offload copy may be in flight (CUDA).
        trace: Record an event log in ``offload_trace``.

    Forward passes in eval mode or without grad run the module untouched.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        horizon: int,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        layers: LayerSpec = None,
        offload: bool = True,
        max_stash_bytes: int = DEFAULT_MAX_STASH_BYTES,
        trace: bool = False,
    ) -> None:
        super().__init__(module)
        engine = OffloadEngine(
            horizon,
            min_offload_bytes,
            offload=offload,
            max_stash_bytes=max_stash_bytes,
            trace=trace,
        )
        self._offload_engine = engine
        self._offload_hook_handles = engine.attach(find_layers(module, layers))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module, offloading its layers' activations when training."""
        if not (self.training and torch.is_grad_enabled()):
            return self._checkpoint_wrapped_module(*args, **kwargs)
        with self._offload_engine.forward_pass(self._checkpoint_wrapped_module):
            return self._checkpoint_wrapped_module(*args, **kwargs)

    @property
    def offload_stats(self) -> OffloadStats:
        """Offloading counters since the last ``reset_offload_stats``."""
        return self._offload_engine.snapshot()

    @property
    def offload_trace(self) -> list[tuple[Any, ...]] | None:
        """The event log (``trace=True`` only): ``(event, pass_id, layer, ...)`` tuples."""
        return self._offload_engine.trace

    def reset_offload_stats(self) -> None:
        """Starts a new statistics period (call once per training step)."""
        self._offload_engine.stats.reset()


def offload_wrapper(
    module: nn.Module,
    *,
    activation_loading_horizon: int | None = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    layers: LayerSpec = None,
    trace: bool = False,
) -> nn.Module:
    """Wraps the root module for activation offloading, as ``sm_activation_offloading`` says.

    With ``tsm.state.sm_activation_offloading`` true (the default) this returns a
    ``PrefetchOffloadWrapper``; otherwise PyTorch's ``OffloadWrapper`` (as
    ``NativeOffloadWrapper``, which can also save DTensors: Note [DTensors under PyTorch's
    offload wrapper]), which offloads every saved tensor and fetches each one only when
    backward needs it. Without ``layers``, the units are the checkpointed layers, else the
    transformer layers (Note [Offloading without checkpointing]); a model with neither gets
    PyTorch's wrapper and a one-time warning, as SMP's scripts wrap every model by default.

    Args:
        module: The root module, after activation checkpointing (and FSDP).
        activation_loading_horizon: Overrides ``tsm.state.activation_loading_horizon``.
        min_offload_bytes: Storages smaller than this stay on the device.
        layers: Which modules are the layers; see ``find_layers``. Default: ``default_layers``.
        trace: Record an event log (``wrapper.offload_trace``).

    Returns:
        The wrapped module.

    Example:
        >>> checkpoint_transformer_layers(model, check_fn=lambda m: isinstance(m, Block))
        >>> model = tsm.offload_wrapper(model)
        >>> loss = model(batch).sum(); loss.backward()
        >>> print(torch_sagemaker.offload.get_stats(model, reset=True).summary())
    """
    if not state.sm_activation_offloading:
        return NativeOffloadWrapper(module)
    if layers is None:
        layers = default_layers(module)
        if not layers:
            warn_once(
                f"offload_wrapper: {type(module).__name__} has no checkpointed or transformer "
                "layers to prefetch for, so PyTorch's offload_wrapper wraps it (every saved "
                "tensor offloaded, fetched when backward needs it). Apply activation "
                "checkpointing or pass layers=[...] to get prefetching."
            )
            return NativeOffloadWrapper(module)
    horizon = (
        state.activation_loading_horizon
        if activation_loading_horizon is None
        else activation_loading_horizon
    )
    return PrefetchOffloadWrapper(
        module, horizon=horizon, min_offload_bytes=min_offload_bytes, layers=layers, trace=trace
    )


def get_stats(model: nn.Module, reset: bool = False) -> OffloadStats:
    """The offloading counters of the ``PrefetchOffloadWrapper`` in ``model``.

    Args:
        model: The wrapper itself or a module containing it (e.g. a DDP/FSDP root).
        reset: Start a new statistics period after reading (once per step).

    Raises:
        ValueError: If ``model`` contains no ``PrefetchOffloadWrapper``.
    """
    wrappers = [m for m in model.modules() if isinstance(m, PrefetchOffloadWrapper)]
    if not wrappers:
        raise ValueError(
            f"get_stats: {type(model).__name__} contains no PrefetchOffloadWrapper; wrap the "
            "root with offload_wrapper() while sm_activation_offloading is true."
        )
    stats = wrappers[0].offload_stats
    if reset:
        wrappers[0].reset_offload_stats()
    return stats
