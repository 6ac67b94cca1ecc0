"""Private ``torch.distributed.checkpoint`` (DCP) names: its key flattening and ``_DistWrapper``.

``flatten_state_dict``/``unflatten_state_dict`` are DCP's own (``_nested_dict``), so that keys
compared or rebuilt by the package are exactly the keys DCP stores. ``DistWrapper`` is the
class whose ``__init__`` the package patches (``checkpoint/dcp_patches.py``).

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from torch.distributed.checkpoint import utils as _dcp_utils
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

#: DCP's ``_DistWrapper``: the owner of the ``__init__`` that reads ``coordinator_rank``.
DistWrapper = _dcp_utils._DistWrapper

__all__ = ["DistWrapper", "flatten_state_dict", "unflatten_state_dict"]
