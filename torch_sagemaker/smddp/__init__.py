"""The Python side of the smddp collective backend (``csrc/smddp/``, in ``torch_sagemaker._C``).

It mirrors ``csrc/smddp/backend/``, the C++ glue to torch.distributed: ``backend``
registers the backend under the name "smddp" and wraps the introspection entry points,
``options`` types a group's settings (``SMDDPOptions``, its ``pg_options``), ``direct``
calls the synchronous all-reduce without torch.distributed's dispatch, and
``fsdp2_buffers`` has FSDP2 take its communication buffers from the backend's pool.
Importing ``torch_sagemaker`` (or SMDDP's path ``smdistributed.dataparallel.torch.torch_smddp``)
calls ``register()`` and ``fsdp2_buffers.install()``.
"""

from torch_sagemaker.smddp.backend import BACKEND_NAME, is_available, register
from torch_sagemaker.smddp.options import SMDDPOptions

__all__ = ["BACKEND_NAME", "SMDDPOptions", "is_available", "register"]
