"""Builds the one named DeviceMesh and the process groups of a ``Layout``.

All groups come from one ``init_device_mesh`` call over the axes of
``torch_sagemaker.topology.AXES`` plus flattened views of it, so every group here is the
same object PyTorch's FSDP2 and DTensor see when they are handed ``tsm.state``'s meshes.
Expert parallelism splits the replicate axis: ``_unflatten`` turns ``dp_replicate`` into
(``edp_replicate``, ``ep``) on the same root mesh, so an expert DTensor on the ``ep`` axis and
an FSDP mesh over (``edp_replicate``, ``dp_shard_cp``) can be concatenated by FSDP2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker._torch_compat import device_mesh as mesh_compat
from torch_sagemaker.sharding_plan import ShardingPlan
from torch_sagemaker.state import _Groups
from torch_sagemaker.topology import AXES


def mesh_device_type() -> str:
    """Device type of the mesh: ``cuda`` when the default group can talk CUDA, else ``cpu``."""
    if torch.cuda.is_available() and "cuda" in str(dist.get_backend_config()):
        return "cuda"
    return "cpu"


def build_groups(plan: ShardingPlan) -> _Groups:
    """Creates the DeviceMesh and every SMP process group of ``plan`` (collective call).

    Every group the library uses for training is made here, up front, and listed in
    ``_Groups.owned`` so that ``tsm.state.reset()`` can destroy it; none is created later on
    demand (``tsm.init`` calls this for ``plan.host_plan`` too, when there is one).

    Args:
        plan: The sharding plan; ``plan.layout.world_size`` must equal the default group's size.

    Returns:
        The meshes and groups that ``tsm.state`` exposes.
    """
    layout = plan.layout
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"layout is for {layout.world_size} ranks but the default process group has "
            f"{dist.get_world_size()}."
        )
    mesh = init_device_mesh(mesh_device_type(), layout.mesh_shape, mesh_dim_names=AXES)
    shard_cp = mesh_compat.flatten(mesh["dp_shard", "cp"], "dp_shard_cp")
    replica = mesh_compat.flatten(mesh["dp_shard", "cp", "tp"], "replica")
    dp = mesh_compat.flatten(mesh["dp_replicate", "dp_shard"], "dp")
    # The 2-D (replicate, shard) mesh FSDP takes: concatenated from the root mesh's axis and
    # the flattened shard axis, so its groups are the ones created above (slicing a flattened
    # axis back out of the root mesh is deprecated in PyTorch).
    fsdp_mesh = mesh_compat.concatenate([mesh["dp_replicate"], shard_cp])
    # ``ep`` consecutive replicas form one EP group (topology.Layout.ep_groups): the replicate
    # coordinate is edp_replicate * ep + ep_rank.
    experts = mesh_compat.unflatten(
        mesh, "dp_replicate", (layout.edp_replicate, layout.ep), ("edp_replicate", "ep")
    )
    ep_mesh, edp_mesh = experts["ep"], experts["edp_replicate"]
    # Expert parameters are sharded like the others inside a shard group and replicated over
    # the replicas that hold the same experts.
    expert_fsdp_mesh = mesh_compat.concatenate([edp_mesh, shard_cp])
    owned = [g for g in mesh.get_all_groups()] + [
        shard_cp.get_group(),
        replica.get_group(),
        dp.get_group(),
        ep_mesh.get_group(),
        edp_mesh.get_group(),
    ]
    world = dist.group.WORLD
    owned = [g for g in dict.fromkeys(owned) if g is not world]
    _give_the_default_timeout(owned)
    return _Groups(
        device_mesh=mesh,
        fsdp_mesh=fsdp_mesh,
        fsdp_shard_mesh=shard_cp,
        dp_mesh=dp,
        tp=mesh.get_group("tp"),
        cp=mesh.get_group("cp"),
        ep=ep_mesh.get_group(),
        ep_mesh=ep_mesh,
        expert_fsdp_mesh=expert_fsdp_mesh,
        world=world,
        replica=replica.get_group(),
        fsdp_shard=shard_cp.get_group(),
        fsdp_replicate=mesh.get_group("dp_replicate"),
        dp=dp.get_group(),
        replicate_mesh=mesh["dp_replicate"],
        expert_replicate_mesh=expert_fsdp_mesh["edp_replicate"],
        owned=owned,
    )


def _give_the_default_timeout(groups: list[dist.ProcessGroup]) -> None:
    """Sets the default group's timeout on ``groups``.

    ``init_device_mesh`` makes its groups with ``new_group``, which gives a group torch's
    default for its backend (30 minutes for gloo and smddp), not the timeout the job gave
    ``init_process_group``: a dead rank failed a TP or replica collective only after 30
    minutes while the world's failed within the job's timeout. torchtitan also sets every
    group of its mesh to one timeout, after its first step and behind a barrier, so that no
    rank's collective in flight sees it change; here the groups are new, with none in
    flight. A backend that reports no timeout, or cannot set one (torch's base class
    raises), keeps its own.
    """
    timeout = c10d_compat.group_timeout(c10d_compat.default_group())
    if timeout is None:
        return
    for group in groups:
        try:
            group.set_timeout(timeout)
        except RuntimeError:  # a backend without setTimeout
            pass


__all__ = ["DeviceMesh", "build_groups", "mesh_device_type"]
