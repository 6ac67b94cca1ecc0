"""Running a module's forward on the local values of its replicated DTensor parameters.

Styles that compute a replicated module locally (``styles.ReplicateParallel``,
``replicated_styles.ReplicatedLocal``) swap each DTensor parameter for its local tensor
around the module's own forward.

Note [Replicated parameters under FSDP1]: for its forward, FSDP1 with
``use_orig_params=True`` sets each unsharded parameter as an instance attribute of its module
(a DTensor for a TP parameter), which attribute lookup finds before the registered parameter
of the same name (a stale sharded view); ``named_parameters()`` lists the registered ones.
Swapping those left the forward with DTensor weights and plain activations ("mixed
torch.Tensor and DTensor": Qwen3 and Gemma on their transformers plans, Mixtral's router).
So the parameters are named once, when the style is applied, then read as attributes at
each call, and an instance attribute is swapped in the instance's dictionary. Outside FSDP
the attribute is the registered parameter itself, swapped as before. Names read again at a
call miss more: in the forward that activation checkpointing recomputes during backward (as
SMP's scripts apply it, after FSDP1), ``named_parameters()`` lists none of the unit's
parameters, so styles that listed them at each call (``local_params`` owners: attention
sinks, GPT-NeoX-Japanese's output bias, Qwen 3.5's convolution weight; Llama 4's and DBRX's
experts) computed with DTensor weights there.

Note [Parameters still sharded by FSDP]: FSDP2 keeps a tensor-parallel parameter, between
the forwards of the unit that owns it, as a DTensor on the mesh (data-parallel dimensions,
then the TP one) with a ``Shard`` (or ``_StridedShard``) placement on a data-parallel
dimension; the unit's forward swaps in the unsharded parameter, a DTensor on the 1-D TP
mesh. The styles here take the local value for the weight the module computes with (the
whole weight for a replicated module). A module called outside the forward of the FSDP
unit that owns its parameters (Gemma 3's ``generate`` computes the image features before
the first forward of the root) took this rank's FSDP shard instead: an index error in a
vision embedding, or silently wrong values where the indices fit in the shard (a position
embedding). PyTorch's DTensor computation refuses the same call ("mixed torch.Tensor and
DTensor"); ``check_unsharded`` raises and names the module and the fix. A parameter of an
FSDP unit nested below the module is let through: a replicated module swaps its whole
subtree, so those are still sharded when it starts, and the nested unit's own forward
swaps in its unsharded parameters before they are used. Inside the forward the test is one
look at the number of placements (one: the TP layout alone); the full test runs only for a
parameter on a larger mesh.

FSDP1 (``use_orig_params=True``, a sharded strategy) leaves no DTensor outside the forward of
the unit: each original parameter holds a 1-D slice of this rank's flat shard (empty where
the shard has none of it), a plain tensor that failed on its shape deep inside the module
("weight should have at least three dimensions" in SigLIP's patch embedding). So the
styles record, when they are applied, the shape of each parameter's local value
(``parameter_shapes``); a plain parameter that FSDP1 flattened (``fsdp1.is_flattened`` in
the compatibility layer) and whose shape differs from that raises the same error. One
that has its shape is whole (NO_SHARD keeps whole local tensors between steps, Note [FSDP1
NO_SHARD with DTensor parameters] in ``sharding/fsdp1_layout.py``; inside
``summon_full_params`` every parameter is whole) and is computed with. A 1-D parameter that
lies wholly in one rank's shard has its shape on that rank, which then does not raise for
it; the module's other parameters, and the other ranks, do. Parameters of a nested FSDP1
unit are let through as for FSDP2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker._torch_compat import tensor as tensor_compat

_GATHER_FIRST = (
    "Call it from inside the model's forward, or gather the parameters first: for FSDP2, "
    "unshard() on the fully_shard module that owns them (model.unshard() for the root's), "
    "for FSDP1, FullyShardedDataParallel.summon_full_params(model)."
)


def parameter_shapes(module: nn.Module, recurse: bool = True) -> dict[str, torch.Size]:
    """Every name of ``module``'s parameters (tied ones under each name) with its local shape.

    The local shape is that of the value the module computes with (a DTensor's local tensor).
    ``recurse=False``: the module's own parameters only.
    """
    return {
        n: tensor_compat.local_tensor_or_self(p).shape
        for n, p in module.named_parameters(recurse=recurse, remove_duplicate=False)
    }


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _to_local(param: DTensor) -> torch.Tensor:
    return param.to_local()


def _in_nested_fsdp_unit(module: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``module`` belongs to an FSDP unit below ``module``.

    Such a unit unshards it in its own forward, before it is used: a replicated module swaps
    its whole subtree, nested units' parameters included, still sharded at that point.
    """
    owner = module
    for part in name.split(".")[:-1]:
        owner = owner.get_submodule(part)
        if isinstance(owner, (FSDPModule, FullyShardedDataParallel)):
            return True
    return False


def check_unsharded(module: nn.Module, name: str, param: DTensor) -> None:
    """Raises if ``param`` is still sharded by FSDP (Note [Parameters still sharded by FSDP]).

    Args:
        module: The module about to compute with the parameter (named in the error).
        name: The parameter's name in ``module``.
        param: The parameter, a DTensor that a TP style put on the 1-D TP mesh.

    Raises:
        RuntimeError: ``param`` is split over a data-parallel mesh dimension: ``module`` runs
            outside the forward of the FSDP unit that owns it.
    """
    placements = param.placements
    if len(placements) == 1:  # the TP layout alone: inside the forward, or no FSDP
        return
    mesh = param.device_mesh
    # The TP dimension is the last one; a Replicate on the others is a replica, not a shard.
    sharded = any(not p.is_replicate() and mesh.size(i) > 1 for i, p in enumerate(placements[:-1]))
    if not sharded or _in_nested_fsdp_unit(module, name):
        return
    dims: tuple[object, ...] = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    raise RuntimeError(
        f"{type(module).__name__} ran outside the forward of the FSDP module that owns its "
        f"parameters, while they are sharded: its parameter {name!r} is this rank's FSDP "
        f"shard {tuple(param.to_local().shape)} of the {tuple(param.shape)} parameter "
        f"(placements {tuple(placements)} on mesh dimensions {dims}), not the value the "
        f"module computes with. {_GATHER_FIRST}"
    )


def check_not_fsdp1_shard(
    module: nn.Module, name: str, param: torch.Tensor, shape: torch.Size
) -> None:
    """Raises if plain ``param`` is FSDP1's shard of a parameter of local shape ``shape``.

    Note [Parameters still sharded by FSDP].

    Args:
        module: The module about to compute with the parameter (named in the error).
        name: The parameter's name in ``module``.
        param: The parameter as the module finds it now (not a DTensor).
        shape: The shape of its local value when the style was applied.

    Raises:
        RuntimeError: FSDP1 flattened ``param`` and it does not have ``shape``: ``module``
            runs outside the forward of the FSDP1 unit that owns it.
    """
    if param.shape == shape or not fsdp1_compat.is_flattened(param):
        return
    if _in_nested_fsdp_unit(module, name):
        return
    raise RuntimeError(
        f"{type(module).__name__} ran outside the forward of the FSDP module that owns its "
        f"parameters, while they are sharded: its parameter {name!r} is this rank's "
        f"{tuple(param.shape)} slice of FSDP1's flat shard, not the {tuple(shape)} value "
        f"the module computes with. {_GATHER_FIRST}"
    )


def local_value(module: nn.Module, name: str, param: DTensor) -> torch.Tensor:
    """``param.to_local()``, refusing an FSDP shard (Note [Parameters still sharded by FSDP]).

    Args:
        module: The module that computes with the parameter (named in the error).
        name: The parameter's name in ``module``.
        param: The parameter, a DTensor that a TP style put on the 1-D TP mesh.

    Raises:
        RuntimeError: ``param`` is still sharded by FSDP (``check_unsharded``).
    """
    check_unsharded(module, name, param)
    return param.to_local()


@contextlib.contextmanager
def local_parameters(
    module: nn.Module,
    shapes: dict[str, torch.Size],
    local_of: Callable[[DTensor], torch.Tensor] = _to_local,
) -> Iterator[None]:
    """``module``'s DTensor parameters named in ``shapes`` are their local tensors in the block.

    Autograd flows from the local tensors into the DTensors. Note [Replicated parameters
    under FSDP1].

    Args:
        module: The module whose forward runs in the block.
        shapes: Its parameters' names and local shapes (``parameter_shapes``, taken when the
            style was applied).
        local_of: The tensor that stands for a DTensor parameter (default: its local tensor).

    Raises:
        RuntimeError: A parameter is still sharded by FSDP: ``module`` runs outside the
            forward of the FSDP unit that owns it (Note [Parameters still sharded by FSDP]).
    """
    registered: dict[str, torch.Tensor] = {}
    shadowed: list[tuple[nn.Module, str, DTensor]] = []
    for name, shape in shapes.items():
        owner, leaf = _owner(module, name)
        value = getattr(owner, leaf, None)
        if not isinstance(value, DTensor):
            if isinstance(value, torch.Tensor):
                check_not_fsdp1_shard(module, name, value, shape)
            continue
        check_unsharded(module, name, value)
        if leaf in vars(owner):  # FSDP1's instance attribute hides the registered parameter
            shadowed.append((owner, leaf, value))
        else:
            registered[name] = local_of(value)
    with nn_compat.parameters_swapped(module, registered):
        try:
            for owner, leaf, value in shadowed:
                vars(owner)[leaf] = local_of(value)
            yield
        finally:
            for owner, leaf, value in reversed(shadowed):
                vars(owner)[leaf] = value


__all__ = [
    "check_not_fsdp1_shard",
    "check_unsharded",
    "local_parameters",
    "local_value",
    "parameter_shapes",
]
