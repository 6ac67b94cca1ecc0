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

from collections.abc import Callable, Mapping
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
    "router": (
        "an MoE router returning (logits, weights, indices), replicated; its logits plain, "
        "for the auxiliary load-balancing loss"
    ),
    "experts": "fused MoE experts (expert dim 0) split over the TP ranks",
    "reduce_scatter_output": "module output summed over TP ranks and split over the sequence",
    # The replicated-activation layout of transformers' own plans (policies built from a
    # model's base_model_tp_plan; tensor_parallel.replicated_styles): activations between
    # the split regions are whole plain tensors on every rank.
    "colwise_gather": "Linear split by output features; output all-gathered (whole)",
    "hidden_embedding": "Embedding split over the hidden dimension; output all-gathered",
    "rowwise_allreduce": "Linear split by input features; output all-reduced (whole on every rank)",
    "rowwise_split_input": "rowwise_allreduce whose input arrives whole and is split locally",
    "vocab_embedding_allreduce": "Embedding split over the vocabulary; output all-reduced",
    "replicate_local": (
        "a subtree outside the split regions: parameters replicated, computed on whole "
        "plain activations (checked on first use)"
    ),
    "replicate_partial_grad": (
        "parameters replicated, used on this rank's heads (per-head norms); gradients summed"
    ),
    "reduce_output": (
        "module computing with its split parameters' local values; output all-reduced"
    ),
    "local_params": "module computes with the local slices of its own split parameters",
    "experts_allreduce": "fused MoE experts split whole (dim 0); output all-reduced",
    "experts_allreduce_local_slots": (
        "experts_allreduce run on this rank's (token, choice) pairs only (DBRX's experts)"
    ),
    "experts_batched": (
        "experts run on expert-major row blocks (Llama 4), split whole; output all-reduced"
    ),
    "mla_kv_a_proj": "latent attention's shared kv down-projection; rotary slice's grad summed",
    "sequence_parallel_local": "norm on a sequence slice of its whole input; output gathered",
    "head_inputs": "attention whose ALiBi inputs (alibi, a per-head mask) are cut to its heads",
    "linear_packed_colwise": (
        "fused [q | k | v] (or [gate | up]) nn.Linear: weight whole, each rank computes its "
        "part of each block; gradient summed"
    ),
    "shared_kv_colwise": (
        "fused [q | k | v] Linear of multi-query attention: weight whole, each rank computes "
        "its query heads and the shared k/v; gradient summed"
    ),
    "conv1d_colwise": "colwise on transformers' Conv1D (weight stored transposed)",
    "conv1d_packed_colwise": (
        "Conv1D whose output is equal packed blocks ([q | k | v]), each split by output "
        "features: every rank keeps its part of every block"
    ),
    "conv1d_rowwise_allreduce": "rowwise_allreduce on transformers' Conv1D",
    "param_colwise": "a bare parameter split on its output dimension (e.g. one entry per head)",
    "param_rowwise": "a bare parameter split on its last dimension (1-D ones replicated)",
}


