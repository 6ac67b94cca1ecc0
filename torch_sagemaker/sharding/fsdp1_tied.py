"""Tied tensor-parallel parameters under FSDP1: one parameter, flattened once.

``install()`` (called by ``tsm.init``) wraps the ``FlatParamHandle`` method that builds an
FSDP1 unit's flat parameter so that a DTensor parameter held under several names (tied
weights after ``tsm.transform``) is flattened once and its other names are recorded as
shared, as FSDP1 does for a plain tied parameter (Note [Tied DTensor parameters under
FSDP1]). ``uninstall()`` restores PyTorch's method.

Note [Tied DTensor parameters under FSDP1]
------------------------------------------
A model with tied weights (``tie_word_embeddings=True``: Qwen2, Llama 3.2 1B and 3B, ...)
holds one parameter object under two names, ``model.embed_tokens.weight`` and
``lm_head.weight``. ``tsm.transform`` keeps it one object when tensor parallelism turns it
into a DTensor: the vocabulary-parallel embedding and the column-parallel head both shard
it ``Shard(0)`` over the vocabulary, and ``tensor_parallel/plan.py`` re-registers the one
DTensor under every name of the tie.

FSDP1 finds shared parameters while it builds a unit's flat parameter
(``FlatParamHandle._init_flat_param_and_metadata``): it walks the unit's modules, remembers
each parameter it flattens, and records a later name of a remembered object as shared (no
slot of its own; between steps the name is registered as the first name's parameter). It
remembers the tensor *after* the FSDP extension's pre-flatten transform, though, and under
tensor parallelism that transform (PyTorch's ``DTensorExtensions``, which our
``SMPFSDPExtensions`` inherits) replaces a DTensor by its local tensor. The walk looks up
the DTensor, the memo holds its local tensor, so the later name is never found: it gets a
slot of its own, initialised with a copy of the values. From then on the two names are two
parameters, each updated with its own module's gradient only (a tiny tied Qwen2 at tp 2,
three AdamW steps at lr 1e-2: embedding and head 0.057 apart). FSDP1 without tensor
parallelism is not affected (no transform: the memo holds the parameter itself), nor is
FSDP2, which keeps the module's own (tied) DTensor parameters.

The fix, while a flat parameter is built: the later names of each DTensor that the unit
holds under several names are taken out of their modules, PyTorch's method flattens the
DTensor once, and the names are put back and recorded as shared the way PyTorch records a
shared plain parameter (a ``SharedParamInfo``; with ``use_orig_params=True`` the primary's
original-parameter object as the shared parameter, so both names are one object between
steps and the optimizer sees it once). FSDP1's own code then keeps the tie everywhere: the
sharded views, the forward (both modules read one unsharded view, so autograd sums the
embedding's and the head's gradients into one slot, as in the unsharded model), gradient
views, write-back, state dicts (the later name's value is the primary's) and the optimizer
state (one entry, under the primary name).

One PyTorch path does not work for a shared DTensor and is replaced on the handles this
fix touched: exposing the unsharded parameters *as parameters* (``summon_full_params``,
state dicts, every step under ``NO_SHARD``) gives each DTensor view a fresh
``nn.Parameter`` and then assigns ``shared.data = primary``, which a plain parameter cannot
take from a DTensor. The handle's ``_use_unsharded_views`` runs PyTorch's without the shared
records and then registers each later name as its primary's parameter object, the result
PyTorch's assignment has for plain tensors. ``NO_SHARD`` re-registers the primaries once
more (Note [FSDP1 NO_SHARD with DTensor parameters] in ``fsdp1_layout``) and then calls
``point_shared_names`` again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker._torch_compat.fsdp1 import FlatParamHandle, SharedParamInfo

_original_init_flat_param: Callable[..., None] | None = None


@dataclass(frozen=True)
class _Name:
    """One name of a parameter: ``module.<name>``, ``module`` being ``module_name`` in the unit."""

    module: nn.Module
    name: str
    module_name: str


def _later_names(unit_module: nn.Module, params: list[Any]) -> list[tuple[_Name, _Name]]:
    """``(later name, primary name)`` of each DTensor in ``params`` held under several names.

    The primary is the first name in FSDP1's own walk (``named_modules`` with duplicates,
    then each module's own parameters), which is the name FSDP1 flattens. A module that
    appears twice in the walk repeats its own names; those are not other names.
    """
    to_flatten = {id(p) for p in params if isinstance(p, DTensor)}
    primary: dict[int, _Name] = {}
    later: list[tuple[_Name, _Name]] = []
    seen: set[tuple[int, str]] = set()
    for module_name, module in unit_module.named_modules(remove_duplicate=False):
        for name, param in nn_compat.own_parameters(module).items():
            if param is None or id(param) not in to_flatten or (id(module), name) in seen:
                continue
            seen.add((id(module), name))
            here = _Name(module, name, module_name)
            if id(param) in primary:
                later.append((here, primary[id(param)]))
            else:
                primary[id(param)] = here
    return later


def _flatten_keeping_ties(
    handle: FlatParamHandle,
    params: list[Any],
    unit_module: nn.Module,
    aligned_numel: int,
    use_orig_params: bool,
) -> None:
    """PyTorch's flat-parameter construction, each tied DTensor flattened once.

    See Note [Tied DTensor parameters under FSDP1].
    """
    assert _original_init_flat_param is not None  # installed
    later = _later_names(unit_module, params)
    if not later:
        _original_init_flat_param(handle, params, unit_module, aligned_numel, use_orig_params)
        return
    # Take the later names out, keeping each module's registration order to restore it.
    owners = {id(n.module): n.module for n, _ in later}
    registered = {key: dict(nn_compat.own_parameters(m)) for key, m in owners.items()}
    for n, _ in later:
        del nn_compat.own_parameters(n.module)[n.name]
    try:
        _original_init_flat_param(handle, params, unit_module, aligned_numel, use_orig_params)
    finally:
        for key, module in owners.items():
            own = nn_compat.own_parameters(module)
            own.clear()
            own.update(registered[key])
    flat_param = handle.flat_param
    slot = {
        (id(info.module), info.param_name): i
        for i, info in enumerate(fsdp1_compat.param_infos(flat_param))
    }
    originals = fsdp1_compat.original_params(flat_param)
    for n, first in later:
        index = slot[(id(first.module), first.name)]
        info = SharedParamInfo(
            n.name, n.module, n.module_name, first.name, first.module, first.module_name
        )
        fsdp1_compat.add_shared_param(
            flat_param, info, originals[index] if originals is not None else None
        )
    _register_shared_as_primaries(handle)


def shared_fqns(flat_param: Any) -> list[tuple[str, str]]:
    """``(name, primary's name)`` of each later name of a shared parameter of a flat parameter.

    Names are relative to the unit's module, as ``FlatParameter._fqns`` names the primaries.
    """

    def fqn(module_name: str, name: str) -> str:
        return f"{module_name}.{name}" if module_name else name

    return [
        (fqn(info.module_name, info.param_name), fqn(info.prim_module_name, info.prim_param_name))
        for info in fsdp1_compat.shared_param_infos(flat_param)
    ]


def _primaries_on_sharded_load(
    unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    """Load pre-hook: a later name of a tied parameter loads its primary's value.

    FSDP1's own pre-hook (registered before this one) turned every name's sharded value
    into the TP-local tensor, and the primaries' back into TP DTensors; a later name has no
    DTensor spec of its own, so it is left a plain tensor that cannot be loaded into the
    (DTensor) parameter. It is the same parameter: it takes the primary's converted value.
    """
    if fsdp1_compat.state_dict_type(unit) is not StateDictType.SHARDED_STATE_DICT:
        return
    handle = fsdp1_compat.handle(unit)
    assert handle is not None  # attached to units with shared parameters only
    inner = prefix + fsdp1_compat.WRAPPED_MODULE_PREFIX
    for name, primary in shared_fqns(handle.flat_param):
        source = inner + fsdp1_compat.clean_tensor_name(primary)
        if source in state_dict:
            state_dict[inner + fsdp1_compat.clean_tensor_name(name)] = state_dict[source]


def attach(unit: FullyShardedDataParallel) -> None:
    """Adds the sharded-load fix of tied DTensor parameters to a freshly built FSDP1 unit.

    Args:
        unit: An FSDP1 unit; nothing is added unless its flat parameter has shared names.
    """
    handle = fsdp1_compat.handle(unit)
    if handle is not None and shared_fqns(handle.flat_param):
        unit.register_load_state_dict_pre_hook(_primaries_on_sharded_load)


def point_shared_names(handle: FlatParamHandle) -> None:
    """Registers every later name of a shared parameter as its primary's parameter object.

    Used after the primaries were (re-)registered as parameters (Note [Tied DTensor
    parameters under FSDP1]).
    """
    for info in fsdp1_compat.shared_param_infos(handle.flat_param):
        primary = nn_compat.own_parameters(info.prim_module)[info.prim_param_name]
        assert isinstance(primary, nn.Parameter)  # registered as a parameter just before
        fsdp1_compat.setattr_param(handle, info.module, info.param_name, primary)


def _register_shared_as_primaries(handle: FlatParamHandle) -> None:
    """Wraps the handle's ``_use_unsharded_views`` for shared DTensor parameters."""
    use_unsharded_views = getattr(handle, fsdp1_compat.USE_UNSHARDED_VIEWS)
    flat_param = handle.flat_param

    @functools.wraps(use_unsharded_views)
    def use_unsharded_views_keeping_ties(as_params: bool) -> None:
        if not as_params:  # PyTorch registers the primary's view under each name
            use_unsharded_views(as_params)
            return
        infos = fsdp1_compat.shared_param_infos(flat_param)
        fsdp1_compat.set_shared_param_infos(flat_param, ())
        try:
            use_unsharded_views(as_params)
        finally:
            fsdp1_compat.set_shared_param_infos(flat_param, infos)
        point_shared_names(handle)

    setattr(handle, fsdp1_compat.USE_UNSHARDED_VIEWS, use_unsharded_views_keeping_ties)


def install() -> None:
    """Makes FSDP1 flatten each tied DTensor parameter once (idempotent)."""
    global _original_init_flat_param
    if _original_init_flat_param is not None:
        return
    _original_init_flat_param = getattr(FlatParamHandle, fsdp1_compat.INIT_FLAT_PARAM_AND_METADATA)
    setattr(FlatParamHandle, fsdp1_compat.INIT_FLAT_PARAM_AND_METADATA, _flatten_keeping_ties)


def uninstall() -> None:
    """Restores PyTorch's flat-parameter construction (units built before keep their ties)."""
    global _original_init_flat_param
    if _original_init_flat_param is None:
        return
    setattr(FlatParamHandle, fsdp1_compat.INIT_FLAT_PARAM_AND_METADATA, _original_init_flat_param)
    _original_init_flat_param = None


__all__ = ["attach", "install", "point_shared_names", "shared_fqns", "uninstall"]
