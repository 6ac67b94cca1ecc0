"""The policy registry: the shipped policies, users' own, and the lookups other layers use.

One small module per model family declares its policy as data. ``POLICIES`` lists them
explicitly (no folder scanning, no import side effects); ``register_policy`` adds a user's
own policy, which then wins over the shipped ones for the classes it names. Other
components find a model's policy and layer class here:

    >>> from torch_sagemaker.policies import get_policy, transformer_layer_classes
    >>> transformer_layer_classes(model)        # e.g. (LlamaDecoderLayer,), for fully_shard
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from torch_sagemaker._torch_compat import checkpoint_wrapper as cw_compat
from torch_sagemaker.policies.gpt_neox import GPT_NEOX
from torch_sagemaker.policies.llama import LLAMA
from torch_sagemaker.policies.mistral import MISTRAL
from torch_sagemaker.policies.mixtral import MIXTRAL
from torch_sagemaker.policies.model_policy import ModelPolicy
from torch_sagemaker.policies.qwen2 import QWEN2
from torch_sagemaker.policies.qwen2_moe import QWEN2_MOE
from torch_sagemaker.policies.qwen3_moe import QWEN3_MOE
from torch_sagemaker.policies.transformers_plan import PLAN_TP_NOTE, policy_from_plan

#: Attribute set by ``tsm.transform`` on the model it transformed.
POLICY_ATTR = "_tsm_policy"

#: The shipped policies, in lookup order.
POLICIES: tuple[ModelPolicy, ...] = (LLAMA, MISTRAL, MIXTRAL, GPT_NEOX, QWEN2, QWEN2_MOE, QWEN3_MOE)

# Policies added with register_policy, newest first; consulted before POLICIES.
_USER_POLICIES: list[ModelPolicy] = []


def register_policy(policy: ModelPolicy) -> None:
    """Registers ``policy`` so that ``tsm.transform`` accepts the classes it names.

    A policy registered later wins over earlier ones and over the shipped policies.

    Args:
        policy: The policy to add.

    Raises:
        TypeError: If ``policy`` is not a ``ModelPolicy``.
    """
    if not isinstance(policy, ModelPolicy):
        raise TypeError(
            f"register_policy expects a torch_sagemaker.policies.ModelPolicy, got "
            f"{type(policy).__name__}."
        )
    _USER_POLICIES.insert(0, policy)


def unregister_policy(policy: ModelPolicy) -> None:
    """Removes a policy added with ``register_policy`` (no-op if absent)."""
    if policy in _USER_POLICIES:
        _USER_POLICIES.remove(policy)


def registered_policies() -> list[ModelPolicy]:
    """User policies (newest first), then the shipped ones."""
    return [*_USER_POLICIES, *POLICIES]


def lookup_policy(model: nn.Module) -> ModelPolicy:
    """The policy ``tsm.transform`` applies to ``model``: a registered one, else its plan's.

    1. A registered policy covering the model's class (the most recently registered wins;
       user policies before the shipped ones).
    2. Otherwise the policy built from the model's own transformers TP plan
       (``config.base_model_tp_plan``; ``transformers_plan.policy_from_plan``).

    Raises:
        ValueError: If neither exists (lists the supported classes and how to register a
            policy), or the model's plan has an entry the plan-driven path cannot honour.
    """
    for policy in registered_policies():
        if policy.matches(model):
            return policy if policy.tp_plan else _with_plan_tp(policy, model)
    from_plan = policy_from_plan(model)
    if from_plan is not None:
        return from_plan
    supported = sorted(c for p in registered_policies() for c in p.model_classes)
    raise ValueError(
        f"tsm.transform does not support {type(model).__name__}: no policy covers it and its "
        f"config has no transformers base_model_tp_plan. Supported by policy: "
        f"{', '.join(supported)}; any model whose config carries a base_model_tp_plan works "
        "through that plan. Give it one in transformers' terms before tsm.transform "
        "(model.tp_plan = {'model.layers.*.self_attn.q_proj': 'colwise', ...}; docs/"
        "tensor_parallel.md, 'A model without a plan'), or describe it with a "
        "torch_sagemaker.policies.ModelPolicy (layer class, attention pattern, TP plan) and call "
        "torch_sagemaker.policies.register_policy(policy) before tsm.transform; see "
        "docs/tensor_parallel.md."
    )


def _with_plan_tp(policy: ModelPolicy, model: nn.Module) -> ModelPolicy:
    """A policy without a TP plan (expert parallelism only), with its model's plan for TP.

    The policy keeps everything it says (layer class, attention, the ``MoESpec`` that
    ``MoELayer`` needs); only the tensor parallel plan it leaves empty comes from the
    model's transformers plan, when it has one. Without one, or with one the translation
    refuses, the policy is returned as is (the refusal in its notes): expert parallelism
    still works and ``check_model`` refuses tensor parallelism, saying why.
    """
    try:
        from_plan = policy_from_plan(model)
    except ValueError as e:  # expert parallelism alone still works; TP is refused with this
        return replace(policy, notes=f"{policy.notes} Its transformers plan is unusable: {e}")
    if from_plan is None:
        return policy
    return replace(
        policy,
        tp_plan=from_plan.tp_plan,
        heads_split=from_plan.heads_split,
        notes=f"{policy.notes} {PLAN_TP_NOTE}".strip(),
    )


def get_policy(model: nn.Module) -> ModelPolicy | None:
    """The policy ``tsm.transform`` recorded on ``model``, or ``None`` if it was not transformed.

    Works through wrappers that keep the original module reachable (FSDP2 keeps the object;
    ``checkpoint_wrapper``/FSDP1 expose it as ``_checkpoint_wrapped_module``/``module``).
    """
    seen = model
    for _ in range(8):
        policy = getattr(seen, POLICY_ATTR, None)
        if policy is not None:
            return policy
        inner = cw_compat.wrapped_module_or_none(seen) or getattr(seen, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        seen = inner
    return None


def transformer_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes that make one FSDP / checkpointing / offloading unit of ``model``.

    The one rule, for every part of the library that needs a model's layers:

    1. A model a policy covers (the one ``tsm.transform`` recorded, else the registry's for
       its class): the policy's ``layer_class``. A policy whose layer class is not among the
       model's modules is an error, not a reason to guess.
    2. Any other model: the classes named by its Hugging Face ``_no_split_modules`` that
       occur among its modules (what ``from_pretrained(device_map=...)`` keeps whole).

    Args:
        model: The model, possibly transformed or wrapped (the recorded policy is found
            through ``checkpoint_wrapper`` / FSDP1 wrappers).

    Returns:
        One class for a policy's model; one or more from ``_no_split_modules`` otherwise.

    Raises:
        ValueError: If the covering policy's layer class is missing from ``model``, or no
            policy covers it and ``_no_split_modules`` names none of its modules.

    Example:
        >>> transformer_layer_classes(model)  # (LlamaDecoderLayer,), for fully_shard
    """
    policy = get_policy(model)
    if policy is None:
        policy = next((p for p in registered_policies() if p.matches(model)), None)
    if policy is not None:
        return (policy.layer_cls(model),)
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: dict[type[nn.Module], None] = {}  # first-seen order, so the result is stable
    for module in model.modules():
        if type(module).__name__ in names:
            found[type(module)] = None
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no transformer layer class: no policy covers it and "
            f"its _no_split_modules ({sorted(names) or 'none'}) name none of its modules. Pass "
            "layer_classes=(MyDecoderLayer,) (or check_fn=...), or describe the model with a "
            "torch_sagemaker.policies.ModelPolicy and register_policy it; see "
            "docs/tensor_parallel.md."
        )
    return tuple(found)


__all__ = [
    "GPT_NEOX",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "POLICIES",
    "POLICY_ATTR",
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3_MOE",
    "get_policy",
    "lookup_policy",
    "register_policy",
    "registered_policies",
    "transformer_layer_classes",
    "unregister_policy",
]