def config_value(config: Any, attr: str, default: Any = None) -> Any:
    """``config.<attr>``, also on a heterogeneous transformers config (per-layer values).

    Such a config refuses to read an attribute that may vary per layer; the value is then
    read from every layer's config and returned when the layers agree. A dotted ``attr``
    reads a nested config (DBRX's ``ffn_config.moe_num_experts``).

    Raises:
        ValueError: If the layers disagree (naming the attribute and the values).
    """
    if "." in attr:
        outer, _, rest = attr.partition(".")
        nested = config_value(config, outer)
        return default if nested is None else config_value(nested, rest, default)
    try:
        return getattr(config, attr, default)
    except AttributeError:
        return default
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        layers = getattr(config, "per_layer_config", None)
        values = (
            {getattr(layers[i], attr, default) for i in range(len(layers))} if layers else set()
        )
        if len(values) == 1:
            return values.pop()
        raise ValueError(
            f"{type(config).__name__}.{attr} differs between layers ({sorted(map(str, values))}); "
            f"describe the model with a ModelPolicy that does not need one {attr}."
        ) from None


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
        top_k_attr: Config attribute with the number of experts per token (dotted for a
            nested config: ``ffn_config.moe_top_k``).
        normalize_top_k: ``True``/``False``, or the config attribute saying whether the
            top-k gating weights are renormalized to sum to one.
        shared_expert: Child holding an always-active expert (Qwen2-MoE), or ``None``.
        shared_expert_gate: Child whose sigmoid scales the shared expert's output, or ``None``.
        jitter_attr: Block attribute with the router jitter noise, or ``None``.
        replaceable: Whether ``MoELayer`` may replace the block (``smp_moe=True``): the
            router's semantics are the ones ``MoELayer`` implements. ``False`` for blocks
            known only from a transformers plan, whose experts expert parallelism splits
            while the model's own block and router run (``smp_moe=False``).
    """

    block_class: str
    router: str = "gate"
    experts: str = "experts"
    top_k_attr: str = "num_experts_per_tok"
    normalize_top_k: bool | str = True
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    jitter_attr: str | None = None
    replaceable: bool = True

    def top_k(self, config: Any) -> int:
        """Experts per token."""
        return int(config_value(config, self.top_k_attr))

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
    "keys",  # the keys a query is scored against (the whole sequence): an attention mask's row
    "kv_heads",  # the key/value heads (one per head: a per-head norm's statistics of the keys)
    "scores",  # attention scores of every head against every key (eager attention)
    # Multi-head latent attention's (DeepSeek V2/V3; planner/model.py, LatentAttention):
    "q_lora",  # the query's latent rank
    "kv_lora",  # the key/value latent's rank
    "rope",  # the rotary part of a key, which every head shares
    "heads_nope",  # query heads x a key head's part without rotary
    "heads_v",  # query heads x a value head
)
#: Where a saved tensor lives, which decides how parallelism divides it.
SAVED_REGIONS = (
    "sequence",  # between parallel regions: sequence parallelism splits the tokens over TP
    "gathered",  # the all-gathered input of a parallel region: every token, whole
    "split",  # inside a parallel region: every token, heads/columns/vocabulary split over TP
    "routed",  # per (token, chosen expert) row of an MoE block: tokens x topk rows, whole
    # per (token, expert) row of a block whose experts compute every token (Llama 4's):
    "every_expert",  # tokens x experts rows, whole (the block's input repeated per expert)
    "own_experts",  # tokens x the experts this TP rank holds (inside its experts module)
    "positions",  # per position, not per sequence (rotary tables)
    "local",  # a rank's slice of a whole activation it splits itself: divided over TP always
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
        dtype: ``"compute"`` (the activations' dtype), ``"float32"``, ``"int64"``, ``"int32"``,
            ``"bool"`` or ``"complex64"``.
        region: One of ``SAVED_REGIONS``.
        count: How many such tensors.
        cast: Each is a cast of another saved tensor between the compute dtype and float32
            (``softmax(..., dtype=float32).to(x.dtype)``): a storage of its own under
            bfloat16 compute, the same storage as its source under float32 compute, where
            the cast returns its input.
    """

    size: str
    dtype: str = "compute"
    region: str = "split"
    count: int = 1
    cast: bool = False

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
        attention_by_kind: A layer's attention half by the layer's kind, where kinds save
            different tensors (``planner.layer_kinds.layer_kind``: Llama 4's layers without rotary
            embeddings), as ``(kind, terms)`` pairs; a layer whose kind is not listed uses
            ``attention``.
        masked_attention: A layer's attention half when Hugging Face passes its attention an
            explicit mask (a sliding window no longer than the sequence), or empty where the
            family never does (then ``attention`` is used).
        rotary_fraction_attr: Config attribute with the fraction of each head that rotary
            embeddings rotate (``None``: all of it).
        rotary_tables: How many pairs of rotary tables (cos and sin per position, saved once
            for all layers) the layers save: 0 without rotary embeddings, 2 where local and
            global layers rotate with different bases (Gemma 3).
        rotary_dtype: The tables' dtype: ``"compute"``, or ``"float32"`` where the family
            keeps them in float32 whatever the activations' dtype (OLMo 2).
        rotary_half_width: Each table holds one value per rotated pair of channels, half
            the rotary width (GPT-OSS rotates the two halves of a head with one cos and one
            sin per pair), not the values repeated over both halves (Llama).
        no_gradient: Parameters no output of the forward reaches, as ``fnmatch`` patterns of
            their names (``*`` for a layer's number): they get no gradient, and no AdamW
            state where the gradient is the parameter's own (FSDP2). A head's own bias that
            the untied output projection does not use (the BERT family's
            ``cls.predictions.bias`` with ``tie_word_embeddings`` false) is one.
        probed: Whether the profile was measured on reduced copies of the model
            (``torch_sagemaker/planner/probe.py``) rather than written for the family.
    """

    attention: tuple[Saved, ...]
    mlp: tuple[Saved, ...]
    final: tuple[Saved, ...]
    moe: tuple[Saved, ...] = ()
    masked_attention: tuple[Saved, ...] = ()
    attention_by_kind: tuple[tuple[tuple[tuple[str, Any], ...], tuple[Saved, ...]], ...] = ()
    rotary_fraction_attr: str | None = None
    rotary_tables: int = 1
    rotary_dtype: str = "compute"
    rotary_half_width: bool = False
    no_gradient: tuple[str, ...] = ()
    probed: bool = False


#: Styles whose output leaves a parallel region split over the sequence.
_SEQUENCE_SPLITTING_STYLES = ("rowwise", "reduce_scatter_output")


@dataclass(frozen=True)
class ModelPolicy:
    """How to tensor-parallelize one model family.

    Attributes:
        name: Short family name (``"llama"``), used in messages.
        model_classes: Names of the Hugging Face model classes covered
            (``"LlamaForCausalLM"``); subclasses match too.
        layer_class: Name of the transformer layer class (``"LlamaDecoderLayer"``), the unit
            of FSDP wrapping, activation checkpointing and offloading.
        attention: Module-name pattern (or patterns) of the attention modules. They are
            tensor parallel regions (their random draws differ per TP rank) and get per-rank
            head counts.
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
        heads_split: Whether the plan splits the attention heads over the TP ranks (then the
            degree must divide them). ``False`` when the attention projections are gathered
            (``colwise_gather``) and every rank computes every head.
        activations: What the family saves for backward (the parallelism planner's memory
            model), or ``None`` where it is not described.
        width_attrs: Attention attributes holding the width of all heads together that this
            family reshapes by, each with the attribute of one head's size, beyond
            ``module_layout.FULL_WIDTH_ATTRS`` (XGLM's ``("embed_dim", "head_dim")``; the same
            name means something else in other families): scaled to the rank's heads. The
            head size attribute is ``None`` where the module keeps none (OpenAI-GPT's
            ``split_size``): the width is then scaled by the rank's share of the heads.
        layout_check: For families some of whose configs the plan cannot split (a fused
            projection laid out differently, model code that reads a split weight directly):
            ``(config, tp) -> reason`` why the plan cannot split that config's model at
            degree ``tp`` (naming the config attribute), ``""`` where it can;
            ``check_model`` raises with the reason.
        notes: Free text shown in the docs (limits, choices).
    """

    name: str
    model_classes: tuple[str, ...]
    layer_class: str
    attention: str | tuple[str, ...]
    tp_plan: Mapping[str, str]
    num_heads_attr: str = "num_attention_heads"
    num_kv_heads_attr: str | None = "num_key_value_heads"
    num_experts_attr: str | None = None
    tp_split_sizes: Mapping[str, str] = field(default_factory=dict)
    moe: MoESpec | None = None
    sliding_window_attr: str | None = None
    activations: ActivationProfile | None = None
    heads_split: bool = True
    width_attrs: tuple[tuple[str, str | None], ...] = ()
    layout_check: Callable[[Any, int], str] | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        unknown = {p: s for p, s in self.tp_plan.items() if s not in STYLES}
        if unknown:
            raise ValueError(
                f"policy {self.name!r}: unknown TP styles {unknown}; "
                f"known styles: {', '.join(STYLES)}."
            )

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan splits the residual stream over the TP ranks.

        Sequence parallelism: region outputs reduce-scattered over the sequence, rather than
        all-reduced whole onto every rank between parallel regions.
        """
        return any(s in _SEQUENCE_SPLITTING_STYLES for s in self.tp_plan.values())

    @property
    def mlp_split(self) -> bool:
        """Whether the MLP's intermediate activations are split over the TP ranks.

        ``False`` where the plan gathers the outputs of a layer's projections outside
        attention (``colwise_gather`` on a pattern with a wildcard, which names a module of
        every layer; every rank then computes the whole MLP). A gathered output embedding
        (``lm_head``, named without one) does not count.
        """
        patterns = (self.attention,) if isinstance(self.attention, str) else self.attention
        return not any(
            style == "colwise_gather"
            and "*" in pattern
            and not any(fnmatchcase(pattern, f"{a}.*") for a in patterns)
            for pattern, style in self.tp_plan.items()
        )

    @property
    def vocab_parallel_logits(self) -> bool:
        """Whether the plan keeps the logits split over the vocabulary.

        Style ``lm_head``, with the vocabulary-parallel loss, rather than gathered whole.
        """
        return "lm_head" in self.tp_plan.values()

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
        patterns = (self.attention,) if isinstance(self.attention, str) else self.attention
        return [
            (n, m)
            for n, m in model.named_modules()
            if any(fnmatchcase(n, pattern) for pattern in patterns)
        ]

    def head_counts(self, config: Any) -> tuple[int, int]:
        """``(num_heads, num_kv_heads)`` read from a Hugging Face config."""
        heads = int(config_value(config, self.num_heads_attr))
        kv = config_value(config, self.num_kv_heads_attr) if self.num_kv_heads_attr else None
        return heads, int(kv) if kv else heads

    def num_experts(self, config: Any) -> int:
        """Number of MoE experts (0 for dense models)."""
        return int(config_value(config, self.num_experts_attr)) if self.num_experts_attr else 0


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
            f"policy {policy.name!r} has no tensor parallel plan, so "
            f"tensor_parallel_degree={tp} cannot split {type(config).__name__}'s model "
            f"({policy.notes}). Use tensor_parallel_degree=1 (expert parallelism, "
            "expert_parallel_degree, works), or register a policy with a tp_plan."
        )
    reason = policy.layout_check(config, tp) if policy.layout_check and tp > 1 else ""
    if reason:
        raise ValueError(
            f"{policy.name}: tensor_parallel_degree={tp} cannot split this "
            f"{type(config).__name__}'s model: {reason}."
        )
    if policy.heads_split:
        heads = split_heads(*policy.head_counts(config), tp)
    else:  # every rank computes every head (gathered projections)
        num_heads, num_kv_heads = policy.head_counts(config)
        heads = HeadSplit(num_heads, num_kv_heads, tp, num_heads, num_kv_heads, False)
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
    "config_value",
    "check_model",
    "split_heads",
]
