"""Where a model's TP plan comes from: its own (transformers' or the user's), or a shipped one.

``own_plan(model)`` is the plan the model carries (``model.tp_plan``, transformers' or the
user's, or what an older transformers merges); ``shipped_from_root(model)`` the plan
``shipped_plans`` gives a family transformers ships none for, keyed from the model root;
``with_tied_input_embedding`` adds the input embedding a tied, vocabulary-split output
embedding needs. ``transformers_plan.policy_from_plan`` turns the plan into a policy.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

from torch import nn

from torch_sagemaker.policies.shipped_plans import plan_additions, shipped_plan
from torch_sagemaker.utils.hf_config import text_config

#: Styles of an output embedding that split the vocabulary over the TP ranks.
_VOCAB_SPLITTING_HEAD_STYLES = ("colwise", "colwise_rep", "colwise_gather_output")


def wildcard(name: str) -> str:
    """A module or parameter name with its layer numbers as ``*`` (how transformers keys plans)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def own_plan(model: nn.Module) -> dict[str, str]:
    """``model.tp_plan`` (transformers' or the user's), or what an older transformers merges."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict):
        return dict(plan)
    return transformers_plan(model)


def transformers_plan(model: nn.Module) -> dict[str, str]:
    """The plan transformers gives ``model``: its class's ``_tp_plan`` and its config's."""
    merged = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    merged.update(_from_root(model, base))
    return merged


def only_the_class_head(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether ``plan`` is only the output-embedding entry of the model class's ``_tp_plan``.

    Some causal-LM classes declare ``_tp_plan = {"lm_head": ...}`` while their config has no
    ``base_model_tp_plan`` (DBRX in transformers 5): transformers then ships no plan for the
    layers, and a shipped plan may give one (which splits that head the same way).
    """
    declared = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return bool(plan) and plan == declared and not base


