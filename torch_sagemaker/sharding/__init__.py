"""Hybrid sharded data parallelism over PyTorch FSDP, driven by ``hybrid_shard_degree``.

- FSDP1: after ``tsm.init()``, ``FullyShardedDataParallel(model, ...)`` follows the config
  (see ``fsdp1``, the only module that changes FSDP defaults).
- FSDP2: ``shard_model(model)`` / ``fully_shard(..., mesh=fsdp2_mesh())``.
- DDP: ``DistributedDataParallel(model, process_group=tsm.state.dp_process_group)``.
"""

from torch_sagemaker.sharding.fsdp2 import fsdp2_mesh, shard_model, transformer_layer_classes

__all__ = ["fsdp2_mesh", "shard_model", "transformer_layer_classes"]
