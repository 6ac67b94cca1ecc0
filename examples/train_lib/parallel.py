"""Sharding, delayed initialization, activation checkpointing and offloading, in the fixed order
(tensor parallelism was applied by ``tsm.transform``): checkpointing, FSDP, offload wrapper."""

from __future__ import annotations

import argparse

import torch
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.sharding import (
    checkpoint_transformer_layers,
    shard_model,
    transformer_layer_classes,
)


def _fsdp1(
    model: torch.nn.Module,
    args: argparse.Namespace,
    dtype: torch.dtype,
    layer_classes: tuple,
    initer: DelayedParamIniter | None,
) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mixed = None
    if dtype != torch.float32:  # fp32 master weights, bf16 compute and reduction, fp32 buffers
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=torch.float32)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(set(layer_classes)),
        # follows hybrid_shard_degree after tsm.init
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=mixed,
        device_id=device,
        use_orig_params=True,
        limit_all_gathers=True,
        forward_prefetch=True,
        param_init_fn=initer.get_param_init_fn() if initer else None,
        post_param_init_fn=initer.get_post_param_init_fn() if initer else None,
    )


def _fsdp2(
    model: torch.nn.Module,
    args: argparse.Namespace,
    dtype: torch.dtype,
    layer_classes: tuple,
    initer: DelayedParamIniter | None,
) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        if dtype != torch.float32
        else None
    )
    model = shard_model(model, mp_policy=mp, layer_classes=layer_classes)
    if initer is not None:
        initer.init_model()  # materialise and initialise only the local shards
    return model


def apply_parallelism(
    model: torch.nn.Module, args: argparse.Namespace, dtype: torch.dtype
) -> torch.nn.Module:
    """Applies checkpointing, FSDP (+ delayed init) and offloading to a transformed model."""
    layer_classes = transformer_layer_classes(model)
    initer = DelayedParamIniter(model) if args.delayed_param else None
    if args.activation_checkpointing:
        checkpoint_transformer_layers(model, layer_classes=layer_classes)  # non-reentrant
    wrap = _fsdp1 if args.fsdp == "fsdp1" else _fsdp2
    if initer is not None and args.fsdp == "fsdp1":
        with initer.validate_params_and_buffers_inited():
            model = wrap(model, args, dtype, layer_classes, initer)
    else:
        model = wrap(model, args, dtype, layer_classes, initer)
    if args.offload_activations:
        if not args.activation_checkpointing:
            raise ValueError(
                "--offload-activations 1 needs --activation-checkpointing 1 (it offloads the "
                "checkpointed layers' inputs), as in SMP v2."
            )
        # SMP scripts import PyTorch's offload_wrapper; after tsm.init it is SMP's prefetching
        # one when sm_activation_offloading is true, and PyTorch's own otherwise.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

        model = offload_wrapper(model)
    return model


def fsdp2_root(model: torch.nn.Module):
    """The root FSDP2 module (inside an offload wrapper too), or None under FSDP1.

    With gradient accumulation the training loop calls its ``set_requires_all_reduce(last)``
    each micro-batch: FSDP2 with replicas (HSDP) then keeps partial sums until the last one,
    and its reduce-scatter runs every time. FSDP1 has no such switch and reduces every
    micro-batch (its ``no_sync`` would keep whole unsharded gradients, and fails under tensor
    parallelism: docs/training.md). ``modules()`` walks parents first, and ``shard_model``
    shards the root last, around everything else.
    """
    from torch.distributed.fsdp import FSDPModule

    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