def with_additions(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with the family's additions if it is the plan transformers gives the model.

    Note [Additions to transformers' plans] in ``shipped_plans``. A plan that changes or
    drops an entry of transformers' (the user's) is returned as is.
    """
    additions = plan_additions(getattr(model.config, "model_type", None) or "")
    if not additions or not _keeps_transformers_plan(model, plan):
        return plan
    names = _module_names(model)
    added = {
        key: style
        for key, style in _from_root(model, additions).items()
        if _names_some(names, key)  # (a module the config may leave out)
    }
    return {**added, **plan}


def _keeps_transformers_plan(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether ``plan`` is transformers' own, or built on it.

    Every entry is kept as transformers gives it (transformers itself adds the input
    embedding to the model's).
    """
    return transformers_plan(model).items() <= plan.items()


def _module_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


def _names_some(names: list[str], pattern: str) -> bool:
    return any(fnmatchcase(n, pattern) for n in names)


def with_plan_experts(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with the routed experts transformers' EP plan names split as its TP plans did.

    Note [Experts named only in the EP plan]
        transformers 5.25 took the routed experts out of every TP plan it ships (their style,
        ``moe_tp_experts``, is deprecated there) and names them in the EP plan only
        (``base_model_ep_plan``: the experts module as ``ep_dispatch_experts``). Read as it
        stands, a 5.25 plan leaves the experts whole on every TP rank, and every rank computes
        every expert on the same tokens: the same result as 5.24's plan, for tensor-parallel-
        degree times the experts' memory and compute. torch_sagemaker splits them on every
        transformers version: where the plan is transformers' own and names neither the
        experts module nor anything below it, the module gets ``moe_tp_experts`` (this rank's
        experts, the outputs summed over the TP ranks: ``experts_allreduce``), as 5.24's plan
        said. The same holds for a plan that never named its experts (GPT-OSS's, which
        splits only the input embedding: 7% of its parameters at TP 2, 89% with its experts
        split, parity unchanged). Expert parallelism (``expert_parallel_degree``) finds the
        experts it moves from the same entry. A plan the user set is taken as written.
    """
    if not plan or not _keeps_transformers_plan(model, plan):
        return plan
    names = _module_names(model)
    added: dict[str, str] = {}
    for prefix, module in model.named_modules():
        ep_plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None) or {}
        for key, style in ep_plan.items():
            if style != "ep_dispatch_experts":
                continue
            pattern = f"{prefix}.{key}" if prefix else key
            covered = any(k == pattern or k.startswith(f"{pattern}.") for k in plan)
            if not covered and _names_some(names, pattern):
                added[pattern] = "moe_tp_experts"
    return {**plan, **added}


def _from_root(model: nn.Module, base: dict[str, str]) -> dict[str, str]:
    """A plan keyed below the base model (``base_model_tp_plan``), keyed from the root.

    The base model is the child named by ``base_model_prefix``. Where the class names one it
    does not have (MllamaForCausalLM's ``language_model``; its text model is ``model``), it
    is the one child that is a model with a config of its own, if the plan names modules
    below that child and none from the root.
    """
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and hasattr(model, prefix) else ""
    models = [n for n, c in model.named_children() if hasattr(c, "config")]
    if not inner and len(models) == 1:
        names = _module_names(model)
        below = any(_names_some(names, f"{models[0]}.{k}") for k in base)
        if below and not any(_names_some(names, k) for k in base):
            inner = models[0]
    return {f"{inner}.{k}" if inner else k: v for k, v in base.items()}


def embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The model's input and output embeddings (``get_input/output_embeddings``), or None."""
    found: list[nn.Module | None] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except NotImplementedError:  # transformers' default on a model that has none
            module = None
        found.append(module if isinstance(module, nn.Module) else None)
    return found[0], found[1]


def shipped_from_root(model: nn.Module) -> dict[str, str]:
    """The family's shipped plan keyed from the root, with vocabulary-split embeddings.

    The input embedding (an ``nn.Embedding``) gets ``embedding_rowwise`` and the output one
    (an ``nn.Linear``) ``colwise_gather_output``, as transformers gives them in the plans it
    builds; ``{}`` where nothing is shipped for ``config.model_type``.
    """
    base = shipped_plan(getattr(model.config, "model_type", None) or "", text_config(model))
    if not base:
        return {}
    entries: dict[str, str] = {}
    embedding, head = embeddings(model)
    for module, style in (
        (embedding if isinstance(embedding, nn.Embedding) else None, "embedding_rowwise"),
        (head if isinstance(head, nn.Linear) else None, "colwise_gather_output"),
    ):
        if module is not None:
            entries.update({n: style for n, m in model.named_modules() if n and m is module})
    return {**entries, **_from_root(model, base)}


def with_tied_input_embedding(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan``, with the input embedding split like the tied output embedding it splits.

    Added only where the plan splits the output embedding over the vocabulary and says
    nothing of the input embedding. transformers adds that
    entry to the plans it builds from a config, but not to a plan the user sets
    (``model.tp_plan = {...}`` on a family it ships none for); tied weights must be split
    alike, so the one layout that can go with the output embedding's is added.
    """
    embedding, head = embeddings(model)
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
        return plan
    if embedding.weight is not head.weight:
        return plan
    names = {id(m): n for n, m in model.named_modules()}
    head_name, embedding_name = names.get(id(head)), names.get(id(embedding))
    if head_name is None or embedding_name is None:
        return plan
    if plan.get(wildcard(head_name)) not in _VOCAB_SPLITTING_HEAD_STYLES:
        return plan
    if wildcard(embedding_name) in plan:
        return plan
    return {embedding_name: "embedding_rowwise", **plan}


__all__ = [
    "embeddings",
    "only_the_class_head",
    "own_plan",
    "shipped_from_root",
    "transformers_plan",
    "with_additions",
    "with_tied_input_embedding",
    "wildcard",
]
