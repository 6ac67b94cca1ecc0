"""``DistributedDataParallel`` refuses a model whose experts ``tsm.transform`` split.

Note [DDP and expert parallelism]
    After ``tsm.transform(model, config=MoEConfig(...))`` with ``expert_parallel_degree > 1``
    each rank holds other experts, as DTensors on the EP mesh. DDP treats every parameter
    as one replica of the same tensor: it would broadcast rank 0's experts over ranks that
    hold other experts, and average expert gradients over every data-parallel rank instead
    of over the ranks that hold the same experts (sharding/experts.py). PyTorch's DDP fails
    on the DTensors first, with an error about mixing ``torch.Tensor`` and ``DTensor`` in
    ``aten.cat`` that names neither cause nor fix. FSDP1 and FSDP2 give the experts their
    own groups, so ``install()`` (called by ``tsm.init``) wraps
    ``DistributedDataParallel.__init__`` to raise before DDP does anything when the module
    holds split experts, naming FSDP as the fix. Every other module goes to PyTorch's
    ``__init__`` unchanged. The check reads the model, not ``tsm.state``: split experts
    are wrong under DDP whatever the state.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_sagemaker.moe.experts import is_split

_original_init = DistributedDataParallel.__init__


def check_no_split_experts(module: nn.Module) -> None:
    """Raises if ``module`` holds experts split over the expert parallel ranks.

    Raises:
        ValueError: If ``tsm.transform`` split experts of ``module`` (Note [DDP and expert
            parallelism]).
    """
    names = [name for name, m in module.named_modules() if is_split(m)]
    if not names:
        return
    raise ValueError(
        f"DistributedDataParallel({type(module).__name__}): tsm.transform split the experts "
        f"of {len(names)} MoE layer(s) (first: {names[0] or 'the module itself'}) over the "
        "expert parallel ranks, so each rank holds other experts. DDP would broadcast rank "
        "0's experts to every rank and average expert gradients over all data-parallel "
        "ranks instead of the ranks that hold the same experts. Expert parallelism needs "
        "FSDP: wrap the model with FullyShardedDataParallel(model, auto_wrap_policy=..., "
        "use_orig_params=True) or torch_sagemaker.sharding.shard_model(model), or set "
        "expert_parallel_degree=1 to use DDP."
    )


def _patched_init(self: DistributedDataParallel, module: nn.Module, *args: Any, **kwargs: Any):
    check_no_split_experts(module)
    _original_init(self, module, *args, **kwargs)


def install() -> None:
    """Makes ``DistributedDataParallel(...)`` refuse split experts (idempotent)."""
    DistributedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]


def uninstall() -> None:
    """Restores PyTorch's own ``DistributedDataParallel.__init__``."""
    DistributedDataParallel.__init__ = _original_init  # type: ignore[method-assign]
