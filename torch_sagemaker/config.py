"""SMP v2 configuration: the frozen ``SMPConfig`` and its validation.

Its input, the argument given to ``tsm.init`` (a dict or a JSON file path) and the
environment variable ``SM_HP_MP_PARAMETERS`` that SageMaker sets from the estimator's
``mp_parameters``, is read by ``config_input.py`` (``load_raw``, re-exported here with
``ConfigError``); nothing else in the package reads SMP's config. ``TSM_CUDA_BACKEND`` and
``TSM_OVERLAP_REPLICA_REDUCTION``, the package's own switches, are read in
``env_settings.py`` (``TSM_LOG_LEVEL`` in ``logger.py``).

Precedence, lowest to highest (as on SageMaker, the launcher wins over the script):
defaults < ``tsm.init(config)`` < ``SM_HP_MP_PARAMETERS`` < assignments made on
``tsm.state`` before ``tsm.init()`` (SMP's example scripts use those to force native mode).

Validation never rewrites the config: it either returns an ``SMPConfig`` or raises one
``ConfigError`` listing every problem, each naming the key, the value, the rule and a fix.
Derived values (the resolved shard degree, the replicate degree) live in
``torch_sagemaker.topology.Layout``.

No input escapes as a raw Python error: non-string keys and values too large to print
become ``ConfigError`` problems (values are shown through ``show_value``), as do the
reading problems ``config_input.py`` finds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch_sagemaker.config_input import (
    ENV_VAR,
    MAX_CONFIG_BYTES,
    ConfigError,
    load_raw,
    show_value,
)
from torch_sagemaker.logger import get_logger
from torch_sagemaker.sharding_plan import combination_problems

MAX_SEED = 2**63 - 1
MAX_COUNT = 2**31 - 1  # bound of the degrees and the horizon (counts of ranks or layers)
_MAX_UNKNOWN_SHOWN = 20  # unknown keys listed one by one; the rest are counted


@dataclass(frozen=True, kw_only=True)
class SMPConfig:
    """The nine SMP v2 parameters, with SMP's documented defaults.

    Attributes:
        hybrid_shard_degree: Size of the FSDP sharding group. ``0`` keeps native FSDP
            behaviour (the script's ``sharding_strategy`` decides: FULL_SHARD shards over
            all data-parallel ranks, HYBRID_SHARD within a host); ``1`` means NO_SHARD;
            ``k >= 2`` shards over ``k`` ranks and replicates across
            ``world_size / (k * tensor_parallel_degree)`` groups. Includes the context
            parallel ranks, so it must be a multiple of ``context_parallel_degree``.
        sm_activation_offloading: ``True`` makes ``offload_wrapper`` use the prefetching
            offloader; ``False`` keeps PyTorch's native offloading. The script still has to
            apply ``offload_wrapper`` itself. Default ``True`` as in the SMP reference.
        activation_loading_horizon: Maximum number of offloaded layers whose activations
            may be resident on the compute device at once (prefetch depth). Positive.
            Has an effect only with ``sm_activation_offloading``.
        fsdp_cache_flush_warnings: Warn when the CUDA caching allocator had to flush its
            cache (allocation retries) during a step. No effect on CPU.
        allow_empty_shards: Allow FSDP shards that are empty because a tensor is smaller
            than the shard count. ``False`` keeps stock PyTorch behaviour.
        tensor_parallel_degree: Number of ranks a transformed model's layers are split
            over. Innermost, contiguous ranks. Needs ``tsm.transform``.
        context_parallel_degree: Number of ranks the sequence is split over; must not exceed
            the shard degree. Needs ``tsm.transform``.
        expert_parallel_degree: Number of ranks the experts of an MoE model are split
            over. Not compatible with tensor parallelism.
        random_seed: Seed for random operations inside tensor/expert parallel regions;
            each rank uses ``random_seed + tp_rank``. Not stated by SMP; we use 12345,
            the default of SMP's ``MoEConfig``.
    """

    hybrid_shard_degree: int = 0
    sm_activation_offloading: bool = True
    activation_loading_horizon: int = 2
    fsdp_cache_flush_warnings: bool = True
    allow_empty_shards: bool = False
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    random_seed: int = 12345

    def to_dict(self) -> dict[str, Any]:
        """Returns the parameters as a plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)


FIELD_TYPES: dict[str, type] = {
    f.name: (bool if f.type in (bool, "bool") else int) for f in fields(SMPConfig)
}
FIELD_NAMES = tuple(FIELD_TYPES)

# Keys people carry over from SMP v1, SageMaker recipes or blog posts, with what to use instead.
_RENAMED_KEYS = {
    "tensor_parallel_seed": "random_seed",
    "sharded_data_parallel_degree": "hybrid_shard_degree",
    "shard_degree": "hybrid_shard_degree",
    "offload_activations": "sm_activation_offloading",
    "tensor_model_parallel_degree": "tensor_parallel_degree",
    "expert_model_parallel_degree": "expert_parallel_degree",
}
_SMP_V1_KEYS = frozenset(
    {
        "partitions",
        "pipeline",
        "microbatches",
        "ddp",
        "ddp_dist_backend",
        "optimize",
        "pipeline_parallel_degree",
        "auto_partition",
        "default_partition",
    }
)

