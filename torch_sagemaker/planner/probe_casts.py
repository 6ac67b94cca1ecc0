"""The probe's watch on casts between the compute dtype and float32 (``Saved.cast``).

Under float32 compute such a cast returns its input, so where a family saves both a tensor
and its cast, a float32 model saves one storage where the probe's bfloat16 run saved two.
``Casts`` records the casts of a run; ``probe_runs`` pairs the saved ones with their saved
sources (Note [Casts that float32 compute skips] there).
"""

from __future__ import annotations

import weakref
from collections.abc import Sized
from typing import Any

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (one storage at a time holds it)."""
    return tensor.untyped_storage().data_ptr()


#: Tensor methods that cast to a dtype and return their input when it has that dtype already
#: (not ``.bfloat16()``: a fixed target, a copy under float32 compute too; nor ``.to(...,
#: copy=True)``).
_CASTS = frozenset({torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.float})


class Casts(torch.overrides.TorchFunctionMode):
    """Records each cast between the compute dtype and float32 in the run (``_CASTS``).

    Under float32 compute such a cast returns its input (``Saved.cast``): where both are
    saved, a float32 model saves one storage where the bfloat16 run saved two.
    """

    def __init__(self, records: Sized) -> None:
        super().__init__()
        self._records = records  # the run's records so far: their count dates each cast
        #: the cast's storage -> (the cast, its source's storage, the source, records then)
        self.made: dict[int, tuple[weakref.ref, int, weakref.ref, int]] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (
            func in _CASTS
            and not (kwargs or {}).get("copy", False)
            and not any(a is True for a in args[1:])  # .to(dtype, non_blocking, copy)
            and isinstance(source, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and {source.dtype, result.dtype} == {torch.bfloat16, torch.float32}
        ):
            self.made[storage_key(result)] = (
                weakref.ref(result),
                storage_key(source),
                weakref.ref(source),
                len(self._records),
            )
        return result

    def of(self, tensor: torch.Tensor) -> tuple[int, weakref.ref, int] | None:
        """``tensor``'s cast, while it lives: its source's storage, the source, records then."""
        made = self.made.get(storage_key(tensor))
        if made is None or made[0]() is None:
            return None
        return made[1], made[2], made[3]


__all__ = ["Casts", "storage_key"]
