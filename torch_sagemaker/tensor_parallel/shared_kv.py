"""The fused query/key/value projection of multi-query attention, split by its queries.

Note [Shared key/value heads in a fused projection]: under multi-query attention
(Falcon-7B's ``query_key_value``, GPT-BigCode's ``c_attn``) one ``nn.Linear`` computes every
query head and then a single key and a single value head that all query heads share:
``[q | k | v]``, ``k`` and ``v`` one head wide. No split of its rows gives every rank whole
heads of all three, since every rank needs the shared key and value. So the weight and bias
stay whole on the tensor parallel ranks (``Replicate`` DTensors: FSDP shards them over the
data-parallel ranks like any replicated parameter, checkpoints and exports see the model's
own layout), and each rank computes only the rows it needs, its query heads' and the
shared ones: ``[q_r | k | v]``. Its gradient covers its query rows and its share of the key
and value rows' (its query heads' attention to them); summed over the TP ranks
(``AllReduceGrad``), that is the whole gradient, the same on every rank. The input is the
whole activation; its gradient, a partial sum on each rank, is summed at the DTensor
boundary like a column split's.

What this costs against a split weight: every TP rank holds the projection whole
(``(heads + 2) x head_dim x hidden`` per layer: Falcon-7B's is about 9% of its parameters),
and its gradient is all-reduced over the TP ranks each step. The compute is split.
"""

from __future__ import annotations

import types
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from torch_sagemaker.tensor_parallel.local_parameters import local_value
from torch_sagemaker.tensor_parallel.styles import (
    AllReduceGrad,
    distribute_params,
    to_local_partial_grad,
)


class SharedKVColwise(ParallelStyle):
    """An ``nn.Linear`` ``[q | k | v]`` with shared key/value heads: each rank its queries.

    Note [Shared key/value heads in a fused projection].

    Args:
        kv_width: Output features of the shared keys and values together (``2 x head_dim``
            for one key/value head), the last of the projection's outputs.
        name: The module's name (messages).
    """

    def __init__(self, *, kv_width: int, name: str = "") -> None:
        super().__init__()
        self.kv_width = kv_width
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = self.name or type(module).__name__
        if not isinstance(module, nn.Linear):
            raise TypeError(f"shared_kv_colwise applies to nn.Linear; {name} is {type(module)}.")
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        queries = module.out_features - self.kv_width
        if self.kv_width <= 0 or queries <= 0 or queries % tp:
            raise ValueError(
                f"{name}: {module.out_features} output features with {self.kv_width} of "
                f"shared keys and values leave {queries} query features, which do not "
                f"divide over tensor_parallel_degree={tp}: each rank computes whole query "
                "heads (Note [Shared key/value heads in a fused projection])."
            )
        local = queries // tp
        shared = torch.arange(queries, module.out_features)
        rows = torch.cat([torch.arange(rank * local, (rank + 1) * local), shared])
        distribute_params(module, device_mesh, [Replicate()], self.src_data_rank)
        group = device_mesh.get_group()

        def mine(mod: nn.Module, pname: str) -> torch.Tensor | None:
            param = getattr(mod, pname)
            if param is None:
                return None
            whole = AllReduceGrad.apply(local_value(mod, pname, cast(DTensor, param)), group)
            return whole.index_select(0, rows.to(whole.device))

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x = to_local_partial_grad(x, device_mesh)  # its gradient summed over the ranks
            return F.linear(x, cast(torch.Tensor, mine(mod, "weight")), mine(mod, "bias"))

        styled: nn.Module = module  # (a Linear's forward is a method of its class)
        styled.forward = types.MethodType(forward, module)
        return styled


__all__ = ["SharedKVColwise"]
