"""Pure rank-layout arithmetic: parallel degrees -> named mesh axes, coordinates and groups.

No torch.distributed calls here; ``torch_sagemaker.mesh`` turns a ``Layout`` into
a DeviceMesh and process groups, and the unit tests check the arithmetic for many
(world size, degrees) combinations without processes.

Ranks are laid out on a 4-D grid, outermost first, with tensor parallelism innermost and
contiguous (so a TP group sits on one host) and context parallelism next:

    rank = ((dp_replicate * dp_shard_size + dp_shard) * cp_size + cp) * tp_size + tp

| axis | size | meaning |
|----------------|----------------------------------------|------------------------------------------------|
| ``dp_replicate`` | world / (tp * hybrid_shard_degree) | FSDP replicas (HSDP outer dim); rep rank |
| ``dp_shard`` | hybrid_shard_degree / cp | data-parallel ranks inside one shard group |
| ``cp`` | context_parallel_degree | sequence split; part of the FSDP shard group |
| ``tp`` | tensor_parallel_degree | tensor parallel, innermost |

Derived groups:
- FSDP shard group = (``dp_shard``, ``cp``) flattened ("dp_shard_cp"), of size hybrid_shard_degree.
- data-parallel rank/size seen by the data loader = (``dp_replicate``, ``dp_shard``):
  ``dp_rank = rank // (tp * cp)``, ``dp_size = world / (tp * cp)`` (as in SMP's scripts).
- replication group of a rank ("rep group") = the ranks holding the same shard in every
  replica = the ``dp_replicate`` axis; a rank's rep rank is its ``dp_replicate`` coordinate.
- expert parallel groups split ``dp_replicate``: ``ep`` consecutive replicas form one EP group
  (``world % (hybrid_shard_degree * tp * ep) == 0`` guarantees that they exist). EP ranks
  are data-parallel ranks with their own batches. The ranks holding the same experts
  ("expert data parallel", ``expert_dp_groups``) are a shard group times the
  ``edp_replicate = dp_replicate / ep`` replicas with the same EP rank; expert parameters are
  FSDP-sharded over the shard group and replicated over those replicas. SMP's Mixtral
  notebooks (ep 2, hybrid_shard_degree 4 on 8 ranks; ep 2, 32 on 64): two replicas, each
  one whole shard group holding half of the experts, and the EP pairs (r, r + 4) or
  (r, r + 32) exchange tokens.

Example, world 8, tp 2, hybrid_shard_degree 2: axes (dp_replicate 2, dp_shard 2, cp 1, tp 2);
tp groups [0,1] [2,3] [4,5] [6,7]; shard groups [0,2] [1,3] [4,6] [5,7]; rep groups [0,4] [1,5] ...
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

AXES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """Resolved sizes of the four mesh axes plus the expert parallel degree.

    Attributes:
        world_size: Number of ranks.
        tp: Tensor parallel degree.
        cp: Context parallel degree.
        ep: Expert parallel degree.
        hybrid_shard_degree: Resolved FSDP shard-group size (includes cp); never 0.
        requested_hybrid_shard_degree: The configured value (0 means "native FSDP").
    """

    world_size: int
    tp: int
    cp: int
    ep: int
    hybrid_shard_degree: int
    requested_hybrid_shard_degree: int

    # ------------------------------------------------------------------ sizes
    @property
    def dp_replicate(self) -> int:
        """Number of FSDP replicas."""
        return self.world_size // (self.tp * self.hybrid_shard_degree)

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks per shard group (the shard group without cp)."""
        return self.hybrid_shard_degree // self.cp

    @property
    def edp_replicate(self) -> int:
        """Replicas holding the same experts: ``dp_replicate / ep``."""
        return self.dp_replicate // self.ep

    @property
    def dp_size(self) -> int:
        """Data-parallel size the data loader uses: world / (tp * cp)."""
        return self.world_size // (self.tp * self.cp)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Sizes of the four named axes, outermost first."""
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Mesh shape in ``AXES`` order."""
        return tuple(self.axis_sizes.values())

    # ------------------------------------------------------------ coordinates
    def coordinates(self, rank: int) -> dict[str, int]:
        """Returns the coordinate of ``rank`` on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size}).")
        coords = {}
        for axis in reversed(AXES):
            size = self.axis_sizes[axis]
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in AXES}

    def rank_at(self, coords: dict[str, int]) -> int:
        """Inverse of ``coordinates``."""
        rank = 0
        for axis in AXES:
            rank = rank * self.axis_sizes[axis] + coords[axis]
        return rank

    def dp_rank(self, rank: int) -> int:
        """Data-parallel rank of ``rank``: rank // (tp * cp)."""
        return rank // (self.tp * self.cp)

    def rep_rank(self, rank: int) -> int:
        """Replica index of ``rank`` (its ``dp_replicate`` coordinate)."""
        return self.coordinates(rank)["dp_replicate"]

    def ep_rank(self, rank: int) -> int:
        """Expert parallel rank of ``rank``."""
        return self.rep_rank(rank) % self.ep

    # ----------------------------------------------------------------- groups
    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Rank lists of the groups spanning ``axes`` (other coordinates fixed).

        Args:
            axes: One axis name or a tuple of names; ranks inside a group are ordered with
                the later axes varying fastest (row-major, like a flattened DeviceMesh).

        Returns:
            Groups sorted by their smallest rank; together they cover every rank once.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; known axes are {AXES}.")
        fixed = [a for a in AXES if a not in axes]
        result = []
        for fixed_coords in itertools.product(*(range(self.axis_sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_coords, strict=True))
            group = []
            for varying in itertools.product(*(range(self.axis_sizes[a]) for a in axes)):
                group.append(self.rank_at({**base, **dict(zip(axes, varying, strict=True))}))
            result.append(group)
        return sorted(result)

    def ep_groups(self) -> list[list[int]]:
        """Expert parallel groups: ``ep`` consecutive replicas, other coordinates fixed."""
        result = []
        for rep_group in self.groups("dp_replicate"):
            for start in range(0, len(rep_group), self.ep):
                result.append(rep_group[start : start + self.ep])
        return sorted(result)

    def expert_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same experts: the shard group times the replicas of one EP rank.

        Expert parameters are FSDP-sharded over the ``dp_shard``/``cp`` ranks of such a group
        and replicated over its replicas; together the groups partition the ranks.
        """
        result = []
        for tp_rank in range(self.tp):
            for ep_rank in range(self.ep):
                replicas = [r for r in range(self.dp_replicate) if r % self.ep == ep_rank]
                group = [
                    self.rank_at({"dp_replicate": rep, "dp_shard": s, "cp": c, "tp": tp_rank})
                    for rep in replicas
                    for s in range(self.dp_shard)
                    for c in range(self.cp)
                ]
                result.append(group)
        return sorted(result)

    def describe(self) -> str:
        """A one-table text summary of the layout (logged once by ``tsm.init``)."""
        rows = [
            ("world_size", self.world_size),
            (
                "hybrid_shard_degree",
                f"{self.hybrid_shard_degree} (requested {self.requested_hybrid_shard_degree})",
            ),
            ("tensor_parallel_degree", self.tp),
            ("context_parallel_degree", self.cp),
            ("expert_parallel_degree", self.ep),
            ("replicas (dp_replicate)", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("data parallel size", self.dp_size),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}} : {v}" for k, v in rows)


def resolve(
    world_size: int,
    *,
    hybrid_shard_degree: int = 0,
    tensor_parallel_degree: int = 1,
    context_parallel_degree: int = 1,
    expert_parallel_degree: int = 1,
) -> Layout:
    """Resolves the degrees into a ``Layout`` (0 for the shard degree means the largest).

    The degrees must already be valid for ``world_size`` (``config.validate`` checks them);
    an invalid combination here is a programming error and raises ``ValueError``.

    Args:
        world_size: Number of ranks.
        hybrid_shard_degree: Configured shard degree; 0 resolves to
            ``world_size // (tp * ep)`` (shard over every data-parallel rank, as FULL_SHARD).
        tensor_parallel_degree: TP degree.
        context_parallel_degree: CP degree.
        expert_parallel_degree: EP degree.

    Returns:
        The resolved layout.
    """
    tp, cp, ep = tensor_parallel_degree, context_parallel_degree, expert_parallel_degree
    resolved = hybrid_shard_degree or world_size // (tp * ep)
    if resolved < 1 or world_size % (resolved * tp * ep) or resolved % cp:
        raise ValueError(
            f"invalid layout: world_size={world_size}, hybrid_shard_degree={hybrid_shard_degree}, "
            f"tp={tp}, cp={cp}, ep={ep}; "
            "validate the config with torch_sagemaker.config.validate first."
        )
    return Layout(
        world_size=world_size,
        tp=tp,
        cp=cp,
        ep=ep,
        hybrid_shard_degree=resolved,
        requested_hybrid_shard_degree=hybrid_shard_degree,
    )
