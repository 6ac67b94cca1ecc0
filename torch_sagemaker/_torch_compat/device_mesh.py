"""Private ``DeviceMesh`` methods: ``_concatenate``, ``_unflatten`` and ``_flatten``.

Checked on torch 2.11, 2.13, 2.15.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh


def concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes``, all slices of the same root mesh."""
    return DeviceMesh._concatenate(list(meshes))


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s axes flattened into one axis called ``name``, registered on the root."""
    return mesh._flatten(name)


def unflatten(
    mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh:
    """``mesh`` with axis ``dim`` split into axes ``names`` of ``sizes``.

    The axis is passed by index: torch 2.11's ``_unflatten`` refuses every axis given by
    name (its check is inverted), and every supported release takes an index.
    """
    names_of_mesh = mesh.mesh_dim_names or ()
    if dim not in names_of_mesh:
        raise ValueError(f"mesh has no axis {dim!r}; its axes are {names_of_mesh}")
    return mesh._unflatten(names_of_mesh.index(dim), sizes, names)
