"""FSDP2 (``fully_shard``) over ``tsm.state``'s mesh, bottom-up by the model's layer class.

FSDP2 needs no patching: pass ``mesh=tsm.state.fsdp_mesh`` (2-D: HSDP; replicate x shard)
to ``fully_shard``. ``shard_model`` does the usual wrapping for a (transformed) Hugging Face
model: every transformer layer first, then the root, so each layer is one all-gather unit.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torch_sagemaker.context_parallel import check_prepared
from torch_sagemaker.logger import log_rank0
from torch_sagemaker.policies import transformer_layer_classes
from torch_sagemaker.sharding import cache_flush
from torch_sagemaker.sharding.experts import fully_shard_experts
from torch_sagemaker.sharding.replica_reduction import ReplicaReduction
from torch_sagemaker.smddp.fsdp2_buffers import runs_on_smddp
from torch_sagemaker.state import state
from torch_sagemaker.utils.hf_config import text_config


def fsdp2_mesh() -> DeviceMesh:
    """The mesh to give ``fully_shard``: the one ``tsm.state.sharding_plan`` names for FSDP2.

    2-D (HSDP) with replicas, else the 1-D shard mesh; with ``hybrid_shard_degree=0`` and
    expert parallelism (whose replicas hold different experts), the 1-D mesh over every
    data-parallel rank, as FSDP1's FULL_SHARD. With ``hybrid_shard_degree=0`` on several hosts
    this settles ``tsm.state`` on every rank in one shard group, as an FSDP1 FULL_SHARD root
    does (``State.settle_degree_zero``), unless an FSDP1 HYBRID_SHARD root came first.
    """
    state.settle_degree_zero(None, keep_settled=True)
    return state.mesh(state.sharding_plan.fsdp2_dense)


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    layer_classes: tuple[type[nn.Module], ...] | None = None,
    comm_buffers_from_backend: bool | None = None,
    overlap_replica_reduction: bool = False,
    reduce_scatter_unused_params: bool | None = None,
    **fully_shard_kwargs: Any,
) -> FSDPModule:
    """Applies ``fully_shard`` to every transformer layer of ``model``, then to the root.

    Args:
        model: A (transformed) Hugging Face model, on a real or meta device.
        mesh: Mesh to shard over; default ``fsdp2_mesh()`` (follows hybrid_shard_degree).
        mp_policy: FSDP2 mixed precision policy.
        reshard_after_forward: Passed to ``fully_shard`` for the layers (the root keeps
            its parameters after forward, as torchtitan does, since backward starts there).
        layer_classes: Classes to wrap; default ``transformer_layer_classes(model)``.
        comm_buffers_from_backend: Let FSDP2 allocate its all-gather and reduce-scatter
            buffers from the process group (``set_allocate_memory_from_process_group_for_comm``).
            On smddp they then live in shared memory and the collectives read them in place
            (zero-copy). Default: on when every group of ``mesh`` is served by smddp.
        overlap_replica_reduction: With a 2-D (replicate x shard) ``mesh``, shard over its
            shard dimension only and average the gradients across replicas while backward
            computes (``ReplicaReduction``, Note [Deferred replica reduction]) instead of
            HSDP's all-reduce inside each unit's post-backward. The output embedding, when
            not tied to the input's, becomes a unit of its own, so its gradients (backward's
            first) cross hosts while the layers compute. The reducer is
            ``model.replica_reduction``. No effect on a 1-D mesh.
        reduce_scatter_unused_params: Reduce zeros for the trainable parameters that got no
            gradient on this rank (FSDP2's ``set_reduce_scatter_unused_params``), so a rank
            whose batch left some unused (a text-only batch of an image-text model) runs
            the same collectives as its peers; they then get gradients (their peers'
            average, or zeros), as under FSDP1. ``False``: FSDP2's own behaviour, where
            they keep ``None`` and every rank must use the same parameters, except under
            ``overlap_replica_reduction``, which sends every unit whole. Default: on for a
            model whose config holds a text config beside others (image-text models), off
            otherwise (Note [Parameters unused on some ranks]).
        **fully_shard_kwargs: Other ``fully_shard`` arguments (e.g. ``offload_policy``).

    Returns:
        The root module, now an ``FSDPModule``.

    Raises:
        ValueError: If no module of ``model`` is a transformer layer, or
            ``context_parallel_degree > 1`` and ``model`` did not go through ``tsm.transform``.
    """
    check_prepared(model, state.cp_size, "shard_model")
    mesh = mesh if mesh is not None else fsdp2_mesh()
    replicas = None
    if overlap_replica_reduction and mesh.ndim == 2:
        if state.ep_size > 1:
            raise ValueError(
                f"overlap_replica_reduction=True with expert_parallel_degree={state.ep_size}: "
                "the experts' replicas are other groups than the dense layers'. Leave "
                "overlap_replica_reduction off for expert parallel models."
            )
        if mesh.mesh_dim_names is None:
            raise ValueError(
                f"overlap_replica_reduction=True needs a mesh with dimension names, got a 2-D "
                f"mesh of shape {tuple(mesh.shape)} without: build it with mesh_dim_names="
                "('dp_replicate', 'dp_shard_cp'), or pass tsm.state.fsdp_mesh."
            )
        replicas = mesh.get_group(0)
        mesh = mesh[mesh.mesh_dim_names[1]]
    classes = layer_classes or transformer_layer_classes(model)
    layers = [m for m in model.modules() if isinstance(m, classes)]
    if not layers:  # only given layer_classes can miss: the default ones come from the model
        raise ValueError(
            f"shard_model found no module of class {[c.__name__ for c in classes]} in "
            f"{type(model).__name__}. Pass the model's own layer_classes=(MyDecoderLayer,), "
            "or leave them out to use its policy's (or _no_split_modules') layer class."
        )
    # Expert parallel models: experts (and fp32 routers) first, as units of their own.
    inner = fully_shard_experts(
        model, mesh, mp_policy, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs
    )
    kwargs = dict(fully_shard_kwargs)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    head = _untied_output_embedding(model) if replicas is not None else None
    if head is not None:
        fully_shard(head, mesh=mesh, reshard_after_forward=False, **kwargs)  # backward starts there
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **kwargs)
    if state.fsdp_cache_flush_warnings:
        cache_flush.watch(model)
    if comm_buffers_from_backend is None:
        comm_buffers_from_backend = _served_by_smddp(mesh)
    # The setting is per FSDP state: the root's call does not reach the layers. On smddp,
    # fully_shard itself already turned it on (Note [Pool buffers for every FSDP2 user]);
    # setting it here either way makes the argument win.
    for module in [*inner, *layers, *([head] if head is not None else []), model]:
        cast(FSDPModule, module).set_allocate_memory_from_process_group_for_comm(
            comm_buffers_from_backend
        )
    if reduce_scatter_unused_params is None:
        reduce_scatter_unused_params = _multimodal(model)
    _reduce_unused(model, reduce_scatter_unused_params)
    if replicas is not None:
        reduce_dtype = mp_policy and (mp_policy.reduce_dtype or mp_policy.param_dtype)
        model.replica_reduction = ReplicaReduction(  # type: ignore[assignment]
            model, replicas, reduce_dtype=reduce_dtype or None
        )
    log_rank0(
        f"FSDP2: sharded {len(layers)} x {classes[0].__name__}"
        f"{' and the output embedding' if head is not None else ''} and the root over mesh "
        f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}"
        f"{'; comm buffers from the backend' if comm_buffers_from_backend else ''}"
        f"{f'; replicas averaged during backward over {replicas.size()}' if replicas else ''}"
    )
    return cast(FSDPModule, model)  # fully_shard made it an instance of an FSDPModule subclass


# Note [Parameters unused on some ranks]: FSDP2 reduce-scatters, in each unit's post-backward,
# only the parameters that got a gradient on this rank. A batch that leaves parameters unused
# on one rank only (a text-only batch of an image-text model skips the vision tower) then
# makes that rank's reduce-scatter smaller than its peers': gloo aborts on the sizes
# ("Received data size doesn't match expected size"), NCCL hangs or sums the wrong bytes.
# FSDP1 reduces its whole flat parameter, zeros included, so SMP's scripts never see this.
# FSDP2 has the remedy, a reduction of zeros for such parameters on every unit (the root's
# call recurses), at a cost: parameters no rank used then get zero gradients rather than
# ``None`` (as under FSDP1), which an optimizer with momentum or weight decay applies where
# one process would skip them (a model trained on ``inputs_embeds`` for a while moves its
# unused input embedding). So ``shard_model`` turns it on by default only where a batch
# decides which parts run: a model whose config holds a text config beside others (an
# image-text model; ``text_config``); any model when asked. Torch versions without the
# setter keep FSDP2's behaviour. ReplicaReduction keeps its calls alike across replicas on
# its own (Note [Deferred replica reduction]).
def _multimodal(model: nn.Module) -> bool:
    return text_config(model) is not getattr(model, "config", None)


def _reduce_unused(model: nn.Module, enabled: bool) -> None:
    setter = getattr(model, "set_reduce_scatter_unused_params", None)
    if setter is not None:
        setter(enabled)
    elif enabled:
        log_rank0(
            "FSDP2 of this torch has no set_reduce_scatter_unused_params: every rank's batch "
            "must use the same parameters (Note [Parameters unused on some ranks])"
        )


def _untied_output_embedding(model: nn.Module) -> nn.Module | None:
    """The output embedding of a Hugging Face model, unless its weight is the input's."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    out = get_out() if callable(get_out) else None
    inp = get_in() if callable(get_in) else None
    if not isinstance(out, nn.Module) or isinstance(out, FSDPModule):
        return None
    if inp is not None and any(p is q for p in out.parameters() for q in inp.parameters()):
        return None
    return out


def _served_by_smddp(mesh: DeviceMesh) -> bool:
    """True when every group of ``mesh`` runs its CPU collectives on smddp."""
    if mesh.device_type != "cpu":
        return False
    return all(runs_on_smddp(mesh.get_group(d)) for d in range(mesh.ndim))
