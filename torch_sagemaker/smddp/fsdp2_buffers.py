"""FSDP2 communication buffers from the smddp pool for every ``fully_shard`` call.

Note [Pool buffers for every FSDP2 user]
FSDP2 allocates the output of its all-gather and the input of its reduce-scatter with
``torch.empty`` unless ``set_allocate_memory_from_process_group_for_comm(True)`` was called
on every FSDP module; then it asks the process group (``backend.allocate_tensor``). On
smddp those tensors live in the rank's shared-memory pool, which peers map, so the
collectives read them in place instead of copying them through the staging buffers
(Note [Zero-copy operands] in csrc/smddp/algorithms/shm_algos.h). ``shard_model`` always made that
call, but a script that calls ``fully_shard`` itself, as torchtitan and most FSDP2 users do,
paid the staging copies: on the 2-rank 58M Llama benchmark that was the difference between
1.32x and 1.7x of gloo.

FSDP2 has no public default for this choice, and ``fully_shard`` is often imported before
``torch_sagemaker`` (so replacing the function would miss those callers). The choice lives
in ``FSDPParamGroup``, which every ``fully_shard`` call with parameters constructs, so
``install`` wraps its ``__init__``: after the original, a CPU param group whose all-gather
and reduce-scatter groups both run on smddp switches to process-group allocation. Nothing
changes for other backends or for CUDA parameters. The user keeps the last word: calling
``module.set_allocate_memory_from_process_group_for_comm(False)`` after ``fully_shard``
turns it off again, exactly as before. Values are bit-identical either way (the same
reduction order runs on pool and staged operands); tests/distributed/test_smddp_zero_copy.py
checks it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker._torch_compat import fsdp2 as fsdp2_compat
from torch_sagemaker._torch_compat.fsdp2 import FSDPParamGroup
from torch_sagemaker.smddp.backend import BACKEND_NAME

_original_init: Any = None


def runs_on_smddp(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs its CPU collectives on the smddp backend."""
    try:
        backend = c10d_compat.backend_of(group, torch.device("cpu"))
    except RuntimeError:  # the group has no CPU backend
        return False
    return backend.name() == BACKEND_NAME


def _use_pool_buffers(param_group: FSDPParamGroup) -> None:
    if param_group.device.type != "cpu":
        return
    groups = (
        fsdp2_compat.all_gather_process_group(param_group),
        fsdp2_compat.reduce_scatter_process_group(param_group),
    )
    if all(runs_on_smddp(g) for g in groups):
        param_group.set_allocate_memory_from_process_group(True)


def install() -> None:
    """Makes every CPU ``fully_shard`` on smddp groups allocate its buffers from the pool.

    Idempotent. See Note [Pool buffers for every FSDP2 user].
    """
    global _original_init
    if _original_init is not None:
        return
    original = FSDPParamGroup.__init__

    @functools.wraps(original)
    def init_then_use_pool(self: FSDPParamGroup, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _use_pool_buffers(self)

    FSDPParamGroup.__init__ = init_then_use_pool  # type: ignore[method-assign]
    _original_init = original


def uninstall() -> None:
    """Restores FSDP2's own ``FSDPParamGroup.__init__``.

    Param groups built afterwards use ``torch.empty`` buffers again unless their module asks
    for pool buffers.
    """
    global _original_init
    if _original_init is None:
        return
    FSDPParamGroup.__init__ = _original_init  # type: ignore[method-assign]
    _original_init = None
