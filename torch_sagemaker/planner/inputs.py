"""The planner's inputs besides the model: the cluster, the workload and the search limits.

``Cluster`` says what one step runs on (hosts, accelerators and their NICs, what overlaps);
``Workload`` what a step computes (sequence length, global batch in tokens, dtype);
``Limits`` which SMP settings the search may try. Each checks its own values and raises a
``ValueError`` naming the value, the rule and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch_sagemaker.planner.presets import Accelerator

DTYPES = ("bfloat16", "float32")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a number.")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r}: must be a positive, finite number.")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an integer.")
    if value < 1:
        raise ValueError(f"{name}={value}: must be at least 1.")


@dataclass(frozen=True)
class Cluster:
    """The machines one training job runs on.

    Attributes:
        hosts: Number of hosts.
        per_host: Accelerators (ranks) per host.
        accelerator: What each rank runs on.
        nics: Network interfaces per host.
        nic_bits: Each interface's rate, bits/s (all interfaces are used as one pipe).
        usable_memory: Fraction of ``accelerator.memory_bytes`` a configuration may plan to
            use; the rest is left for what the model does not count (the CUDA context,
            communication libraries' own buffers, the caching allocator's fragmentation).
        overlap: Whether FSDP's collectives run beside the compute (GPUs: separate streams
            and engines). ``False`` for CPU ranks sharing cores, where a collective's work
            takes the cores the compute needs.
        costs: Optional ``cost_model.Costs`` for the collectives (default: the planner's
            assumption for accelerator clusters, ``comm.accelerator_costs``).
        cores_per_host: CPU cores per host, for CPU clusters (the cost model's CPU share).
    """

    hosts: int
    per_host: int
    accelerator: Accelerator
    nics: int = 1
    nic_bits: float = 100e9
    usable_memory: float = 0.9
    overlap: bool = True
    costs: object | None = None
    cores_per_host: float = 0.0

    def __post_init__(self) -> None:
        _positive_int("hosts", self.hosts)
        _positive_int("per_host (accelerators per host)", self.per_host)
        _positive_int("nics", self.nics)
        _positive("nic_bits (NIC rate)", self.nic_bits)
        _positive("usable_memory", self.usable_memory)
        if self.usable_memory > 1:
            raise ValueError(
                f"usable_memory={self.usable_memory}: a fraction of device memory, at most 1."
            )

    @property
    def world_size(self) -> int:
        """Ranks of the job."""
        return self.hosts * self.per_host

    @property
    def nic_rate(self) -> float:
        """Bytes/s each host sends (all its NICs), one direction."""
        return self.nics * self.nic_bits / 8

    @property
    def memory_budget(self) -> float:
        """Bytes per rank a configuration may plan to use."""
        return self.accelerator.memory_bytes * self.usable_memory


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains.

    Attributes:
        seq_len: Tokens per sequence.
        global_batch_tokens: Tokens per optimizer step over the whole job.
        dtype: Compute dtype: ``"bfloat16"`` (FSDP mixed precision: fp32 master parameters,
            bf16 compute and gradient reduction, as SMP's examples run) or ``"float32"``.
    """

    seq_len: int
    global_batch_tokens: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _positive_int("seq_len", self.seq_len)
        _positive_int("global_batch_tokens", self.global_batch_tokens)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)}.")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} is not a whole number of "
                f"sequences of seq_len={self.seq_len}; use a multiple of {self.seq_len}."
            )

    @property
    def sequences(self) -> int:
        """Sequences per optimizer step."""
        return self.global_batch_tokens // self.seq_len

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element in the compute dtype."""
        return 4 if self.dtype == "float32" else 2


#: The settings the search may vary, by the name the ``--limit`` option uses.
SETTINGS = (
    "hybrid_shard_degree",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "activation_loading_horizon",
    "fsdp",
    "activation_checkpointing",
    "activation_offloading",
    "moe",
    "gradient_accumulation_steps",
)

#: What each setting's values may be: the smallest integer, or ``bool`` for a switch and
#: ``(1, 2)`` for the FSDP version.
_LIMIT_VALUES: dict[str, int | type | tuple[int, ...]] = {
    "hybrid_shard_degree": 0,
    "tensor_parallel_degree": 1,
    "context_parallel_degree": 1,
    "expert_parallel_degree": 1,
    "activation_loading_horizon": 1,
    "fsdp": (1, 2),
    "activation_checkpointing": bool,
    "activation_offloading": bool,
    "moe": bool,
    "gradient_accumulation_steps": 1,
}


def _limit_values(name: str, values: object) -> tuple:
    """``values`` as the tuple the search tries, or a ``ValueError`` naming what is wrong."""
    rule = _LIMIT_VALUES[name]
    if rule is bool:
        allowed = "True or False"
    elif isinstance(rule, tuple):
        allowed = " or ".join(map(str, rule))
    else:
        allowed = f"integers >= {rule}"
    if not isinstance(values, (tuple, list, set, frozenset, range)):
        example = "(True,)" if rule is bool else "(2,)"
        raise ValueError(
            f"limit {name}={values!r}: give the values to try as a tuple or list of "
            f"{allowed}, e.g. {name}={example} (got {type(values).__name__})."
        )
    if not values:
        raise ValueError(f"limit {name}={values!r}: give at least one value ({allowed}).")
    for value in values:
        if rule is bool:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool)
            if ok and isinstance(rule, tuple):
                ok = value in rule
            elif ok:
                assert isinstance(rule, int)
                ok = value >= rule
        if not ok:
            raise ValueError(
                f"limit {name}={values!r}: {value!r} is not one of the values {name} takes "
                f"({allowed})."
            )
    return tuple(dict.fromkeys(values))  # in the order given, each once


@dataclass(frozen=True)
class Limits:
    """The values the search tries for each setting (``None``: every value that can work).

    Attributes:
        allowed: Setting name (one of ``SETTINGS``) -> the values allowed (a tuple, list or
            set; kept as a tuple). Degrees and ``activation_loading_horizon`` are integers
            (``hybrid_shard_degree`` from 0, the others from 1), ``fsdp`` is 1 or 2, the
            switches (``activation_checkpointing``, ``activation_offloading``, ``moe``)
            ``True``/``False``. ``gradient_accumulation_steps`` (integers from 1) names the
            micro-batches per step to try; without it each configuration gets the fewest
            that fit (``search.fewest_steps_that_fit``).
        max_horizon: Largest ``activation_loading_horizon`` tried when offloading (horizons 1
            to it), unless ``allowed`` names the horizons: then exactly those, larger ones too.
    """

    allowed: dict[str, tuple] = field(default_factory=dict)
    max_horizon: int = 4

    def __post_init__(self) -> None:
        unknown = sorted(set(self.allowed) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown settings {unknown} to limit; known: {', '.join(SETTINGS)}.")
        checked = {name: _limit_values(name, values) for name, values in self.allowed.items()}
        object.__setattr__(self, "allowed", checked)
        _positive_int("max_horizon", self.max_horizon)

    def allows(self, name: str, value: object) -> bool:
        """Whether the search may use ``value`` for the setting ``name``."""
        values = self.allowed.get(name)
        return values is None or value in values


__all__ = ["DTYPES", "SETTINGS", "Cluster", "Limits", "Workload"]
