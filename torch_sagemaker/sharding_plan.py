"""Which strategy and which mesh FSDP uses, decided once, as pure data: the ``ShardingPlan``.

``tsm.init`` resolves one ``ShardingPlan`` from the ``Layout`` and the number of ranks per
host and publishes it as ``tsm.state.sharding_plan``. Every FSDP entry point reads it:
the FSDP1 constructor patch (``sharding/fsdp1.py``), ``shard_model`` and ``fsdp2_mesh``
(``sharding/fsdp2.py``) and the expert units (``sharding/experts.py``). No other module
decides a strategy or a mesh. Meshes are named, not held: ``tsm.state.mesh(name)`` turns a
name into the DeviceMesh that ``mesh.py`` built, and ``ShardingPlan.dim_ranks``
gives the ranks of each of its dimensions by arithmetic, so the unit tests check every
layout without processes (tests/unit/test_sharding_plan.py), as for ``topology.Layout``.

FSDP1, by the configured ``hybrid_shard_degree`` and the strategy the script asked for
(default FULL_SHARD); "experts" are the experts modules ``tsm.transform`` split:

- 0, FULL_SHARD / SHARD_GRAD_OP / NO_SHARD: that strategy over every data-parallel rank
  (``fsdp_shard_mesh``; ``dp_mesh`` with expert parallelism). Experts: the same strategy
  over ``fsdp_shard_mesh``, which holds every rank with the same experts here.
- 0, HYBRID_SHARD / _HYBRID_SHARD_ZERO2: that strategy over ``fsdp_mesh``, of the one-host
  layout (``host_plan``) where there is one, else of this layout (see Note [Degree 0 with a
  hybrid strategy]). Experts: FULL_SHARD / SHARD_GRAD_OP over ``fsdp_shard_mesh``.
- 1, any: NO_SHARD over ``replicate_mesh``. Experts: NO_SHARD over ``expert_replicate_mesh``.
- k >= 2, any: HYBRID_SHARD (_HYBRID_SHARD_ZERO2 if asked) over ``fsdp_mesh``. Experts:
  the same over ``expert_fsdp_mesh``, or FULL_SHARD (SHARD_GRAD_OP) over
  ``fsdp_shard_mesh`` when no other replica holds the same experts.

FSDP2 takes a mesh only: ``fsdp_mesh`` (2-D, HSDP) when there are replicas, else
``fsdp_shard_mesh``; with ``hybrid_shard_degree=0`` and expert parallelism ``dp_mesh``, as
FSDP1's FULL_SHARD. Experts: ``expert_fsdp_mesh`` with same-expert replicas, else
``fsdp_shard_mesh``.

Note [Degree 0 with a hybrid strategy]
    SMP's rule for ``hybrid_shard_degree=0`` (docs/config.md): with TP 1 the script's strategy
    decides, FULL_SHARD shards over every rank and HYBRID_SHARD over one host (replicas across
    hosts); with TP > 1 the degree is the largest possible, ``world / (tp * ep)``, whatever the
    strategy. ``tsm.init`` resolves the layout before the script picks its strategy, so for
    TP 1 on several hosts there are two candidate layouts: this one (every rank in one shard
    group) and ``host_plan``'s (``topology.resolve`` with the degree of one host, as if it had
    been configured). ``tsm.init`` builds the groups of both; the first FSDP1 root that
    follows the config settles which one ``tsm.state`` describes (``State.settle_degree_zero``):
    a hybrid strategy switches to ``host_plan``, so FSDP1's shard and replica groups, the
    ranker, ``rep_rank_process_group`` and ``hybrid_shard_degree`` all say one host per shard
    group. ``host_plan`` is ``None`` on one host, with TP > 1 (the largest degree is this
    layout's), with expert parallelism (the EP groups, fixed by ``tsm.transform`` before the
    wrap, differ between the two layouts; the largest degree ``world / ep`` is used) and where
    a host does not hold whole context parallel groups.

Note [Combinations the sharding supports]
    ``combination_problems`` holds the rules between degrees that no single degree breaks:
    expert parallelism with tensor parallelism (not in SMP v2 either), and expert
    parallelism with context parallelism (the EP all-to-all exchanges whole sequences; the
    experts would see one CP rank's slice, and with ``hybrid_shard_degree=0`` FSDP1 and FSDP2
    would not even agree on a mesh). ``config.validate`` reports them with every other problem
    of the config, so ``tsm.init`` refuses such a config before it builds a single group.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from torch.distributed.fsdp import ShardingStrategy

from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat
from torch_sagemaker.topology import Layout

_HYBRID = (ShardingStrategy.HYBRID_SHARD, fsdp1_compat.HYBRID_SHARD_ZERO2)
#: The hybrid strategies (shard within a group, replicate across groups).
HYBRID_STRATEGIES: tuple[ShardingStrategy, ...] = _HYBRID
_ZERO2 = (ShardingStrategy.SHARD_GRAD_OP, fsdp1_compat.HYBRID_SHARD_ZERO2)
#: Every strategy a script may ask FSDP1 for.
STRATEGIES: tuple[ShardingStrategy, ...] = tuple(ShardingStrategy)

#: The meshes the plan names, by their dimensions, outermost first. A dimension's ranks are
#: given by ``ShardingPlan.dim_ranks``; ``mesh.py`` builds the meshes.
MESHES: dict[str, tuple[str, ...]] = {
    "fsdp_mesh": ("dp_replicate", "dp_shard_cp"),
    "fsdp_shard_mesh": ("dp_shard_cp",),
    "dp_mesh": ("dp",),
    "replicate_mesh": ("dp_replicate",),
    "expert_fsdp_mesh": ("edp_replicate", "dp_shard_cp"),
    "expert_replicate_mesh": ("edp_replicate",),
}


def combination_problems(tp: int, cp: int, ep: int) -> list[str]:
    """The degree combinations the sharding does not support.

    See Note [Combinations the sharding supports].

    Args:
        tp: tensor_parallel_degree.
        cp: context_parallel_degree.
        ep: expert_parallel_degree.

    Returns:
        One message per broken rule, naming the values and the fix; empty when none is broken.
    """
    problems = []
    if ep > 1 and tp > 1:
        problems.append(
            f"expert_parallel_degree={ep} with tensor_parallel_degree={tp}: expert parallelism "
            "is not compatible with tensor parallelism (as in SMP v2). Set one of them to 1."
        )
    if ep > 1 and cp > 1:
        problems.append(
            f"expert_parallel_degree={ep} with context_parallel_degree={cp}: expert parallelism "
            "with context parallelism is not implemented. Set one of them to 1."
        )
    return problems


@dataclass(frozen=True)
class Placement:
    """Where FSDP1 puts one kind of parameter.

    Attributes:
        strategy: The ``ShardingStrategy`` FSDP1 gets.
        mesh: The name (a key of ``MESHES``) of the ``tsm.state`` mesh it gets.
    """

    strategy: ShardingStrategy
    mesh: str


def host_shard_size(layout: Layout, ranks_per_host: int) -> int:
    """Shard-group size of one host: the ranks of one host without the TP axis.

    Falls back to every FSDP rank (``world / tp``) when a host's ranks do not tile them in
    whole context parallel groups (a host smaller than a TP group, or ranks split unevenly).
    """
    fsdp_ranks = layout.world_size // layout.tp
    shard = max(1, ranks_per_host // layout.tp)
    if fsdp_ranks % shard or shard % layout.cp:
        return fsdp_ranks
    return shard


@dataclass(frozen=True)
class ShardingPlan:
    """Strategy and mesh of every kind of parameter under FSDP1 and FSDP2 (module docstring).

    Attributes:
        layout: The rank layout.
        ranks_per_host: Ranks on one host (``LOCAL_WORLD_SIZE``); the one definition of a host
            on the Python side (docs/architecture.md, "Hosts and devices").
        host_plan: The plan of the one-host layout that FSDP1's hybrid strategies settle
            ``hybrid_shard_degree=0`` to (Note [Degree 0 with a hybrid strategy]); ``None``
            where they use this layout.
        fsdp1_dense: Placement of dense parameters, by the strategy the script asked.
        fsdp1_experts: Placement of split experts, by the strategy the script asked.
        fsdp2_dense: Mesh name for ``fully_shard`` of dense parameters.
        fsdp2_experts: Mesh name for ``fully_shard`` of split experts.
    """

    layout: Layout
    ranks_per_host: int
    fsdp1_dense: Mapping[ShardingStrategy, Placement]
    fsdp1_experts: Mapping[ShardingStrategy, Placement]
    fsdp2_dense: str
    fsdp2_experts: str
    host_plan: ShardingPlan | None = None

    def fsdp1(self, asked: ShardingStrategy | None, *, experts: bool = False) -> Placement:
        """FSDP1's placement for the strategy a script asked for (``None``: FULL_SHARD)."""
        table = self.fsdp1_experts if experts else self.fsdp1_dense
        return table[asked or ShardingStrategy.FULL_SHARD]

    @property
    def meshes(self) -> list[str]:
        """Every mesh name some placement uses."""
        names = {p.mesh for t in (self.fsdp1_dense, self.fsdp1_experts) for p in t.values()}
        return sorted(names | {self.fsdp2_dense, self.fsdp2_experts})

    @property
    def expert_group_size(self) -> int:
        """Ranks holding one rank's experts (``Layout.expert_dp_groups``)."""
        return self.layout.edp_replicate * self.layout.hybrid_shard_degree

    def fsdp1_expert_problem(self, use_orig_params: bool) -> str | None:
        """Why FSDP1 cannot build the expert units of this plan, or ``None`` when it can.

        See Note [FSDP1 experts on one rank] in ``torch_sagemaker/sharding/experts.py``.
        """
        if (
            self.layout.requested_hybrid_shard_degree == 1
            and self.expert_group_size > 1
            and use_orig_params
        ):
            return (
                f"hybrid_shard_degree=1 (NO_SHARD) with expert_parallel_degree={self.layout.ep} "
                "and use_orig_params=True: PyTorch's FSDP1 cannot keep the expert DTensors in "
                "NO_SHARD units (Note [FSDP1 experts on one rank] in "
                "torch_sagemaker/sharding/experts.py). Use hybrid_shard_degree >= 2 or 0, or "
                "FSDP2 (torch_sagemaker.sharding.shard_model)."
            )
        return None

    # ------------------------------------------------------------ rank arithmetic
    def dim_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along the mesh dimension ``dim`` (see ``MESHES``)."""
        layout = self.layout
        if dim in _LAYOUT_DIMS:
            coords = layout.coordinates(rank)
            axes = _LAYOUT_DIMS[dim]
            sizes = [range(layout.axis_sizes[a]) for a in axes]
            return [
                layout.rank_at({**coords, **dict(zip(axes, values, strict=True))})
                for values in itertools.product(*sizes)
            ]
        if dim == "edp_replicate":
            replicas = self.dim_ranks("dp_replicate", rank)
            return replicas[layout.ep_rank(rank) :: layout.ep]
        raise ValueError(f"unknown mesh dimension {dim!r}; known: {sorted(_DIMS)}.")

    def mesh_ranks(self, mesh: str, rank: int) -> list[list[int]]:
        """The ranks of each dimension of ``rank``'s part of the mesh named ``mesh``."""
        return [self.dim_ranks(dim, rank) for dim in MESHES[mesh]]

    def describe(self) -> str:
        """One line per FSDP1 strategy and the FSDP2 meshes (logged once by ``tsm.init``)."""
        rows = [
            f"  FSDP1 {s.name:<20}: {d.strategy.name} on {d.mesh}; experts "
            f"{e.strategy.name} on {e.mesh}"
            for s in STRATEGIES
            for d, e in [(self.fsdp1_dense[s], self.fsdp1_experts[s])]
        ]
        rows.append(f"  FSDP2: {self.fsdp2_dense}; experts {self.fsdp2_experts}")
        if self.host_plan is not None:
            rows.append(
                "  hybrid_shard_degree=0 with FSDP1 HYBRID_SHARD / _HYBRID_SHARD_ZERO2: one host "
                f"per shard group (degree {self.host_plan.layout.hybrid_shard_degree}, "
                f"{self.host_plan.layout.dp_replicate} replicas); tsm.state follows at the wrap"
            )
        return "\n".join(rows)


