"""FSDP1 as SMP's example scripts wrap a model, for the benchmarks that time it and the tests."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel


def wrap_as_smp(
    model: nn.Module, strategy: Any, mixed_precision: Any = None, **kwargs: Any
) -> FullyShardedDataParallel:
    """``model`` in FSDP1 with the arguments SMP's train.py passes.

    A unit per transformer layer (the policy's layer classes), backward prefetch before the
    gradient, forward prefetch, limited all-gathers, ``use_orig_params=True``, on the CPU.

    Args:
        model: A model the policies know (its transformer layer classes).
        strategy: The ``ShardingStrategy``.
        mixed_precision: FSDP1's ``MixedPrecision``, or None for fp32.
        **kwargs: Further FSDP1 arguments (``device_mesh``, ``process_group``).

    Returns:
        The ``FullyShardedDataParallel`` root.
    """
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from torch_sagemaker.policies import transformer_layer_classes

    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls=set(transformer_layer_classes(model))
    )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        mixed_precision=mixed_precision,
        sharding_strategy=strategy,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        **kwargs,
    )
