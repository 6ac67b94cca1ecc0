"""Every private PyTorch name the package uses, behind one layer, one module per torch area.

The package supports torch 2.11 to 2.14 (docs/compatibility.md). A private name (a leading
underscore, or a module PyTorch does not document) may change in any release; reaching it
only through these modules means a new release is ported here, and each entry says on which
versions it was checked and what it does where versions differ.

| module | torch area |
|--------|------------|
| ``aten`` | private ATen operators (CPU flash attention) |
| ``autograd`` | the autograd engine (backward ids, final callbacks) |
| ``c10d`` | ``distributed_c10d``: default group and store, live groups, group backends |
| ``checkpoint_wrapper`` | ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` |
| ``dcp`` | ``torch.distributed.checkpoint``: key flattening, ``_DistWrapper`` |
| ``device_mesh`` | ``DeviceMesh``: concatenate, flatten, unflatten |
| ``dtensor`` | DTensor: ``_StridedShard``, its caches |
| ``float8`` | ``torch._scaled_mm``, the FP8 matrix product |
| ``fsdp1`` | FSDP1: unit state, flat parameters, wrap policies |
| ``fsdp2`` | FSDP2: ``FSDPParamGroup`` |
| ``nn`` | ``nn.Module`` internals, parameter swapping |
| ``pytree`` | ``torch.utils._pytree`` |
| ``signals`` | c10's fatal-signal handler (native stacks on a crash) |
| ``tensor`` | ``Tensor._base``, ``Tensor._values``, DTensor's local tensor |

The layer imports only torch, so any module of the package may import it. ``PRIVATE_NAMES``
(``registry``) lists every private name it touches; ``tests/unit/test_torch_compat.py``
checks that each exists on the installed torch and that no module outside the layer reaches
a private torch name itself.
"""

from __future__ import annotations

from torch_sagemaker._torch_compat.registry import PRIVATE_NAMES, STATEFUL_NAMES
from torch_sagemaker._torch_compat.version import TORCH_VERSION, torch_at_least

__all__ = ["PRIVATE_NAMES", "STATEFUL_NAMES", "TORCH_VERSION", "torch_at_least"]
