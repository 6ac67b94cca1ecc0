"""Distributed checkpoints of DTensors split block by block (``_StridedShard``).

Note [Packed shards in checkpoints]: a packed projection's weight (GPT-2's ``c_attn``, Note
[Packed projections] in ``tensor_parallel/projection_styles.py``) is a DTensor with
``_StridedShard(dim, split_factor=blocks)`` on the TP mesh dimension: rank ``r`` holds one
piece of every block along ``dim``. PyTorch's distributed checkpoint (DCP, torch 2.13)
describes a DTensor's local tensor as one contiguous chunk, at the offset the placements
give a contiguous shard: two TP ranks' "chunks" then overlap and the save fails ("key ...
has overlapping chunks"). transformers works around it by redistributing to contiguous
shards before saving; that costs an all-to-all of every such tensor at each save and at
each load, and every path into DCP must remember it (sync and async saves, loads, the
``Stateful`` objects DCP resolves itself).

Instead, DTensor's three checkpoint hooks describe such a tensor as what it is, one chunk
per block: ``__create_write_items__`` and ``__create_chunk_list__`` list ``blocks`` chunks
at their global offsets, and ``__get_tensor_shard__`` returns the view of the local tensor
holding the requested one (DCP writes from it and loads into it in place). The checkpoint
then holds the tensor in its global layout, so it loads under any other layout (no TP, or
another TP degree) and a model split block by block loads any checkpoint of the same
tensor. Only the layout the styles make is taken over: one ``_StridedShard`` whose
dimension no other mesh dimension splits (FSDP2 shards another one, Note [Packed
projections]); any other DTensor goes to PyTorch's hooks unchanged. ``install`` runs with
the package's other DCP patches (``dcp_patches``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

from torch_sagemaker._torch_compat.dtensor import StridedShard, local_shape_and_offset

_NATIVE = {
    name: getattr(getattr(DTensor, name), "__tsm_native__", getattr(DTensor, name))
    for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")
}


def _block_chunks(tensor: DTensor) -> list[tuple[ChunkStorageMetadata, int, int, int]] | None:
    """This rank's chunks of a tensor split block by block, or ``None`` for other DTensors.

    Returns:
        Per block: the chunk (global offsets and sizes), the dimension, and where the
        block's piece starts in the local tensor and how long it is along that dimension.
    """
    placements = tensor.placements
    strided = [i for i, p in enumerate(placements) if isinstance(p, StridedShard)]
    if len(strided) != 1:
        return None
    # PyTorch's hooks refuse partial sums and hand a tensor subclass (a quantized or float8
    # local tensor) to that subclass's own hooks: such tensors stay theirs.
    if any(p.is_partial() for p in placements) or type(tensor.to_local()) is not torch.Tensor:
        return None
    axis = strided[0]
    placement = placements[axis]
    assert isinstance(placement, StridedShard)
    dim, blocks = placement.dim, int(placement.split_factor)
    if any(isinstance(p, Shard) and p.dim == dim for i, p in enumerate(placements) if i != axis):
        return None  # another split of the same dimension (FSDP2's own layouts): PyTorch's
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or int(tensor.shape[dim]) % (blocks * mesh.size(axis)):
        return None
    contiguous = [Shard(dim) if i == axis else p for i, p in enumerate(placements)]
    sizes, offsets = local_shape_and_offset(tensor.shape, mesh, contiguous)
    piece = sizes[dim] // blocks
    chunks = []
    for block in range(blocks):
        start = list(offsets)
        start[dim] = block * (tensor.shape[dim] // blocks) + coordinate[axis] * piece
        size = list(sizes)
        size[dim] = piece
        chunk = ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(size))
        chunks.append((chunk, dim, block * piece, piece))
    return chunks


def _create_write_items(self: DTensor, fqn: str, object: Any) -> list[WriteItem]:
    chunks = _block_chunks(self)
    if chunks is None:
        return _NATIVE["__create_write_items__"](self, fqn, object)
    properties = TensorProperties.create_from_tensor(self.to_local())
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()),
        )
        for chunk, *_ in chunks
    ]


def _create_chunk_list(self: DTensor) -> list[ChunkStorageMetadata]:
    chunks = _block_chunks(self)
    if chunks is None:
        return _NATIVE["__create_chunk_list__"](self)
    return [chunk for chunk, *_ in chunks]


def _get_tensor_shard(self: DTensor, index: MetadataIndex) -> torch.Tensor:
    chunks = _block_chunks(self)
    if chunks is None:
        return _NATIVE["__get_tensor_shard__"](self, index)
    for chunk, dim, start, length in chunks:
        if index.offset == chunk.offsets:
            return self.to_local().narrow(dim, start, length)
    raise ValueError(
        f"{index.fqn}: no chunk of this rank's blocks starts at {tuple(index.offset or ())} "
        f"(its chunks start at {[tuple(c.offsets) for c, *_ in chunks]})."
    )


_PATCHES = {
    "__create_write_items__": _create_write_items,
    "__create_chunk_list__": _create_chunk_list,
    "__get_tensor_shard__": _get_tensor_shard,
}
for _name, _patch in _PATCHES.items():
    _patch.__tsm_native__ = _NATIVE[_name]  # type: ignore[attr-defined]


def install() -> None:
    """Makes DTensor's checkpoint hooks describe block-by-block splits (idempotent)."""
    for name, patch in _PATCHES.items():
        setattr(DTensor, name, patch)


def uninstall() -> None:
    """Restores PyTorch's hooks."""
    for name, native in _NATIVE.items():
        setattr(DTensor, name, native)


__all__ = ["install", "uninstall"]
