"""Prefetching activation offloading (SMP's ``sm_activation_offloading``).

Modules, one concern each:

* ``schedule``   the pure prefetch/release policy over a pass's layers;
* ``buffers``    the reusable (pinned on CUDA) host buffer pool;
* ``streams``    the copies: synchronous, or on CUDA side streams with events;
* ``records``    the per-pass, per-layer and per-storage bookkeeping;
* ``hooks``      the ``saved_tensors_hooks`` glue (views, DTensors, what is never moved);
* ``engine``     follows forward and backward and carries out the schedule;
* ``stats``      the counters; ``wrapper`` the public wrapper; ``torch_patch`` the routing
  of PyTorch's ``offload_wrapper``;
* ``native``     PyTorch's offload-everything wrapper, able to save DTensors (the flag off).

Importing this package installs ``torch_patch`` (a no-op until ``tsm.init()``). Imports go
one way: ``wrapper`` -> ``engine`` -> ``hooks``/``records``/``streams``/``buffers``/``schedule``;
``torch_patch`` is handed the wrapper by this file rather than importing it.
"""

from torch_sagemaker.offload import torch_patch
from torch_sagemaker.offload.native import NativeOffloadWrapper
from torch_sagemaker.offload.schedule import PrefetchSchedule
from torch_sagemaker.offload.stats import OffloadStats
from torch_sagemaker.offload.wrapper import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    PrefetchOffloadWrapper,
    find_layers,
    get_stats,
    offload_wrapper,
)

torch_patch.install(offload_wrapper)

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "NativeOffloadWrapper",
    "OffloadStats",
    "PrefetchOffloadWrapper",
    "PrefetchSchedule",
    "find_layers",
    "get_stats",
    "offload_wrapper",
]