# SMP v1 keys that SageMaker's Python SDK itself puts into SM_HP_MP_PARAMETERS: for GPU
# training recipes it always adds {"placement_strategy": "cluster"}, which the user cannot
# remove. SMP v2 places ranks by the launcher's order, so the key is accepted and ignored.
_SDK_ADDED_KEYS = frozenset({"placement_strategy"})

# FP8 switches of SMP's example scripts and SageMaker's training recipes. SMP v2 has no
# config key for FP8: its scripts wrap the forward in fp8_autocast (docs/fp8.md).
_FP8_SCRIPT_KEYS = frozenset({"fp8", "fp8_amax_history_len", "fp8_amax_compute_algo"})


# ------------------------------------------------------------------------- validation


def _type_name(value: Any) -> str:
    """The type's name, with its module where it is not a builtin.

    ``numpy.bool_``'s ``__name__`` alone, ``bool``, would read as the type asked for.
    """
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _type_problem(key: str, value: Any) -> str | None:
    expected = FIELD_TYPES[key]
    if expected is bool:
        if isinstance(value, bool):
            return None
        return (
            f"{key}={show_value(value)}: must be a boolean (true or false), "
            f"got {_type_name(value)}."
        )
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (booleans are not integers)" if isinstance(value, bool) else ""
        return (
            f"{key}={show_value(value)}: must be an integer{hint}, got "
            f"{_type_name(value)}. Write e.g. {key}=2."
        )
    return None


def _unknown_key_problem(key: Any) -> str:
    if not isinstance(key, str):
        return (
            f"key {show_value(key)} ({type(key).__name__}): config keys must be strings naming "
            f"an SMP parameter. Use one of {', '.join(FIELD_NAMES)}."
        )
    if key in _RENAMED_KEYS:
        return f"unknown key {key!r}: SMP v2 calls it {_RENAMED_KEYS[key]!r}. Rename the key."
    if key in _FP8_SCRIPT_KEYS:
        return (
            f"unknown key {key!r}: SMP v2 has no config key for FP8; the training script "
            "enables it by running the forward under fp8_autocast(enabled=True, "
            "fp8_recipe=DelayedScaling(...)) (torch.sagemaker.fp8, docs/fp8.md). Remove the key."
        )
    if key in _SMP_V1_KEYS:
        return (
            f"unknown key {key!r}: this is an SMP v1 parameter with no SMP v2 equivalent. "
            f"Remove it; valid keys are {', '.join(FIELD_NAMES)}."
        )
    close = difflib.get_close_matches(key, FIELD_NAMES, n=1, cutoff=0.6) if len(key) < 100 else []
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys are {', '.join(FIELD_NAMES)}."
    return f"unknown key {show_value(key)}: {hint}"


