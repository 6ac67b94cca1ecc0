"""Hybrid sharded data parallelism over PyTorch FSDP, driven by ``hybrid_shard_degree``.

- FSDP1: after ``tsm.init()``, ``FullyShardedDataParallel(model, ...)`` follows the config
  (see ``fsdp1``, the only module that changes FSDP defaults); ``exempt(model)`` and an
  explicit ``process_group`` / ``device_mesh`` opt out.
- FSDP2: ``shard_model(model)`` / ``fully_shard(..., mesh=fsdp2_mesh())``; with replicas,
  ``shard_model(model, overlap_replica_reduction=True)`` averages them during backward
  (``ReplicaReduction``, for models ``fully_shard`` sharded inside a replica).
- Which strategy and mesh: ``tsm.state.sharding_plan`` (``torch_sagemaker.sharding_plan``).
- DDP: ``DistributedDataParallel(model, process_group=tsm.state.dp_process_group)`` for a
  model without DTensor parameters (``tensor_parallel_degree=1``, experts not split); a model
  that ``tsm.transform`` left with DTensor parameters is refused with an error naming FSDP
  (``ddp``, Note [DDP and DTensor parameters]).
- Activation checkpointing per transformer layer: ``checkpoint_transformer_layers(model)``
  (non-reentrant ``checkpoint_wrapper``), before FSDP2 / before or after FSDP1.
- The layer classes of a model (the unit of all three): ``transformer_layer_classes(model)``,
  re-exported from ``torch_sagemaker.policies``, where its one rule lives.
"""

from torch_sagemaker.policies import transformer_layer_classes
from torch_sagemaker.sharding.activation_checkpointing import (
    CheckpointImpl,
    checkpoint_transformer_layers,
)
from torch_sagemaker.sharding.fsdp1 import exempt
from torch_sagemaker.sharding.fsdp2 import fsdp2_mesh, shard_model
from torch_sagemaker.sharding.replica_reduction import ReplicaReduction

__all__ = [
    "CheckpointImpl",
    "ReplicaReduction",
    "checkpoint_transformer_layers",
    "exempt",
    "fsdp2_mesh",
    "shard_model",
    "transformer_layer_classes",
]
