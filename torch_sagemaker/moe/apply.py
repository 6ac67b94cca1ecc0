"""``tsm.transform(model, config=MoEConfig(...))``: the mixture-of-experts step of the transform.

``check_config`` runs with the other argument checks (before anything changes);
``apply_moe`` then, for every sparse MoE block the model's policy names:

1. splits the block's fused experts over ``tsm.state.ep_mesh`` and makes them dispatch
   tokens (``experts.split_experts``; both ``smp_moe`` settings); under tensor parallelism
   (expert parallel degree 1) the TP plan has split them over the TP ranks already;
2. with ``smp_moe=True``, replaces the block by a ``MoELayer`` (routing with load balancing,
   token shuffle, fp32 router, auxiliary losses); with ``smp_moe=False`` the Hugging Face
   block and its router stay, and the MoEConfig options that only ``MoELayer`` implements
   are reported as having no effect.

With expert parallelism it also makes the model's ``generate`` decode on every rank until
all are done (``generation.sync_generation``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from torch_sagemaker.logger import warn_once
from torch_sagemaker.moe.experts import split_experts
from torch_sagemaker.moe.generation import sync_generation
from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.moe.moe_layer import MoELayer
from torch_sagemaker.moe.token_shuffle import TokenShuffle
from torch_sagemaker.utils.hf_config import text_config


@dataclass(frozen=True)
class MoEReport:
    """What ``apply_moe`` did: blocks changed, experts per layer and per rank, the layer kind."""

    blocks: int
    num_experts: int
    local_experts: int
    layer: str


def check_config(config: Any, *, tp: int, cp: int, ep: int) -> MoEConfig | None:
    """Validates ``tsm.transform``'s ``config`` against the SMP degrees.

    Raises:
        TypeError: If ``config`` is neither ``None`` nor a ``MoEConfig``.
        ValueError: For expert parallelism without a MoEConfig, or an MoEConfig together
            with context parallelism. (With tensor parallelism the experts are split over the
            TP ranks instead, Note [MoELayer under tensor parallelism]; expert and tensor
            parallelism together are refused by ``tsm.init``.)
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(
            f"tsm.transform(config=...) takes a torch.sagemaker.moe.moe_config.MoEConfig "
            f"(or None), got {type(config).__name__}: {config!r}."
        )
    if config is None:
        if ep > 1:
            raise ValueError(
                f"expert_parallel_degree={ep} needs tsm.transform(model, config=MoEConfig(...)) "
                "(from torch.sagemaker.moe.moe_config import MoEConfig) so that the experts are "
                "split; or set expert_parallel_degree=1."
            )
        return None
    if cp > 1:
        # expert_parallel_degree > 1 with cp > 1 never gets here: tsm.init refuses it
        # (sharding_plan.combination_problems). This is the MoE layer itself with CP.
        raise ValueError(
            f"tsm.transform got an MoEConfig with context_parallel_degree={cp}: the MoE layer "
            "with context parallelism is not implemented. Pass config=None or set "
            "context_parallel_degree=1."
        )
    return config


def check_policy(policy: Any, config: MoEConfig | None) -> None:
    """Refuses an MoEConfig the model's policy cannot honour (before anything changes).

    Raises:
        ValueError: For ``smp_moe=True`` on a block whose router ``MoELayer`` does not know
            (a policy built from a transformers plan), naming both fixes.
    """
    spec = policy.moe
    if config is None or spec is None or spec.replaceable or not config.smp_moe:
        return
    raise ValueError(
        f"MoEConfig(smp_moe=True) replaces {spec.block_class} with MoELayer, which must "
        f"route exactly as the model does; policy {policy.name!r} comes from the model's "
        "transformers TP plan, which names the experts but not the router's rules. Pass "
        "MoEConfig(smp_moe=False): expert parallelism splits the experts and the model's own "
        "block and router run. Or register a torch_sagemaker.policies.ModelPolicy with an "
        "MoESpec describing the router (docs/expert_parallel.md)."
    )


def check_experts(policy: Any, config: Any, ep: int, model_name: str) -> None:
    """Whether an MoEConfig can split the experts of a model of ``config`` over ``ep`` ranks.

    Checks the model's config alone (``tsm.transform`` calls it before changing anything).

    Args:
        policy: The model's ``ModelPolicy``.
        config: Its Hugging Face config.
        ep: expert_parallel_degree.
        model_name: The model's class name, for the messages.

    Raises:
        ValueError: If the model has no mixture of experts, or its expert count is not
            divisible by ``ep``.
    """
    if policy.moe is None:
        raise ValueError(
            f"tsm.transform got an MoEConfig, but {model_name} is a dense model "
            f"(policy {policy.name!r} has no mixture of experts). Pass config=None."
        )
    num_experts = policy.num_experts(config)
    if num_experts % ep:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"expert_parallel_degree={ep} does not divide the number of experts "
            f"({policy.num_experts_attr}={num_experts}); every rank holds whole experts. "
            f"Use a degree in {valid}."
        )