_DIMS = {dim for dims in MESHES.values() for dim in dims}
# The dimensions that are axes (or row-major products of axes) of the Layout.
_LAYOUT_DIMS = {
    "dp_replicate": ("dp_replicate",),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


def _fsdp1_dense(layout: Layout, asked: ShardingStrategy) -> Placement:
    requested = layout.requested_hybrid_shard_degree
    if requested == 0:
        if asked in _HYBRID:
            # This layout's shard groups; on several hosts with TP 1 FSDP1 takes host_plan's.
            return Placement(asked, "fsdp_mesh")
        # With expert parallelism the shard group is one of ``ep`` replicas; the other
        # parameters are sharded over every data-parallel rank.
        return Placement(asked, "fsdp_shard_mesh" if layout.dp_replicate == 1 else "dp_mesh")
    if requested == 1:
        return Placement(ShardingStrategy.NO_SHARD, "replicate_mesh")
    if asked is fsdp1_compat.HYBRID_SHARD_ZERO2:
        return Placement(asked, "fsdp_mesh")
    return Placement(ShardingStrategy.HYBRID_SHARD, "fsdp_mesh")


def _fsdp1_experts(layout: Layout, dense: Placement) -> Placement:
    """An experts unit's placement, given the dense units' (the table of the module docstring)."""
    zero2 = dense.strategy in _ZERO2
    if layout.requested_hybrid_shard_degree == 1 or dense.strategy is ShardingStrategy.NO_SHARD:
        # Over every rank holding the same experts: the same-expert replicas when the shard
        # group is one rank, else (hybrid_shard_degree=0, one such replica) the shard group.
        mesh = "expert_replicate_mesh" if layout.hybrid_shard_degree == 1 else "fsdp_shard_mesh"
        return Placement(ShardingStrategy.NO_SHARD, mesh)
    if layout.edp_replicate == 1:
        strategy = ShardingStrategy.SHARD_GRAD_OP if zero2 else ShardingStrategy.FULL_SHARD
        return Placement(strategy, "fsdp_shard_mesh")
    strategy = fsdp1_compat.HYBRID_SHARD_ZERO2 if zero2 else ShardingStrategy.HYBRID_SHARD
    return Placement(strategy, "expert_fsdp_mesh")


def _fsdp2_dense(layout: Layout) -> str:
    if layout.requested_hybrid_shard_degree == 0 and layout.dp_replicate > 1:
        return "dp_mesh"  # expert parallelism (combination_problems keeps cp at 1 here)
    return "fsdp_mesh" if layout.dp_replicate > 1 else "fsdp_shard_mesh"


def resolve(layout: Layout, ranks_per_host: int) -> ShardingPlan:
    """The plan for ``layout`` on hosts of ``ranks_per_host`` ranks.

    Args:
        layout: The resolved layout (``topology.resolve``).
        ranks_per_host: Ranks per host (``LOCAL_WORLD_SIZE``; the world size on one host).

    Returns:
        The plan.

    Raises:
        ValueError: If the layout breaks a rule of ``combination_problems``, which
            ``config.validate`` checks first (a programming error here).
    """
    problems = combination_problems(layout.tp, layout.cp, layout.ep)
    if problems:
        raise ValueError(
            f"{' '.join(problems)} Validate the config with torch_sagemaker.config.validate first."
        )
    dense = {s: _fsdp1_dense(layout, s) for s in STRATEGIES}
    return ShardingPlan(
        layout=layout,
        ranks_per_host=ranks_per_host,
        fsdp1_dense=dense,
        fsdp1_experts={s: _fsdp1_experts(layout, dense[s]) for s in STRATEGIES},
        fsdp2_dense=_fsdp2_dense(layout),
        fsdp2_experts="expert_fsdp_mesh" if layout.edp_replicate > 1 else "fsdp_shard_mesh",
        host_plan=_host_plan(layout, ranks_per_host),
    )


def _host_plan(layout: Layout, ranks_per_host: int) -> ShardingPlan | None:
    """The one-host plan of Note [Degree 0 with a hybrid strategy], or ``None``."""
    if layout.requested_hybrid_shard_degree != 0 or layout.tp > 1 or layout.ep > 1:
        return None
    shard = host_shard_size(layout, ranks_per_host)
    if shard == layout.hybrid_shard_degree:
        return None  # one host, or a host that does not hold whole CP groups
    host = Layout(
        world_size=layout.world_size,
        tp=layout.tp,
        cp=layout.cp,
        ep=layout.ep,
        hybrid_shard_degree=shard,
        requested_hybrid_shard_degree=0,
    )
    return resolve(host, ranks_per_host)


__all__ = [
    "HYBRID_STRATEGIES",
    "MESHES",
    "STRATEGIES",
    "Placement",
    "ShardingPlan",
    "combination_problems",
    "host_shard_size",
    "resolve",
]