def _divisors(n: int) -> str:
    """The divisors of ``n`` in order, found in pairs up to its square root.

    A loop up to ``n`` itself took minutes for a world of 2**31 - 1 ranks.
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return ", ".join(str(d) for d in small + large)


def _range_problems(values: dict[str, Any]) -> list[str]:
    problems = []
    for key in (
        "hybrid_shard_degree",
        "tensor_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
        "activation_loading_horizon",
    ):
        if key in values and values[key] > MAX_COUNT:
            problems.append(
                f"{key}={show_value(values[key])}: must be at most 2**31 - 1 (it counts "
                "ranks or layers). Use the intended small number."
            )
    for key in ("tensor_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
        if key in values and values[key] < 1:
            problems.append(f"{key}={show_value(values[key])}: must be >= 1 (1 disables it).")
    if "hybrid_shard_degree" in values and values["hybrid_shard_degree"] < 0:
        problems.append(
            f"hybrid_shard_degree={show_value(values['hybrid_shard_degree'])}: must be >= 0 "
            "(0 = native FSDP behaviour, 1 = no sharding, k >= 2 = shard over k ranks)."
        )
    if "activation_loading_horizon" in values and values["activation_loading_horizon"] < 1:
        problems.append(
            f"activation_loading_horizon={show_value(values['activation_loading_horizon'])}: "
            "must be >= 1 "
            "(number of layers prefetched ahead of backward; SMP's default is 2)."
        )
    if "random_seed" in values and not 0 <= values["random_seed"] <= MAX_SEED:
        problems.append(
            f"random_seed={show_value(values['random_seed'])}: must be in [0, 2**63 - 1]."
        )
    return problems


def _world_problems(cfg: dict[str, Any], world_size: int) -> list[str]:
    """Checks the degrees against the number of ranks (only for values that passed type checks)."""
    problems = []
    tp, cp, ep = (
        cfg["tensor_parallel_degree"],
        cfg["context_parallel_degree"],
        cfg["expert_parallel_degree"],
    )
    hsd = cfg["hybrid_shard_degree"]
    for key, deg in (
        ("tensor_parallel_degree", tp),
        ("context_parallel_degree", cp),
        ("expert_parallel_degree", ep),
    ):
        if deg >= 1 and world_size % deg:
            problems.append(
                f"{key}={deg}: must divide world_size={world_size}. "
                f"Use one of {_divisors(world_size)}."
            )
    # The rules between degrees belong to the sharding plan; reported here with the rest.
    problems.extend(combination_problems(tp, cp, ep))
    if problems or min(tp, cp, ep) < 1 or hsd < 0:
        # The combined rules below would only echo the problems above; check hsd alone.
        if hsd > 0 and world_size % hsd:
            problems.append(
                f"hybrid_shard_degree={hsd}: must divide world_size={world_size}. "
                f"Use one of {_divisors(world_size)} (or 0 for native FSDP)."
            )
        return problems
    max_hsd = world_size // (tp * ep)
    if hsd > max_hsd:
        problems.append(
            f"hybrid_shard_degree={hsd}: must be at most world_size // (tensor_parallel_degree * "
            f"expert_parallel_degree) = {world_size} // ({tp} * {ep}) = {max_hsd}."
        )
    elif hsd > 0 and world_size % (hsd * tp * ep):
        choices = _divisors(max_hsd)
        problems.append(
            f"hybrid_shard_degree={hsd}: world_size % "
            "(hybrid_shard_degree * tensor_parallel_degree * "
            f"expert_parallel_degree) must be 0, but {world_size} % ({hsd} * {tp} * {ep}) = "
            f"{world_size % (hsd * tp * ep)}. Use one of {choices} (or 0 for native FSDP)."
        )
    resolved = hsd if hsd > 0 else max_hsd
    if cp > 1 and cp > resolved:
        problems.append(
            f"context_parallel_degree={cp} > hybrid_shard_degree={hsd}"
            f"{' (resolved to ' + str(resolved) + ')' if hsd == 0 else ''}: "
            "the context parallel ranks "
            "live inside the FSDP shard group, so context_parallel_degree <= hybrid_shard_degree. "
            "Raise hybrid_shard_degree or lower context_parallel_degree."
        )
    elif cp > 1 and resolved % cp:
        problems.append(
            f"context_parallel_degree={cp}: must divide the shard degree {resolved} "
            "(the shard group "
            "is made of whole context parallel groups). "
            "Use a multiple of it as hybrid_shard_degree."
        )
    return problems


def validate(raw: Mapping[str, Any], world_size: int | None = None) -> SMPConfig:
    """Validates a raw config dict and returns the frozen ``SMPConfig``.

    Args:
        raw: Merged config values (see ``load_raw``).
        world_size: Number of ranks; when given, degrees are checked against it.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: Listing every problem found (unknown keys, types, ranges, degrees).
        ValueError: If ``world_size`` is not in [1, 2**31 - 1] (the caller's mistake, not
            the config's).
    """
    if world_size is not None and not 1 <= world_size <= MAX_COUNT:
        raise ValueError(
            f"world_size={show_value(world_size)}: must be in [1, 2**31 - 1] (a number of ranks)."
        )
    ignored = [k for k in raw if k in _SDK_ADDED_KEYS]
    if ignored:
        get_logger().info(
            f"SMP config: ignoring {', '.join(f'{k}={show_value(raw[k])}' for k in ignored)} "
            "(an SMP v1 key SageMaker's SDK adds for training recipes; SMP v2 places ranks in "
            "the launcher's order)."
        )
    unknown = [k for k in raw if k not in FIELD_TYPES and k not in _SDK_ADDED_KEYS]
    problems = [_unknown_key_problem(k) for k in unknown[:_MAX_UNKNOWN_SHOWN]]
    if len(unknown) > _MAX_UNKNOWN_SHOWN:
        problems.append(f"... and {len(unknown) - _MAX_UNKNOWN_SHOWN} more unknown keys.")
    typed = {}
    for key in FIELD_NAMES:
        if key not in raw:
            continue
        problem = _type_problem(key, raw[key])
        if problem:
            problems.append(problem)
        else:
            typed[key] = raw[key]
    problems += _range_problems(typed)
    merged = {**SMPConfig().to_dict(), **typed}
    # Degrees are checked against the world only when they are all well-typed and in range,
    # so one mistake is not reported twice.
    degree_keys = (
        "hybrid_shard_degree",
        "tensor_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
    )
    degrees_ok = all(k in typed or k not in raw for k in degree_keys) and not _range_problems(
        {k: merged[k] for k in degree_keys}
    )
    if world_size is not None and degrees_ok:
        problems += _world_problems(merged, world_size)
    if problems:
        raise ConfigError(problems)
    return SMPConfig(**merged)


def load(
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SMPConfig:
    """Loads and validates the configuration (``load_raw`` then ``validate``)."""
    return validate(load_raw(config, environ=environ, overrides=overrides), world_size)


__all__ = [
    "ENV_VAR",
    "FIELD_NAMES",
    "FIELD_TYPES",
    "MAX_CONFIG_BYTES",
    "ConfigError",
    "SMPConfig",
    "load",
    "load_raw",
    "show_value",
    "validate",
]
