"""Mixture of experts (``torch.sagemaker.moe``): MoEConfig, MoELayer, expert parallelism.

- ``moe_config.MoEConfig``: what ``tsm.transform(model, config=...)`` does with an MoE model.
- ``moe_layer.MoELayer``: the block that replaces a model's sparse MoE block (``smp_moe``).
- ``routing``: top-k, Sinkhorn, balanced assignment, auxiliary and z-losses (pure).
- ``experts``: fused experts split over the ``expert_parallel_degree`` ranks, with token
  dispatch by all-to-all or all-gather (``collectives``), and the token shuffle.
- ``apply``: the transform step. FSDP wrapping of experts: ``torch_sagemaker.sharding``.

See docs/expert_parallel.md.
"""

from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.moe.moe_layer import MoELayer, aux_losses, set_aux_loss_scale

__all__ = ["MoEConfig", "MoELayer", "aux_losses", "set_aux_loss_scale"]
