"""Applies a policy's TP plan to a model in place, on PyTorch DTensor (the CPU-capable backend).

``apply_tp_plan`` resolves each pattern of the plan to the model's modules, parallelizes
each with its style (``styles.make_style``), keeps tied parameters tied, gives attention
modules their per-rank head bookkeeping and the TP-region random stream, and installs the
vocabulary-parallel loss. Module names and parameter names do not change; parameters
become DTensors on the TP mesh, so ``state_dict()`` keeps Hugging Face's keys and
``full_tensor()`` of each value is the unsharded parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from torch_sagemaker.policies import HeadSplit, ModelPolicy
from torch_sagemaker.tensor_parallel.loss import causal_lm_loss
from torch_sagemaker.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from torch_sagemaker.tensor_parallel.styles import make_style

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TPReport:
    """What ``apply_tp_plan`` did (for the one-line log and for tests).

    Attributes:
        modules: Number of modules parallelized, per style name.
        heads: The head split used.
    """

    modules: dict[str, int]
    heads: HeadSplit


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) pairs that share one parameter object, for each shared parameter."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Points every member of each tied group at the first member's (parallelized) parameter."""
    for (first_module, first_name), *others in groups:
        param = getattr(first_module, first_name)
        for module, name in others:
            current = getattr(module, name)
            if (
                isinstance(current, DTensor)
                and isinstance(param, DTensor)
                and current.placements != param.placements
            ):
                raise ValueError(
                    f"tied parameters {first_name} ({param.placements}) and {name} "
                    f"({current.placements}) were given different TP layouts; the policy must "
                    "split tied parameters the same way (e.g. vocab_embedding with lm_head)."
                )
            module.register_parameter(name, param)


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of the modules of ``model`` whose full name matches ``pattern`` (``fnmatch``)."""
    return [name for name, _ in model.named_modules() if name and fnmatchcase(name, pattern)]


def install_rng_region(module: nn.Module, tracker: RNGStatesTracker) -> None:
    """Runs ``module``'s forward inside ``tracker.fork()`` (a TP region: per-rank random draws)."""
    stack: list[Any] = []

    def enter(_mod: nn.Module, _args: Any) -> None:
        ctx = tracker.fork(MODEL_PARALLEL_RNG)
        ctx.__enter__()
        stack.append(ctx)

    def leave(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _head_dim(policy: ModelPolicy, config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    heads, _ = policy.head_counts(config)
    return int(config.hidden_size) // heads


def apply_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    policy: ModelPolicy,
    heads: HeadSplit,
    *,
    tracker: RNGStatesTracker,
    src_data_rank: int | None = 0,
) -> TPReport:
    """Tensor-parallelizes ``model`` in place according to ``policy.tp_plan``.

    Args:
        model: A Hugging Face causal LM covered by ``policy`` (real or meta device).
        tp_mesh: 1-D mesh of the TP group.
        policy: The model's policy.
        heads: The head split (``policy.check_model``).
        tracker: RNG tracker whose stream the attention modules draw from.
        src_data_rank: ``0`` makes TP rank 0's weights authoritative (scatter/broadcast);
            ``None`` splits locally without communication (meta models, rank-0 loading).

    Returns:
        A ``TPReport``.

    Raises:
        ValueError: If a plan pattern matches no module, or a parameter is left unsharded
            (the policy does not fit the model).
    """
    tp_rank = tp_mesh.get_local_rank()
    kv_head = heads.kv_head_of(tp_rank) if heads.kv_replicated else None
    head_dim = _head_dim(policy, model.config)
    tied = _tied_groups(model)
    counts: dict[str, int] = {}
    for pattern, style_name in policy.tp_plan.items():
        names = matching_modules(model, pattern)
        if not names:
            raise ValueError(
                f"policy {policy.name!r}: TP plan pattern {pattern!r} matches no module "
                f"of {type(model).__name__}; the policy does not fit this model."
            )
        for name in names:
            style = make_style(style_name, head_dim=head_dim, kv_head=kv_head)
            # parallelize_module sets the style's src_data_rank from its own argument.
            parallelize_module(
                model.get_submodule(name), tp_mesh, style, src_data_rank=src_data_rank
            )
        counts[style_name] = counts.get(style_name, 0) + len(names)
    _retie(tied)
    for _, attention in policy.attention_modules(model):
        # Hugging Face attention infers the head count from the shapes (view(..., -1, head_dim));
        # only the query-per-kv grouping is stored, and it changes when kv heads are replicated.
        if hasattr(attention, "num_key_value_groups"):
            # (torch types nn.Module attributes as tensors or modules; this one is an int)
            attention.num_key_value_groups = heads.local_heads // heads.local_kv_heads  # type: ignore[assignment]
        install_rng_region(attention, tracker)
    left = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise ValueError(
            f"policy {policy.name!r} left parameters unsharded: {left[:6]}"
            f"{' ...' if len(left) > 6 else ''}; add a TP plan entry for their modules "
            "(use 'replicate' for small replicated modules)."
        )
    cast("PreTrainedModel", model).loss_function = causal_lm_loss  # an HF causal LM (see Args)
    return TPReport(modules=counts, heads=heads)


__all__ = ["TPReport", "apply_tp_plan", "install_rng_region", "matching_modules"]
