"""Activation checkpointing per transformer layer, with PyTorch's ``checkpoint_wrapper``.

``checkpoint_transformer_layers`` is this library's own function. It is not named after
PyTorch's ``apply_activation_checkpointing`` (which SMP's example scripts import from
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` and call with
``checkpoint_wrapper_fn=`` / ``check_fn=``), because it takes other arguments: one name, one
signature. SMP exposes no function of its own for this.

The unit is the model's transformer layer class, from its policy (the same unit FSDP
shards and the offload wrapper offloads; see ``transformer_layer_classes``). Each layer is
wrapped in place by ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, non
reentrant by default: the non-reentrant implementation (``torch.utils.checkpoint`` with
``use_reentrant=False``) accepts keyword arguments (Hugging Face layers take
``position_embeddings=``, ``attention_mask=``), composes with FSDP's hooks and DTensor, and
reproduces the forward bit for bit when it recomputes it; with tensor parallelism it also
replays the TP regions' dropout draws (``context_fn``, Note [TP-region RNG and activation
checkpointing]), which the reentrant implementation cannot (it raises, Note [Unreplayed
TP-region draws]).

Order: after ``tsm.transform`` and before or after FSDP1 ``FSDP(...)``; before FSDP2
``shard_model`` (which then finds the layers inside the wrappers); before ``offload_wrapper``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from torch_sagemaker._torch_compat import checkpoint_wrapper as _cw
from torch_sagemaker.logger import warn_once
from torch_sagemaker.policies import transformer_layer_classes
from torch_sagemaker.state import state

CheckpointImpl = _cw.CheckpointImpl


def checkpoint_transformer_layers(
    model: nn.Module,
    *,
    layer_classes: tuple[type[nn.Module], ...] | None = None,
    check_fn: Callable[[nn.Module], bool] | None = None,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
) -> nn.Module:
    """Wraps every transformer layer of ``model`` in a checkpoint wrapper, in place.

    Layers that already sit in a ``CheckpointWrapper`` are left alone, so calling this
    twice checkpoints each layer once. A Hugging Face model's ``config.use_cache`` is set to
    False (with a warning), as ``gradient_checkpointing_enable`` does: the KV cache is
    appended to inside the checkpointed layers, so the recomputation would append twice.

    Args:
        model: A (transformed, possibly FSDP1-wrapped) model.
        layer_classes: Classes to checkpoint; default ``transformer_layer_classes(model)``
            (the policy's layer class, else the Hugging Face ``_no_split_modules``).
        check_fn: Instead of ``layer_classes``: a predicate choosing the modules to wrap.
        checkpoint_impl: ``CheckpointImpl.NO_REENTRANT`` (default) or ``REENTRANT`` (what
            SMP's examples use without FP8; it needs an input that requires grad).

    Returns:
        ``model`` (changed in place; the root itself is never wrapped).

    Raises:
        ValueError: If both ``layer_classes`` and ``check_fn`` are given, no module of
            ``model`` matches, or neither is given and ``model`` has no layer class
            (``transformer_layer_classes``).

    Example:
        >>> model = tsm.transform(model)
        >>> checkpoint_transformer_layers(model)
        >>> model = shard_model(model)
    """
    if layer_classes is not None and check_fn is not None:
        raise ValueError(
            "checkpoint_transformer_layers takes layer_classes or check_fn, not "
            "both; fold the class test into check_fn."
        )
    if check_fn is None:
        classes = layer_classes or transformer_layer_classes(model)
        what = f"module of class {[c.__name__ for c in classes]}"

        def check_fn(module: nn.Module) -> bool:
            return isinstance(module, classes)
    else:
        what = "module matching check_fn"
    # A layer already inside a wrapper would otherwise be wrapped a second time (and
    # recomputed twice in backward).
    wrapped = {
        id(_cw.wrapped_module(m)) for m in model.modules() if isinstance(m, _cw.CheckpointWrapper)
    }
    targets = {
        id(m) for m in model.modules() if m is not model and id(m) not in wrapped and check_fn(m)
    }
    if not targets and not wrapped:
        raise ValueError(
            f"checkpoint_transformer_layers found no {what} in {type(model).__name__}. Pass "
            "layer_classes=(MyDecoderLayer,) or check_fn=..., or register a policy for the model."
        )
    config = getattr(model, "config", None)  # FSDP1 forwards attribute lookups to the model
    if config is not None and getattr(config, "use_cache", False):
        warn_once(
            "checkpoint_transformer_layers: setting config.use_cache=False (a KV cache "
            "filled in forward would be filled again by the recomputation)"
        )
        config.use_cache = False
    replay: dict[str, Any] = {}
    if checkpoint_impl is CheckpointImpl.NO_REENTRANT and state.initialized and state.tp_size > 1:
        # The recompute replays the TP regions' dropout draws (Note [TP-region RNG and
        # activation checkpointing] in tensor_parallel/random.py).
        replay["context_fn"] = state.get_rng_state_tracker().checkpoint_context_fn
    _cw.apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            _cw.checkpoint_wrapper, checkpoint_impl=checkpoint_impl, **replay
        ),
        check_fn=lambda m: id(m) in targets,
    )
    return model
