"""Model policies: the policy type, the registry and one module per model family, in one package.

- ``model_policy``: ``ModelPolicy`` / ``MoESpec`` (a model family as data), the TP ``STYLES``
  a plan may name, and the head arithmetic (``split_heads``, ``check_model``).
- ``llama``, ``mistral``, ``mixtral``, ``gpt_neox``, ``qwen2``, ``qwen2_moe``,
  ``qwen3_moe``: one policy each, data only; they import ``model_policy`` and nothing else
  of the package (``mistral``/``qwen2``/``mixtral`` reuse ``llama``'s plan builder).
- ``transformers_plan``: ``policy_from_plan``, the policy a model's own transformers TP plan
  (``base_model_tp_plan``) gives when no policy covers it (Note [Plan-driven layout]).
- ``shipped_plans``: plans in transformers' terms for families transformers ships none
  for (OPT, StableLM, BART's decoder, ...), used where the model's own plan is empty.
- ``registry``: ``POLICIES`` (the shipped ones, listed explicitly), ``register_policy`` for
  a user's own, and the lookups (``lookup_policy``: a registered policy, else the plan's;
  ``get_policy``, ``transformer_layer_classes``) the rest of the library uses.

Imports go one way: families and ``transformers_plan`` -> ``model_policy``;
``transformers_plan`` -> ``shipped_plans``; ``registry`` ->
families, ``transformers_plan`` and ``model_policy``; this file re-exports. Generic machinery
(``tensor_parallel``, ``sharding``, ``offload``) imports from here; nothing here imports it.

Example:
    >>> from torch_sagemaker.policies import ModelPolicy, register_policy
    >>> from torch_sagemaker.policies.llama import llama_style_plan
    >>> register_policy(ModelPolicy(
    ...     name="my_llama", model_classes=("MyLlamaForCausalLM",), layer_class="MyDecoderLayer",
    ...     attention="model.layers.*.self_attn", tp_plan=llama_style_plan()))
"""

from torch_sagemaker.policies.model_policy import (
    STYLES,
    HeadSplit,
    ModelPolicy,
    MoESpec,
    check_model,
    split_heads,
)
from torch_sagemaker.policies.registry import (
    GPT_NEOX,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    POLICIES,
    POLICY_ATTR,
    QWEN2,
    QWEN2_MOE,
    QWEN3_MOE,
    get_policy,
    lookup_policy,
    register_policy,
    registered_policies,
    transformer_layer_classes,
    unregister_policy,
)

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
    "STYLES",
    "HeadSplit",
    "ModelPolicy",
    "MoESpec",
    "check_model",
    "get_policy",
    "lookup_policy",
    "register_policy",
    "registered_policies",
    "split_heads",
    "transformer_layer_classes",
    "unregister_policy",
]
