"""The process-wide SMP state behind ``tsm.state``.

``State`` holds what ``tsm.init`` resolved: the validated config, the ``Layout``, the
``ShardingPlan``, the one DeviceMesh and the process groups built from it. Everything else
in the package receives the mesh or a group as an argument; only user-facing entry points
read ``tsm.state``.

Before ``tsm.init()`` the config attributes can be assigned (SMP's example scripts do
``tsm.state.tensor_parallel_degree = 1`` to force native mode): the value is recorded as
an override that wins over the other config sources. After ``init`` the state is
read-only. ``reset()`` returns to the pristine state (for tests) and destroys every group
the library created: those ``init`` built and those adopted later (``adopt_group``: the
gloo groups of background checkpoint saves).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from torch_sagemaker.config import FIELD_NAMES, SMPConfig
from torch_sagemaker.launch_syntax import MAX_COUNT
from torch_sagemaker.logger import log_rank0
from torch_sagemaker.sharding_plan import HYBRID_STRATEGIES, MESHES, ShardingPlan
from torch_sagemaker.topology import Layout

# SMP's short aliases, mapped to the config keys they stand for.
_ALIASES = {
    "tp_size": "tensor_parallel_degree",
    "cp_size": "context_parallel_degree",
    "ep_size": "expert_parallel_degree",
}


def _launcher_int(name: str, text: str | None, default: int, minimum: int = 0) -> int:
    """The integer ``text`` (at least ``minimum``) of the launcher's ``name``, else ``default``."""
    if text is None:
        return default
    digits = text.strip()
    # The rule launch_env applies to the launcher's counts: ASCII digits, at most 2**31 - 1.
    # int() alone also took "1_000", "+4" and other scripts' digits.
    ok = digits.isascii() and digits.isdigit() and len(digits) <= 10
    value = int(digits) if ok else minimum - 1
    if not minimum <= value <= MAX_COUNT:
        what = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(
            f"{name}={text[:40]!r}: the launcher's {name} must be {what} "
            f"integer of at most 2**31 - 1; unset it or launch with torchrun, which sets it."
        )
    return value


def ranks_per_host(world_size: int) -> int:
    """Ranks on this host: the launcher's ``LOCAL_WORLD_SIZE``, else ``world_size`` (one host).

    ``tsm.init`` reads it once into ``ShardingPlan.ranks_per_host``, the one definition of a
    host on the Python side (docs/architecture.md, "Hosts and devices").
    """
    return _launcher_int(
        "LOCAL_WORLD_SIZE",
        os.environ.get("LOCAL_WORLD_SIZE"),  # noqa: TID251
        world_size,
        minimum=1,
    )


def _clear_dtensor_caches() -> None:
    """Empties DTensor's caches that hold device meshes, and through them process groups.

    DTensor caches sharding results keyed by DeviceMesh, whose equality ignores the process
    groups: a new mesh over the same ranks would otherwise reuse cached specs that point at
    destroyed groups. The redistribute planners and the transform and mesh-topology caches
    also keep meshes, so destroyed groups (and their threads) would live on.
    """
    from torch_sagemaker._torch_compat import dtensor as dtensor_compat

    dtensor_compat.clear_caches()


@dataclass
class _Groups:
    """Process groups and meshes built by ``torch_sagemaker.mesh``."""

    device_mesh: Any
    fsdp_mesh: Any
    fsdp_shard_mesh: Any
    dp_mesh: Any
    tp: Any
    cp: Any
    ep: Any
    world: Any
    replica: Any  # one whole replica: every rank with this rank's dp_replicate coordinate
    fsdp_shard: Any
    fsdp_replicate: Any
    dp: Any
    ep_mesh: Any = None
    expert_fsdp_mesh: Any = None
    replicate_mesh: Any = None
    expert_replicate_mesh: Any = None
    owned: list[Any] = field(default_factory=list)


