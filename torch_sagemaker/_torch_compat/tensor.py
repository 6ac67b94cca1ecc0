"""Private ``torch.Tensor`` attributes, and the local tensor of a DTensor.

``_base`` (the tensor a view was made from), ``_values`` (a sparse COO tensor's values,
coalesced or not), ``_version`` (the count of in-place writes to a tensor) and DTensor's
``_local_tensor`` slot. The last is here rather than in ``dtensor.py`` because reading it
needs no import of ``torch.distributed.tensor``, which the offload hooks put off.

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or ``None`` when it is not a view."""
    return tensor._base


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a sparse COO tensor, also when it is not coalesced."""
    return tensor._values()


def write_count(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor`` (or a view of its storage) has had: its version."""
    return tensor._version


def local_tensor(tensor: DTensor) -> torch.Tensor:
    """The DTensor's local shard: the object itself (``to_local()`` makes a new view per call)."""
    return tensor._local_tensor


def local_tensor_or_self(tensor: torch.Tensor) -> torch.Tensor:
    """``local_tensor(tensor)`` for a DTensor, ``tensor`` itself for any other tensor."""
    return getattr(tensor, "_local_tensor", tensor)


__all__ = ["local_tensor", "local_tensor_or_self", "sparse_values", "view_base", "write_count"]
