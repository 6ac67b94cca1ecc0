"""The policy type: what ``tsm.transform`` needs to know about one model family, as data.

A ``ModelPolicy`` names the Hugging Face classes it covers, the transformer layer class
(the unit of FSDP wrapping, activation checkpointing and offloading), the attention modules
(tensor parallel regions, head bookkeeping) and the tensor parallel plan: module-name
patterns mapped to style names (``STYLES``). This module holds the generic pieces (the
dataclasses and the head arithmetic that checks a model config against a policy); the
family modules next to it (``llama``, ``mixtral``, ...) declare policies, and ``registry``
lists them and finds the one covering a model. Nothing here imports a family module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

#: Tensor parallel styles a plan may name (see ``tensor_parallel.styles`` for each one).
STYLES: Mapping[str, str] = {
    "colwise": "Linear whose output features (heads, MLP columns) are split; input replicated",
    "kv_colwise": "like colwise for key/value projections; replicates kv heads when kv_heads < tp",
    "rowwise": "Linear whose input features are split; output reduce-scattered over the sequence",
    "vocab_embedding": (
        "Embedding split over the vocabulary; output reduce-scattered over the sequence"
    ),
    "lm_head": "output projection split over the vocabulary; logits stay vocab-sharded",
    "sequence_parallel_norm": "norm computed on a sequence shard; output all-gathered",
    "sequence_parallel_dropout": "dropout on a sequence shard, drawing the unsharded model's mask",
    "replicate": "every parameter replicated (e.g. an MoE router)",
    "experts": "fused MoE experts (expert dim 0) split over the TP ranks",
    "reduce_scatter_output": "module output summed over TP ranks and split over the sequence",
}


@dataclass(frozen=True)
class MoESpec:
    """Where a model keeps its mixture of experts (used by ``tsm.transform`` with an MoEConfig).

    Attributes:
        block_class: Class name of the sparse MoE block (``"MixtralSparseMoeBlock"``); dense
            MLP layers of the same model are left alone.
        router: Child of the block holding the router; called on (N, H), it returns the
            (N, E) logits (or a tuple starting with them) and has a ``weight``.
        experts: Child holding the fused experts (3-D parameters, expert dimension first),
            called as ``experts(hidden, top_k_index, top_k_weights)``.
        top_k_attr: Config attribute with the number of experts per token.
        normalize_top_k: ``True``/``False``, or the config attribute saying whether the
            top-k gating weights are renormalized to sum to one.
        shared_expert: Child holding an always-active expert (Qwen2-MoE), or ``None``.
        shared_expert_gate: Child whose sigmoid scales the shared expert's output, or ``None``.
        jitter_attr: Block attribute with the router jitter noise, or ``None``.
    """

    block_class: str
    router: str = "gate"
    experts: str = "experts"
    top_k_attr: str = "num_experts_per_tok"
    normalize_top_k: bool | str = True
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    jitter_attr: str | None = None

    def top_k(self, config: Any) -> int:
        """Experts per token."""
        return int(getattr(config, self.top_k_attr))

    def normalize(self, config: Any) -> bool:
        """Whether the top-k weights are renormalized."""
        if isinstance(self.normalize_top_k, bool):
            return self.normalize_top_k
        return bool(getattr(config, self.normalize_top_k))


#: Sizes a ``Saved`` may name, per token (``layer``-region terms: once per layer).
SAVED_SIZES = (
    "hidden",  # hidden_size
    "q",  # query heads x head_dim
    "kv",  # key/value heads x head_dim
    "heads",  # query heads
    "mlp",  # the dense MLP's intermediate size
    "one",  # a scalar per token
    "vocab",  # vocabulary
    "experts",  # experts per MoE layer
    "topk",  # experts per token
    "expert_mlp",  # one expert's intermediate size
    "shared_mlp",  # a shared expert's intermediate size
)
#: Where a saved tensor lives, which decides how parallelism divides it.
SAVED_REGIONS = (
    "sequence",  # between parallel regions: sequence parallelism splits the tokens over TP
    "gathered",  # the all-gathered input of a parallel region: every token, whole
    "split",  # inside a parallel region: every token, heads/columns/vocabulary split over TP
    "routed",  # per (token, chosen expert) row of an MoE block: tokens x topk rows, whole
    "positions",  # per position, not per sequence (rotary tables)
)


@dataclass(frozen=True)
class Saved:
    """Tensors a part of the model saves for backward, sized per token it holds.

    The parallelism planner adds them up to predict saved activations (docs/planner.md).
    They describe what the Hugging Face implementation of a family saves (what PyTorch's
    autograd keeps of each op), read off a ``saved_tensors_hooks`` run, and the planner's
    validation measures them again (tests/distributed/test_planner_memory.py).

    Attributes:
        size: One of ``SAVED_SIZES``.
        dtype: ``"compute"`` (the activations' dtype), ``"float32"``, ``"int64"``, ``"int32"``
            or ``"bool"``.
        region: One of ``SAVED_REGIONS``.
        count: How many such tensors.
    """

    size: str
    dtype: str = "compute"
    region: str = "split"
    count: int = 1

    def __post_init__(self) -> None:
        if self.size not in SAVED_SIZES or self.region not in SAVED_REGIONS:
            raise ValueError(
                f"Saved({self.size!r}, region={self.region!r}): size must be one of "
                f"{SAVED_SIZES} and region one of {SAVED_REGIONS}."
            )


@dataclass(frozen=True)
class ActivationProfile:
    """What a family's Hugging Face implementation saves for backward, per part.

    Attributes:
        attention: A layer's attention half (its norm, projections, attention kernel).
        mlp: A dense layer's MLP half (its norm and MLP).
        moe: A sparse layer's MLP half with the model's own MoE block (router, experts), or
            empty for dense families.
        final: The final norm and the LM head's input.
        rotary_fraction_attr: Config attribute with the fraction of each head that rotary
            embeddings rotate (``None``: all of it).
    """

    attention: tuple[Saved, ...]
    mlp: tuple[Saved, ...]
    final: tuple[Saved, ...]
    moe: tuple[Saved, ...] = ()
    rotary_fraction_attr: str | None = None


@dataclass(frozen=True)
class ModelPolicy:
    """How to tensor-parallelize one model family.

    Attributes:
        name: Short family name (``"llama"``), used in messages.
        model_classes: Names of the Hugging Face model classes covered
            (``"LlamaForCausalLM"``); subclasses match too.
        layer_class: Name of the transformer layer class (``"LlamaDecoderLayer"``), the unit
            of FSDP wrapping, activation checkpointing and offloading.
        attention: Module-name pattern of the attention modules. They are tensor parallel
            regions (their random draws differ per TP rank) and get per-rank head counts.
        tp_plan: Module-name pattern (``fnmatch``, full names from the model root) to a
            style name in ``STYLES``. Every pattern must match at least one module.
        num_heads_attr: Config attribute holding the number of attention heads.
        num_kv_heads_attr: Config attribute holding the number of key/value heads, or
            ``None`` for multi-head attention (as many kv heads as heads).
        num_experts_attr: Config attribute holding the number of MoE experts, or ``None``.
        tp_split_sizes: Config attributes (besides the heads) whose value the plan splits
            evenly over the TP ranks, each with what is split (``{"intermediate_size": "the
            MLP's columns"}``); ``check_model`` requires the degree to divide them.
        moe: Where the mixture of experts lives (expert parallelism, ``MoELayer``), or ``None``.
        sliding_window_attr: Config attribute holding the sliding attention window (a value
            other than ``None`` means sliding-window attention, which context parallelism
            refuses), or ``None`` for families that always attend causally to everything.
        activations: What the family saves for backward (the parallelism planner's memory
            model), or ``None`` where it is not described.
        notes: Free text shown in the docs (limits, choices).
    """

    name: str
    model_classes: tuple[str, ...]
    layer_class: str
    attention: str
    tp_plan: Mapping[str, str]
    num_heads_attr: str = "num_attention_heads"
    num_kv_heads_attr: str | None = "num_key_value_heads"
    num_experts_attr: str | None = None
    tp_split_sizes: Mapping[str, str] = field(default_factory=dict)
    moe: MoESpec | None = None
    sliding_window_attr: str | None = None
    activations: ActivationProfile | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        unknown = {p: s for p, s in self.tp_plan.items() if s not in STYLES}
        if unknown:
            raise ValueError(
                f"policy {self.name!r}: unknown TP styles {unknown}; "
                f"known styles: {', '.join(STYLES)}."
            )

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` is (a subclass of) one of ``model_classes``."""
        return any(cls.__name__ in self.model_classes for cls in type(model).__mro__)

    def layer_cls(self, model: nn.Module) -> type[nn.Module]:
        """The transformer layer class of ``model`` (found among its modules by name).

        Raises:
            ValueError: If no module of ``model`` has class ``layer_class``.
        """
        for module in model.modules():
            if type(module).__name__ == self.layer_class:
                return type(module)
        raise ValueError(
            f"policy {self.name!r}: {type(model).__name__} has no "
            f"{self.layer_class} module; the policy does not fit this model."
        )

    def attention_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of every attention module of ``model``."""
        return [(n, m) for n, m in model.named_modules() if fnmatchcase(n, self.attention)]

    def head_counts(self, config: Any) -> tuple[int, int]:
        """``(num_heads, num_kv_heads)`` read from a Hugging Face config."""
        heads = int(getattr(config, self.num_heads_attr))
        kv = getattr(config, self.num_kv_heads_attr, None) if self.num_kv_heads_attr else None
        return heads, int(kv) if kv else heads

    def num_experts(self, config: Any) -> int:
        """Number of MoE experts (0 for dense models)."""
        return int(getattr(config, self.num_experts_attr)) if self.num_experts_attr else 0


@dataclass(frozen=True)
class HeadSplit:
    """How attention heads are spread over ``tp`` ranks.

    Attributes:
        num_heads: Query heads of the model.
        num_kv_heads: Key/value heads of the model.
        tp: Tensor parallel degree.
        local_heads: Query heads per rank.
        local_kv_heads: Key/value heads per rank.
        kv_replicated: True when ``num_kv_heads < tp``: each rank then holds the one kv head
            its query heads attend with, and ``tp // num_kv_heads`` ranks share each kv head.
    """

    num_heads: int
    num_kv_heads: int
    tp: int
    local_heads: int
    local_kv_heads: int
    kv_replicated: bool

    def kv_head_of(self, tp_rank: int) -> int:
        """First kv head held by ``tp_rank``."""
        if self.kv_replicated:
            return tp_rank * self.num_kv_heads // self.tp
        return tp_rank * self.local_kv_heads


def split_heads(num_heads: int, num_kv_heads: int, tp: int) -> HeadSplit:
    """Checks that ``tp`` can split the heads and returns the per-rank counts.

    Args:
        num_heads: Query heads.
        num_kv_heads: Key/value heads (``num_heads`` divisible by it).
        tp: Tensor parallel degree.

    Returns:
        The per-rank head counts.

    Raises:
        ValueError: If ``tp`` does not divide ``num_heads``, or neither divides the other
            for ``num_kv_heads`` and ``tp``.
    """
    if num_heads % tp:
        valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"tensor_parallel_degree={tp} does not divide num_attention_heads={num_heads}; "
            f"every rank must hold whole heads. Use a degree in {valid}."
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}; the model config is inconsistent."
        )
    if num_kv_heads % tp == 0:
        return HeadSplit(num_heads, num_kv_heads, tp, num_heads // tp, num_kv_heads // tp, False)
    if tp % num_kv_heads == 0:
        return HeadSplit(num_heads, num_kv_heads, tp, num_heads // tp, 1, True)
    raise ValueError(
        f"tensor_parallel_degree={tp} and num_key_value_heads={num_kv_heads}: one must "
        "divide the other (kv heads are split, or replicated when fewer than the degree). "
        f"Use a degree that divides {num_kv_heads} or a multiple of it."
    )


def check_model(policy: ModelPolicy, config: Any, tp: int) -> HeadSplit:
    """Validates ``config`` against ``tp`` (heads, experts) and returns the head split.

    Raises:
        ValueError: Naming the value, the rule and a fix.
    """
    if tp > 1 and not policy.tp_plan:
        raise ValueError(
            f"{policy.name}: tensor_parallel_degree={tp}, but the policy has no tensor parallel "
            "plan (its notes say what it supports instead). Use tensor_parallel_degree=1."
        )
    heads = split_heads(*policy.head_counts(config), tp)
    experts = policy.num_experts(config)
    if experts and experts % tp:
        raise ValueError(
            f"{policy.name}: tensor_parallel_degree={tp} does not divide the number of "
            f"experts ({policy.num_experts_attr}={experts}); each rank holds whole "
            "experts. Use a degree that divides the expert count."
        )
    for attr, what in policy.tp_split_sizes.items():
        size = getattr(config, attr, None)
        if isinstance(size, int) and size % tp:
            valid = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
            raise ValueError(
                f"{policy.name}: tensor_parallel_degree={tp} does not divide "
                f"{attr}={size}; {what} are split evenly over the tensor parallel "
                f"ranks. Use a degree that divides {size} ({valid}), or a model "
                f"whose {attr} is a multiple of {tp}."
            )
    return heads


__all__ = [
    "SAVED_REGIONS",
    "SAVED_SIZES",
    "STYLES",
    "ActivationProfile",
    "HeadSplit",
    "ModelPolicy",
    "MoESpec",
    "Saved",
    "check_model",
    "split_heads",
]