class Ranker:
    """Replication-rank helpers with SMP's names (``tsm.state.ranker``).

    A replication group is the set of ranks that hold exactly the same shard of every
    parameter; SMP's scripts save a checkpoint from replication rank 0 only (the "action"
    ranks) and group SM-local saves by replication group. With expert parallelism the
    replicas of the ``dp_replicate`` axis hold different experts, so only those with the
    same EP rank replicate each other: the groups are the ``dp_replicate`` groups split by
    EP rank, and the replication rank counts within them. Without EP both are the
    ``dp_replicate`` axis.
    """

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    def get_rep_rank(self, global_rank: int | None = None) -> int:
        """SMP's replication rank of ``global_rank`` (default: this rank); 0 for "action" ranks.

        The ``dp_replicate`` coordinate (``tsm.state.rep_rank``) divided by ``ep``: the index
        among the replicas that hold the same experts.
        """
        rank = dist.get_rank() if global_rank is None else global_rank
        return self._layout.rep_rank(rank) // self._layout.ep

    def get_rep_groups(self) -> list[list[int]]:
        """Rank lists of the replication groups (ranks holding the same shard in each replica)."""
        ep = self._layout.ep
        return sorted(
            group[first::ep] for group in self._layout.groups("dp_replicate") for first in range(ep)
        )