def apply_moe(
    model: nn.Module,
    policy: Any,
    config: MoEConfig,
    *,
    ep_mesh: Any,
    src_data_rank: int | None,
    tp: int = 1,
) -> MoEReport:
    """Expert parallelism (and ``MoELayer`` when ``config.smp_moe``) for ``model``, in place.

    Args:
        model: A Hugging Face causal LM covered by ``policy``.
        policy: Its ``ModelPolicy``.
        config: The MoEConfig.
        ep_mesh: 1-D mesh of this rank's expert parallel group.
        src_data_rank: EP rank whose weights are authoritative; ``None`` for a local split.
        tp: tensor_parallel_degree. Above 1 (the expert parallel degree is then 1) the TP
            plan has split the experts already (Note [MoELayer under tensor parallelism]).

    Raises:
        ValueError: If the model has no mixture of experts, or its expert count is not
            divisible by the expert parallel degree (``check_experts``).
    """
    cfg = text_config(model)
    ep = ep_mesh.size()
    check_experts(policy, cfg, ep, type(model).__name__)
    spec = policy.moe
    assert spec is not None  # check_experts refused a dense policy
    num_experts = policy.num_experts(cfg)
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ == spec.block_class]
    if not blocks:
        raise ValueError(
            f"policy {policy.name!r}: {type(model).__name__} has no {spec.block_class} "
            "module; the model has no sparse MoE layer (num_experts=0?)."
        )
    _warn_no_effect(config, ep)
    seed = config.random_seed + ep_mesh.get_local_rank()
    for name, block in blocks:
        if tp == 1:
            split_experts(
                getattr(block, spec.experts),
                ep_mesh,
                all_to_all=config.moe_all_to_all_dispatcher,
                src_data_rank=src_data_rank,
            )
        if not config.smp_moe:
            continue
        shuffle = (
            TokenShuffle(ep_mesh.get_group(), seed)
            if config.global_token_shuffle and ep > 1
            else None
        )
        layer = MoELayer(
            block,
            spec,
            config,
            num_experts=num_experts,
            top_k=spec.top_k(cfg),
            normalize=spec.normalize(cfg),
            shuffle=shuffle,
        )
        layer.train(block.training)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    if ep > 1:  # Note [Generation with experts on other ranks]
        sync_generation(model)
    return MoEReport(
        blocks=len(blocks),
        num_experts=num_experts,
        local_experts=num_experts // (ep * tp),
        layer="MoELayer" if config.smp_moe else spec.block_class,
    )


def check_tp_experts(policy: Any, model_name: str, tp: int) -> None:
    """Under tensor parallelism an MoEConfig needs a plan that splits experts and routers.

    Raises:
        ValueError: If the policy's TP plan does not split the experts whole (``experts``)
            or does not replicate the router with plain logits (``router``).
    """
    spec = policy.moe
    styles = set(policy.tp_plan.values())
    if {"experts", "router"} <= styles and spec is not None:
        return
    raise ValueError(
        f"tsm.transform got an MoEConfig with tensor_parallel_degree={tp}, but the TP plan of "
        f"policy {policy.name!r} ({model_name}) does not split the experts over the TP ranks "
        "(styles 'experts' and 'router'). Use expert_parallel_degree with "
        "tensor_parallel_degree=1 for this model."
    )


def _warn_no_effect(config: MoEConfig, ep: int) -> None:
    if config.use_cpu_initialization:
        warn_once(
            "MoEConfig(use_cpu_initialization=True) has no effect: expert parameters are created "
            "where the model's parameters are."
        )
    if config.smp_moe:
        if config.global_token_shuffle and ep == 1:
            warn_once(
                "MoEConfig(global_token_shuffle=True) has no effect with expert_parallel_degree=1."
            )
        return
    ignored = (
        [f"moe_load_balancing={config.moe_load_balancing!r}"]
        if config.moe_load_balancing != "none"
        else []
    )
    if config.global_token_shuffle:
        ignored.append("global_token_shuffle=True")
    if config.moe_z_loss_coeff > 0:
        ignored.append(f"moe_z_loss_coeff={config.moe_z_loss_coeff}")
    if ignored:
        warn_once(
            "MoEConfig(smp_moe=False) keeps the model's own MoE block and router, "
            f"so {', '.join(ignored)} "
            "have no effect (the model's router_aux_loss_coef with output_router_logits=True still "
            "applies). Use smp_moe=True for them."
        )


__all__ = [
    "MoEReport",
    "apply_moe",
    "check_config",
    "check_experts",
    "check_policy",
    "check_tp_experts",
]
