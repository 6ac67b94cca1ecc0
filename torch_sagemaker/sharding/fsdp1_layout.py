"""FSDP1 over SMP's meshes.

What its state dicts look like, and tensor-parallel parameters that FSDP1 does not shard.

``sharding/fsdp1.py`` hands FSDP1 a mesh sliced out of ``tsm.state.device_mesh``. PyTorch then
treats every such FSDP1 unit as "FSDP + TP" and picks its ``DTensorExtensions``, whose
sharded-state-dict layout assumes a 2-D ``(dp, tp)`` root mesh. On SMP's 4-D root mesh
``(dp_replicate, dp_shard, cp, tp)`` that layout is wrong (Note [FSDP1 sharded state dict
layout]). This module replaces the extension of every FSDP1 unit ``tsm.init``'s patch builds
with ``SMPFSDPExtensions`` and keeps DTensor parameters usable under ``NO_SHARD`` (Note
[FSDP1 NO_SHARD with DTensor parameters]).

Note [FSDP1 sharded state dict layout]
--------------------------------------
SMP's example scripts save ``SHARDED_STATE_DICT`` checkpoints one directory per TP and EP rank
(``tp{degree}-{rank}``, ``ep{degree}-{rank}``), written by the ranks of one FSDP shard group
(``process_group=model.process_group``) of replica 0, and load them the same way. So within
one directory the "global" tensor must be the TP- and EP-local tensor, and the shard group
must cover it whole:

- PyTorch's layout put ``Shard(0)`` on mesh axis 0 of the root mesh (``dp_replicate``) for
  plain tensors, and on axis -2 (``cp``) for TP DTensors, with TP kept as a placement. The
  writing ranks then covered half of each tensor, and DCP refused the plan.
- Ours: every parameter and optimizer state becomes a DTensor on FSDP's own mesh, ``(Shard(0),)``
  over the shard group or ``(Replicate(), Shard(0))`` over ``(replicate, shard)`` with HSDP,
  whose global shape is the TP-local shape. A TP parameter (or an EP-split expert tensor)
  contributes its local shard.

The cost: FSDP1's sharded state dict does not reshard across TP or EP degrees (SMP's doesn't
either; its directories are per TP and EP rank). ``TrainingState`` (our reshardable
checkpoint) therefore saves FSDP1 + TP/EP models per rank directory too; FSDP2 checkpoints
reshard freely. Why no test caught PyTorch's layout before: the sharded checkpoints were
tested through ``TrainingState`` with FSDP2 for TP and with FSDP1 only without replicas or TP,
never through FSDP1's own state dict saved by a sub-group, as SMP's scripts do.

Note [FSDP1 NO_SHARD with DTensor parameters]
---------------------------------------------
With a shard group of one rank (``hybrid_shard_degree=1``, or TP over the whole world)
FSDP1 uses ``NO_SHARD``. With ``use_orig_params=True`` it then registers a *new*
``nn.Parameter`` for every DTensor view each time it exposes the unsharded parameters
(PyTorch cannot assign ``param.data = view`` for a DTensor). Three things break: the next
write-back check sees a "changed" parameter of the TP global shape ("Cannot writeback when
the parameter shape changes"), the optimizer holds parameter objects FSDP no longer updates,
and PyTorch does not mark the new objects as flattened, so the enclosing unit (the root)
flattens the layers' parameters a second time. We register FSDP's own parameter objects
instead (``flat_param._params``, the TP-local tensors), pointing their data at the new views,
which is what FSDP does for plain tensors and what the sharded strategies expose between
steps (local shards, not DTensors). Forward and backward still see DTensor views.

Unsharded gradients need the same, under every strategy: ``summon_full_params(with_grads=
True)``, ``NO_SHARD``'s gradients, and a sharded strategy's after a backward inside
``no_sync()`` (gradient accumulation). PyTorch points each parameter's ``.grad`` at a view of
the flat gradient. A DTensor view has the TP global shape, unlike our TP-local parameter (or
the flat shard a sharded strategy registers), and for that case PyTorch assigns
``param.grad.data = view``, which on a plain tensor took the DTensor's global shape without
its memory: reading the gradient then crashed the process (SIGSEGV). The gradient is set to
the view's local tensor instead, which has the parameter's shape.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel.fsdp import DTensorExtensions

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker._torch_compat import tensor as tensor_compat
from torch_sagemaker.sharding import fsdp1_state_dict, fsdp1_tied


class SMPFSDPExtensions(DTensorExtensions):
    """FSDP1 extension for SMP's meshes (Note [FSDP1 sharded state dict layout]).

    Flattening and unflattening of TP DTensor parameters are PyTorch's; the sharded
    state-dict layout is ours: DTensors on FSDP's mesh whose global shape is TP-local.
    """

    def chunk_dtensor(self, tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> DTensor:
        """The local FSDP chunk of ``tensor`` as a DTensor on ``device_mesh``.

        The chunk is cut from the TP-local tensor if ``tensor`` is a DTensor.

        Args:
            tensor: An unsharded parameter or optimizer state (a TP DTensor or a plain tensor).
            rank: This rank in FSDP's process group (unused: the mesh knows it).
            device_mesh: The 1-D (shard) or 2-D (replicate, shard) mesh FSDP was given.

        Returns:
            A DTensor sharded on dim 0 over the last mesh axis, replicated over the others.
        """
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        local = local.detach().clone()
        if isinstance(tensor, DTensor) or _tp_or_ep():
            note_tp_local_mesh(device_mesh)
        replicated = [Replicate()] * device_mesh.ndim
        sharded = [*replicated[:-1], Shard(0)]
        return DTensor.from_local(local, device_mesh, replicated, run_check=False).redistribute(
            device_mesh, sharded
        )

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: DeviceMesh | None) -> torch.Tensor:
        """Gathers a ``chunk_dtensor`` DTensor back into the TP-local tensor (for loading)."""
        mesh = tensor.device_mesh
        return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()


_TP_LOCAL_MESHES: set[tuple[int, ...]] = set()
"""The ranks of every mesh that holds TP-/EP-local tensors as its "global" ones."""


def _tp_or_ep() -> bool:
    from torch_sagemaker.state import state

    return state.initialized and (state.tp_size > 1 or state.ep_size > 1)


def note_tp_local_mesh(device_mesh: DeviceMesh) -> None:
    """Records that DTensors on ``device_mesh`` hold TP-/EP-local tensors (for ``save``)."""
    _TP_LOCAL_MESHES.add(tuple(device_mesh.mesh.flatten().tolist()))


def is_tp_local_mesh(device_mesh: DeviceMesh) -> bool:
    """Whether FSDP1 put TP-/EP-local tensors on ``device_mesh`` in this process.

    Note [FSDP1 sharded state dict layout]: every TP (or EP) rank then holds the same keys,
    shapes and offsets with other values, so they are saved one directory per TP/EP rank.
    """
    return tuple(device_mesh.mesh.flatten().tolist()) in _TP_LOCAL_MESHES


def _register_local_parameters(handle: Any) -> None:
    """Keeps FSDP's own parameter objects registered under NO_SHARD.

    See Note [FSDP1 NO_SHARD with DTensor parameters].
    """
    flat_param = handle.flat_param
    use_unsharded_views = getattr(handle, fsdp1_compat.USE_UNSHARDED_VIEWS)

    def use_unsharded_views_keeping_parameters(as_params: bool) -> None:
        use_unsharded_views(as_params)
        if not as_params:
            return
        for original, (name, module, _) in zip(
            # A list here: ``adapt`` checked that the handle keeps the original parameters.
            cast(list[nn.Parameter], fsdp1_compat.original_params(flat_param)),
            fsdp1_compat.param_infos(flat_param),
            strict=True,
        ):
            current = nn_compat.own_parameters(module).get(name)
            if isinstance(current, DTensor) and current is not original:
                # What FSDP does for plain tensors: the kept parameter points at the new view.
                original.data = tensor_compat.local_tensor(current)
                fsdp1_compat.setattr_param(handle, module, name, original)
        # Tied parameters' other names follow their primary (Note [Tied DTensor parameters
        # under FSDP1] in fsdp1_tied).
        fsdp1_tied.point_shared_names(handle)

    setattr(handle, fsdp1_compat.USE_UNSHARDED_VIEWS, use_unsharded_views_keeping_parameters)
    # FSDP registered fresh DTensor parameters at the end of its constructor; swap them now.
    use_unsharded_views_keeping_parameters(True)


def _unsharded_gradients_as_local_tensors(handle: Any) -> None:
    """Points each parameter's unsharded gradient at the TP-local tensor of FSDP's view.

    FSDP1 exposes unsharded gradients under ``NO_SHARD`` and, with the sharded strategies,
    after a backward inside ``no_sync()`` (gradient accumulation). See Note [FSDP1 NO_SHARD
    with DTensor parameters].
    """
    flat_param = handle.flat_param
    use_unsharded_grad_views = getattr(handle, fsdp1_compat.USE_UNSHARDED_GRAD_VIEWS)

    def use_unsharded_grad_views_of_local_parameters() -> None:
        grad = flat_param.grad
        views = [] if grad is None else fsdp1_compat.unflat_views(handle, grad)
        if not any(isinstance(v, DTensor) for v in views):
            use_unsharded_grad_views()  # no gradient, or no DTensor view: PyTorch's is right
            return
        # PyTorch's, with the DTensor views' local tensors for the plain parameters FSDP keeps
        # registered; a DTensor parameter (``summon_full_params`` registers the views) keeps
        # its DTensor gradient.
        infos = fsdp1_compat.param_infos(flat_param)
        for view, (name, module, _) in zip(views, infos, strict=True):
            param = getattr(module, name)
            local = (
                tensor_compat.local_tensor(view)
                if isinstance(view, DTensor) and not isinstance(param, DTensor)
                else view
            )
            if (param.shape, param.dtype, param.device) == (local.shape, local.dtype, local.device):
                param.grad = local
            else:
                # A sharded parameter (no_sync under a sharded strategy) or a low-precision
                # gradient (no_sync under mixed precision): PyTorch's ``.data`` swap, which
                # sidesteps the gradient's shape and dtype check, with a plain tensor.
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                param.grad.data = local
        for info in fsdp1_compat.shared_param_infos(flat_param):
            param = getattr(info.module, info.param_name)
            primary = getattr(info.prim_module, info.prim_param_name)
            if param is not primary:
                if param.shape == primary.grad.shape and param.dtype == primary.grad.dtype:
                    param.grad = primary.grad
                else:
                    if param.grad is None:
                        param.grad = torch.empty_like(param)
                    param.grad.data = primary.grad

    setattr(
        handle, fsdp1_compat.USE_UNSHARDED_GRAD_VIEWS, use_unsharded_grad_views_of_local_parameters
    )


def frozen_parameters(module: nn.Module) -> set[tuple[int, str]]:
    """``(id(owner), name)`` of each parameter below ``module`` that requires no gradient.

    Read before FSDP1 flattens ``module`` (Note [Frozen DTensor parameters under FSDP1]).
    """
    return {
        (id(owner), name)
        for owner in module.modules()
        for name, param in nn_compat.own_parameters(owner).items()
        if param is not None and not param.requires_grad
    }


# Note [Frozen DTensor parameters under FSDP1]
#     With ``use_orig_params=True`` FSDP1 keeps one parameter object per original parameter
#     (``flat_param._params``). For a tensor-parallel (DTensor) parameter it flattens the
#     local tensor, a plain tensor, and wraps it in a new ``nn.Parameter``, which requires a
#     gradient whatever the original did. A frozen parameter of a TP model (Marian's and
#     Pegasus's sinusoidal positions, RoFormer's) then got a gradient and was trained, or was
#     refused by the replicated-gradient check. The flags read before the constructor
#     (``frozen_parameters``) are put back on FSDP1's objects.
def _keep_frozen(handle: Any, frozen: Collection[tuple[int, str]]) -> None:
    flat_param = handle.flat_param
    params = fsdp1_compat.original_params(flat_param)
    if not frozen or params is None:
        return
    for param, (name, owner, _) in zip(params, fsdp1_compat.param_infos(flat_param), strict=True):
        if (id(owner), name) in frozen:
            param.requires_grad_(False)


def adapt(fsdp_module: FullyShardedDataParallel, frozen: Collection[tuple[int, str]] = ()) -> None:
    """Applies this module's fixes to a freshly built FSDP1 unit on an SMP mesh.

    Args:
        fsdp_module: The unit just constructed (its children were adapted when they were built).
        frozen: ``frozen_parameters`` of the module it wraps, read before it was built.
    """
    extension = fsdp1_compat.fsdp_extension(fsdp_module)
    if isinstance(extension, DTensorExtensions) and not isinstance(extension, SMPFSDPExtensions):
        ours = SMPFSDPExtensions(extension.device_handle)
        ours.compute_stream = extension.compute_stream
        fsdp1_compat.set_fsdp_extension(fsdp_module, ours)
        unit_handle = fsdp1_compat.handle(fsdp_module)
        if unit_handle is not None:
            fsdp1_compat.set_fsdp_extension(unit_handle, ours)
    if not _flattens_dtensors(fsdp_module):
        if any(isinstance(p, DTensor) for p in fsdp_module.module.parameters()):
            fsdp1_state_dict.attach(fsdp_module)  # DTensors FSDP leaves alone (ignored modules)
        return
    fsdp1_state_dict.attach(fsdp_module)
    fsdp1_tied.attach(fsdp_module)
    handle = fsdp1_compat.handle(fsdp_module)
    assert handle is not None  # _flattens_dtensors found its flat parameter
    if fsdp1_compat.uses_orig_params(handle):
        _keep_frozen(handle, frozen)  # Note [Frozen DTensor parameters under FSDP1]
        _unsharded_gradients_as_local_tensors(handle)
    if (
        fsdp_module.sharding_strategy is ShardingStrategy.NO_SHARD
        and fsdp1_compat.uses_orig_params(handle)
        and fsdp1_compat.original_params(handle.flat_param) is not None
    ):
        _register_local_parameters(handle)


def _flattens_dtensors(fsdp_module: FullyShardedDataParallel) -> bool:
    """Whether the unit's flat parameter holds tensor-parallel (DTensor) parameters."""
    handle = fsdp1_compat.handle(fsdp_module)
    return handle is not None and any(
        spec is not None for spec in fsdp1_compat.param_extensions(handle.flat_param)
    )


__all__ = ["SMPFSDPExtensions", "adapt", "frozen_parameters"]