class State:
    """SMP state: ranks, degrees, the mesh and the groups (``tsm.state``)."""

    # Written with object.__setattr__ (this class's __setattr__ takes config overrides only);
    # _config, _plan and _groups are set together by _set and are None before tsm.init.
    _overrides: dict[str, Any]
    _config: SMPConfig | None
    _plan: ShardingPlan | None
    _groups: _Groups | None
    # hybrid_shard_degree=0 on several hosts with TP 1 (Note [Degree 0 with a hybrid strategy]
    # in sharding_plan.py): the other candidate (plan, groups), and whether the first FSDP1
    # root settled on a hybrid strategy (None: not settled yet).
    _other: tuple[ShardingPlan, _Groups] | None
    _settled_hybrid: bool | None
    _adopted: list[Any]  # groups created after init on the library's behalf (adopt_group)
    _rng_tracker: Any  # a tensor_parallel.random.RNGStatesTracker, made on first use

    def __init__(self) -> None:
        object.__setattr__(self, "_overrides", {})
        object.__setattr__(self, "_adopted", [])
        self._clear()

    def _clear(self) -> None:
        object.__setattr__(self, "_config", None)
        object.__setattr__(self, "_plan", None)
        object.__setattr__(self, "_groups", None)
        object.__setattr__(self, "_other", None)
        object.__setattr__(self, "_settled_hybrid", None)
        object.__setattr__(self, "_rng_tracker", None)

    # ----------------------------------------------------------- life cycle
    def _set(
        self,
        config: SMPConfig,
        plan: ShardingPlan,
        groups: _Groups,
        host: tuple[ShardingPlan, _Groups] | None = None,
    ) -> None:
        """Publishes what ``tsm.init`` resolved; ``host``: ``plan.host_plan`` and its groups."""
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_groups", groups)
        object.__setattr__(self, "_other", host)

    def settle_degree_zero(self, strategy: Any, *, keep_settled: bool = False) -> None:
        """Settles ``hybrid_shard_degree=0`` for an FSDP1 root wrapped with ``strategy``.

        Called by the FSDP1 patch for every root that follows the config, before it reads
        the plan. With degree 0 and TP 1 on several hosts, the first such root decides what
        the state describes (Note [Degree 0 with a hybrid strategy] in ``sharding_plan.py``):
        a hybrid strategy switches the layout, the plan and the groups to one host per shard
        group; any other strategy keeps every rank in one shard group. Elsewhere it does
        nothing.

        Args:
            strategy: The FSDP1 ``ShardingStrategy`` (``None``: FULL_SHARD, FSDP1's default).
            keep_settled: Keep an earlier settlement instead of raising (FSDP2's mesh, which
                follows whichever layout the state describes).

        Raises:
            ValueError: A later root asks for a hybrid strategy where an earlier one did not,
                or the other way round: the state cannot describe both.
        """
        if self._other is None:
            return
        hybrid = strategy in HYBRID_STRATEGIES
        settled = self._settled_hybrid
        if settled is not None and keep_settled:
            return
        if settled is None:
            if hybrid:
                # The candidate this rank does not use stays in _other, for reset() to destroy.
                assert self._plan is not None and self._groups is not None
                other = (self._plan, self._groups)
                plan, groups = self._other
                object.__setattr__(self, "_plan", plan)
                object.__setattr__(self, "_groups", groups)
                object.__setattr__(self, "_other", other)
                # tsm.init's layout line described the other candidate.
                log_rank0(
                    f"hybrid_shard_degree=0 with FSDP {getattr(strategy, 'name', strategy)}: "
                    f"shard groups of one host ({plan.layout.hybrid_shard_degree} ranks), "
                    f"{plan.layout.dp_replicate} replicas across hosts; tsm.state follows."
                )
            object.__setattr__(self, "_settled_hybrid", hybrid)
        elif settled != hybrid:
            name = getattr(strategy, "name", "FULL_SHARD")
            raise ValueError(
                f"FSDP(sharding_strategy={name}) with hybrid_shard_degree=0 on "
                f"{self.world_size // self.local_world_size} hosts: an earlier FSDP root "
                f"{'used a hybrid strategy' if settled else 'did not use a hybrid strategy'}, "
                f"so tsm.state describes {self.hybrid_shard_degree}-rank shard groups and "
                "cannot describe this one's too. Use the same kind of strategy for every "
                "model that follows the SMP config, set hybrid_shard_degree explicitly (the "
                "ranks of one host for HYBRID_SHARD, the world size for FULL_SHARD), or give "
                "the other model its own process_group or device_mesh."
            )

    def adopt_group(self, group: Any) -> None:
        """Records a process group the library created, so that ``reset()`` destroys it.

        For groups made after ``tsm.init`` (or without it), such as the gloo groups of
        background checkpoint saves; ``init``'s own groups are listed in ``_Groups.owned``.
        """
        self._adopted.append(group)

    @property
    def initialized(self) -> bool:
        """Whether ``tsm.init`` has completed."""
        return self._config is not None

    @property
    def overrides(self) -> dict[str, Any]:
        """Config values assigned on ``tsm.state`` before ``init`` (a copy)."""
        return dict(self._overrides)

    def reset(self) -> None:
        """Forgets config, overrides, layout and plan; destroys every group the library made.

        That is every group ``init`` built (``_Groups.owned``) and every group adopted since
        (``adopt_group``). The default group is the caller's and stays.
        """
        groups = self._groups
        owned = [*(groups.owned if groups is not None else []), *self._adopted]
        if self._other is not None:
            owned += [g for g in self._other[1].owned if g not in owned]
        if owned and dist.is_initialized():
            for group in owned:
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):
                    pass  # already destroyed (with the default group, or by the caller)
        if groups is not None:
            # Also after dist.destroy_process_group(), which leaves these caches alone.
            _clear_dtensor_caches()
        object.__setattr__(self, "_overrides", {})
        object.__setattr__(self, "_adopted", [])
        self._clear()

    def __setattr__(self, name: str, value: Any) -> None:
        key = _ALIASES.get(name, name)
        if self.initialized:
            raise AttributeError(
                f"tsm.state.{name} cannot be changed after tsm.init(); set it in the SMP config "
                "(dict, JSON file or SM_HP_MP_PARAMETERS) or before tsm.init()."
            )
        if key not in FIELD_NAMES:
            raise AttributeError(
                f"tsm.state.{name} is not a config parameter; before tsm.init() only "
                f"{', '.join(FIELD_NAMES)} (and tp_size, cp_size, ep_size) can be assigned."
            )
        self._overrides[key] = value

    # --------------------------------------------------------------- helpers
    def _require(self, what: str) -> None:
        if not self.initialized:
            raise RuntimeError(f"tsm.state.{what} is only available after torch.sagemaker.init().")

    def _config_value(self, key: str) -> Any:
        if self._config is not None:
            return getattr(self._config, key)
        if key in self._overrides:
            return self._overrides[key]
        return getattr(SMPConfig(), key)

    @property
    def config(self) -> SMPConfig:
        """The validated configuration."""
        self._require("config")
        assert self._config is not None  # _require raised otherwise
        return self._config

    @property
    def layout(self) -> Layout:
        """The resolved rank layout."""
        return self.sharding_plan.layout

    @property
    def sharding_plan(self) -> ShardingPlan:
        """Strategy and mesh of every kind of parameter under FSDP1 and FSDP2."""
        self._require("sharding_plan")
        assert self._plan is not None  # _require raised otherwise (set with _config)
        return self._plan

    # ----------------------------------------------------------------- ranks
    @property
    def rank(self) -> int:
        """Global rank."""
        self._require("rank")
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        self._require("world_size")
        return self.layout.world_size

    @property
    def local_rank(self) -> int:
        """Rank within the host (``LOCAL_RANK`` from the launcher, else rank % local size)."""
        self._require("local_rank")
        return _launcher_int(
            "LOCAL_RANK",
            os.environ.get("LOCAL_RANK"),  # noqa: TID251
            self.rank % self.local_world_size,
        )

    @property
    def local_world_size(self) -> int:
        """Ranks on this host (``LOCAL_WORLD_SIZE`` from the launcher, else the world size).

        Read once by ``tsm.init``: ``ShardingPlan.ranks_per_host``.
        """
        return self.sharding_plan.ranks_per_host

    # --------------------------------------------------------------- degrees
    @property
    def hybrid_shard_degree(self) -> int:
        """Resolved FSDP shard-group size (after init), else the configured value.

        With ``hybrid_shard_degree=0``: ``world / (tp * ep)``, or one host's ranks once an
        FSDP1 root with TP 1 on several hosts asked for a hybrid strategy
        (``settle_degree_zero``).
        """
        if self._plan is not None:
            return self._plan.layout.hybrid_shard_degree
        return self._config_value("hybrid_shard_degree")

    @property
    def tensor_parallel_degree(self) -> int:
        """Tensor parallel degree (alias ``tp_size``)."""
        return self._config_value("tensor_parallel_degree")

    @property
    def context_parallel_degree(self) -> int:
        """Context parallel degree (alias ``cp_size``)."""
        return self._config_value("context_parallel_degree")

    @property
    def expert_parallel_degree(self) -> int:
        """Expert parallel degree (alias ``ep_size``)."""
        return self._config_value("expert_parallel_degree")

    # SMP's short spellings of the degrees (read-only aliases).
    @property
    def tp_size(self) -> int:
        """Alias of ``tensor_parallel_degree``."""
        return self.tensor_parallel_degree

    @property
    def cp_size(self) -> int:
        """Alias of ``context_parallel_degree``."""
        return self.context_parallel_degree

    @property
    def ep_size(self) -> int:
        """Alias of ``expert_parallel_degree``."""
        return self.expert_parallel_degree

    @property
    def sm_activation_offloading(self) -> bool:
        """Whether ``offload_wrapper`` uses the prefetching offloader."""
        return self._config_value("sm_activation_offloading")

    @property
    def activation_loading_horizon(self) -> int:
        """Prefetch depth of activation offloading, in layers."""
        return self._config_value("activation_loading_horizon")

    @property
    def fsdp_cache_flush_warnings(self) -> bool:
        """Whether CUDA allocator cache flushes are reported."""
        return self._config_value("fsdp_cache_flush_warnings")

    @property
    def allow_empty_shards(self) -> bool:
        """Whether empty FSDP shards are allowed."""
        return self._config_value("allow_empty_shards")

    @property
    def random_seed(self) -> int:
        """Seed of the random streams inside tensor parallel regions."""
        return self._config_value("random_seed")

    @property
    def tp_rank(self) -> int:
        """Rank inside the tensor parallel group."""
        self._require("tp_rank")
        return self.layout.coordinates(self.rank)["tp"]

    @property
    def cp_rank(self) -> int:
        """Rank inside the context parallel group."""
        self._require("cp_rank")
        return self.layout.coordinates(self.rank)["cp"]

    @property
    def ep_rank(self) -> int:
        """Rank inside the expert parallel group."""
        self._require("ep_rank")
        return self.layout.ep_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """Data-parallel size for the data loader: world / (tp * cp)."""
        self._require("dp_size")
        return self.layout.dp_size

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank for the data loader: rank // (tp * cp)."""
        self._require("dp_rank")
        return self.layout.dp_rank(self.rank)

    @property
    def rep_rank(self) -> int:
        """This rank's replica: its ``dp_replicate`` coordinate (``Layout.rep_rank``).

        Not SMP's replication rank with expert parallelism: ``ranker.get_rep_rank()`` is this
        divided by ``ep`` (the replicas with the same experts are counted there).
        """
        self._require("rep_rank")
        return self.layout.rep_rank(self.rank)

    @property
    def ranker(self) -> Ranker:
        """SMP's ranker helper (``get_rep_rank``, ``get_rep_groups``)."""
        self._require("ranker")
        return Ranker(self.layout)

    # ---------------------------------------------------------- mesh, groups
    def _group(self, name: str) -> Any:
        self._require(name)
        return self._groups

    def mesh(self, name: str) -> Any:
        """The DeviceMesh a ``ShardingPlan`` names (a key of ``sharding_plan.MESHES``).

        Raises:
            ValueError: If ``name`` names no mesh, or one this layout's plan did not need.
        """
        found = getattr(self._group(f"mesh({name!r})"), name, None)
        if name not in MESHES or found is None:
            raise ValueError(
                f"tsm.state.mesh({name!r}): no such mesh in this layout; the plan's meshes are "
                f"{self.sharding_plan.meshes}."
            )
        return found

    @property
    def device_mesh(self) -> Any:
        """The one DeviceMesh, axes ``("dp_replicate", "dp_shard", "cp", "tp")``."""
        return self._group("device_mesh").device_mesh

    @property
    def fsdp_mesh(self) -> Any:
        """2-D mesh ``("dp_replicate", "dp_shard_cp")`` to pass to FSDP (HSDP when replicas > 1)."""
        return self._group("fsdp_mesh").fsdp_mesh

    @property
    def fsdp_shard_mesh(self) -> Any:
        """1-D mesh ``("dp_shard_cp",)`` of the FSDP shard group."""
        return self._group("fsdp_shard_mesh").fsdp_shard_mesh

    @property
    def dp_mesh(self) -> Any:
        """1-D mesh over the data-parallel ranks (``"dp"`` = replicate x shard)."""
        return self._group("dp_mesh").dp_mesh

    @property
    def device_type(self) -> str:
        """``"cuda"`` or ``"cpu"``: the device of the mesh, its collectives and TP's tensors.

        Decided once, by ``tsm.init`` (``mesh.mesh_device_type``); the one rule
        for "which device" after init (docs/architecture.md, "Hosts and devices").
        """
        return self.device_mesh.device_type

    @property
    def tp_mesh(self) -> Any:
        """1-D mesh of the tensor parallel axis."""
        return self.device_mesh["tp"]

    @property
    def ep_mesh(self) -> Any:
        """1-D mesh of the expert parallel axis (``ep`` consecutive replicas)."""
        return self._group("ep_mesh").ep_mesh

    @property
    def expert_fsdp_mesh(self) -> Any:
        """2-D mesh ``("edp_replicate", "dp_shard_cp")`` over which expert parameters are sharded.

        Its ranks hold the same experts: the shard group, and the replicas with this rank's
        expert parallel rank.
        """
        return self._group("expert_fsdp_mesh").expert_fsdp_mesh

    @property
    def tp_process_group(self) -> Any:
        """Ranks that differ only in tensor parallel rank."""
        return self._group("tp_process_group").tp

    @property
    def cp_process_group(self) -> Any:
        """Ranks that differ only in context parallel rank."""
        return self._group("cp_process_group").cp

    @property
    def ep_process_group(self) -> Any:
        """Expert parallel group of this rank."""
        return self._group("ep_process_group").ep

    @property
    def world_process_group(self) -> Any:
        """All ranks (the default group)."""
        return self._group("world_process_group").world

    @property
    def rep_rank_process_group(self) -> Any:
        """Every rank with this rank's ``dp_replicate`` coordinate: one replica (SMP's name)."""
        return self._group("rep_rank_process_group").replica

    @property
    def fsdp_shard_process_group(self) -> Any:
        """The FSDP shard group (``dp_shard`` x ``cp``), size ``hybrid_shard_degree``."""
        return self._group("fsdp_shard_process_group").fsdp_shard

    @property
    def fsdp_replicate_process_group(self) -> Any:
        """The FSDP replicate group (``dp_replicate``), i.e. this rank's rep group."""
        return self._group("fsdp_replicate_process_group").fsdp_replicate

    @property
    def dp_process_group(self) -> Any:
        """All data-parallel peers of this rank (replicate x shard, same cp/tp coordinates)."""
        return self._group("dp_process_group").dp

    def get_rng_state_tracker(self) -> Any:
        """The RNG tracker of tensor parallel regions (see ``tensor_parallel.random``)."""
        self._require("get_rng_state_tracker")
        if self._rng_tracker is None:
            # Function-local: state sits below every feature package, and importing
            # tensor_parallel runs its __init__ (plan, styles, policies, DTensor).
            from torch_sagemaker.tensor_parallel.random import RNGStatesTracker

            object.__setattr__(self, "_rng_tracker", RNGStatesTracker.for_state(self))
        return self._rng_tracker

    def __repr__(self) -> str:
        if not self.initialized:
            return f"<tsm.state: not initialized, overrides={self._overrides}>"
        return f"<tsm.state: rank {self.rank}/{self.world_size}, {self.layout.axis_sizes}>"


state = State()
