"""Model policies shipped with torch_sagemaker (installed as ``torch_sagemaker.policies``).

One small module per model family declares its policy as data. ``POLICIES`` lists them
explicitly (no folder scanning, no import side effects); ``register_policy`` adds a user's
own policy, which then wins over the shipped ones for the classes it names.

Example:
    >>> from torch_sagemaker.policies import register_policy
    >>> from torch_sagemaker.policies.llama import llama_style_plan
    >>> from torch_sagemaker.policy import ModelPolicy
    >>> register_policy(ModelPolicy(
    ...     name="my_llama", model_classes=("MyLlamaForCausalLM",), layer_class="MyDecoderLayer",
    ...     attention="model.layers.*.self_attn", tp_plan=llama_style_plan()))
"""

from __future__ import annotations

from torch_sagemaker.policies.gpt_neox import GPT_NEOX
from torch_sagemaker.policies.llama import LLAMA
from torch_sagemaker.policies.mistral import MISTRAL
from torch_sagemaker.policies.mixtral import MIXTRAL
from torch_sagemaker.policies.qwen2 import QWEN2
from torch_sagemaker.policies.qwen2_moe import QWEN2_MOE
from torch_sagemaker.policies.qwen3_moe import QWEN3_MOE
from torch_sagemaker.policy import ModelPolicy

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
        raise TypeError(f"register_policy expects a torch_sagemaker.policy.ModelPolicy, got "
                        f"{type(policy).__name__}.")
    _USER_POLICIES.insert(0, policy)


def unregister_policy(policy: ModelPolicy) -> None:
    """Removes a policy added with ``register_policy`` (no-op if absent)."""
    if policy in _USER_POLICIES:
        _USER_POLICIES.remove(policy)


def registered_policies() -> list[ModelPolicy]:
    """User policies (newest first), then the shipped ones."""
    return [*_USER_POLICIES, *POLICIES]


__all__ = ["GPT_NEOX", "LLAMA", "MISTRAL", "MIXTRAL", "POLICIES", "QWEN2", "QWEN2_MOE", "QWEN3_MOE",
           "register_policy",
           "registered_policies", "unregister_policy"]
