"""Saved activations per rank: the family's ``ActivationProfile`` sized by the layout.

A family's policy says what its Hugging Face implementation saves per token
(``torch_sagemaker/policies/activations.py``); this module adds what the library itself
saves (the vocabulary-parallel loss, ``MoELayer``'s routing and dispatch), sizes every term
for the tokens and heads one rank holds, and applies activation checkpointing and offloading
as the library implements them:

- Tokens: a rank holds ``micro_batch x seq_len / cp`` tokens; between parallel regions
  (norms, the residual stream) sequence parallelism splits them over the TP ranks; inside a
  region heads, MLP columns and the vocabulary are split; an MoE block's rows are its tokens
  times the experts each token picks (balanced routing assumed: with expert parallelism a
  rank receives, on average, as many rows as its tokens chose).
- Sliding windows: a layer whose window is no longer than the sequence gets an explicit
  mask, which makes its attention save more (the profile's ``masked_attention``; Note
  [Masked attention saves more] in ``torch_sagemaker/policies/activations.py``).
- Checkpointing (``checkpoint_transformer_layers``, non-reentrant): a layer keeps only its
  input, the residual stream (sequence-split under TP); the rotary tables then travel in the
  checkpoint's closure, not as saved tensors, and so does a sliding window's boolean mask,
  which is counted (Note [A checkpoint's closure keeps the mask]).
- Offloading (``offload_wrapper``): each layer's saved storages go to the host as they are
  saved; at most ``activation_loading_horizon + 1`` layers are back on the device at once
  (the schedule, docs/offload.md). What the layers' surroundings save stays on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_sagemaker.planner.layer_kinds import layer_kind
from torch_sagemaker.planner.model import ModelSpec, expert_mlp_attr
from torch_sagemaker.policies import HeadSplit
from torch_sagemaker.policies.model_policy import ActivationProfile, Saved
from torch_sagemaker.topology import Layout

DTYPE_BYTES = {"float32": 4, "int64": 8, "int32": 4, "bool": 1, "complex64": 8}

#: Hugging Face's causal LM loss without TP: the float32 log-softmax over the vocabulary, the
#: shifted labels, a float32 scalar weight.
HF_LOSS: tuple[Saved, ...] = (
    Saved("vocab", "float32", "gathered"),
    Saved("one", "int64", "gathered"),
)
#: The library's vocabulary-parallel loss (``tensor_parallel/loss.py``): the float32 softmax
#: of the rank's vocabulary slice, the targets and two masks.
VOCAB_PARALLEL_LOSS: tuple[Saved, ...] = (
    Saved("vocab", "float32", "split"),
    Saved("one", "int64", "gathered"),
    Saved("one", "bool", "gathered", 2),
)
#: The embedding's saved input: the token ids.
EMBEDDING: tuple[Saved, ...] = (Saved("one", "int64", "gathered"),)
#: ``MoELayer`` (``tsm.transform`` with an MoEConfig) after its norm: the model's router's
#: softmax (its top-k and their renormalisation, which ``MoELayer`` does not use, autograd
#: frees during the forward), the library's routing again in float32 and its z-loss; per
#: row, the dispatch and combine indices, the received and returned rows, the experts'
#: grouped GEMMs (as in the model's block) and the weights that scale the rows.
MOE_LAYER: tuple[Saved, ...] = (
    Saved("experts", "float32", "gathered", 3),
    Saved("topk", "int64", "gathered"),
    Saved("one", "float32", "gathered", 2),
    Saved("topk", "float32", "gathered"),
    Saved("one", "int64", "routed", 4),
    Saved("one", "bool", "routed"),
    Saved("hidden", "compute", "routed", 3),
    Saved("expert_mlp", "compute", "routed", 4),
    Saved("one", "float32", "routed", 2),
)


@dataclass(frozen=True)
class ActivationShape:
    """What sizes one rank's activations.

    Attributes:
        layout: The rank layout (tp, cp, ep).
        heads: The head split over the TP ranks.
        micro_batch: Sequences per forward on this rank.
        seq_len: Tokens per whole sequence.
        compute_bytes: Bytes of the compute dtype.
        moe_layer: Whether MoE blocks are the library's ``MoELayer`` (an MoEConfig).
        tp_rank: The TP rank (uneven splits give rank 0 the largest part).
    """

    layout: Layout
    heads: HeadSplit
    micro_batch: int
    seq_len: int
    compute_bytes: int
    moe_layer: bool = False
    tp_rank: int = 0


@dataclass(frozen=True)
class ActivationBytes:
    """One rank's saved activations at the end of the forward pass.

    Attributes:
        layer: What one transformer layer saves without checkpointing (each layer's own
            activations, rebuilt by the recomputation in backward when checkpointed).
        layers: What all layers keep on the device (their inputs with checkpointing; the
            resident ones with offloading).
        outside: What the model saves around its layers (embedding, final norm, head, loss,
            rotary tables).
        offloaded: What offloading keeps on the host instead (0 without it).
        logits: The logits the forward returns (live, not saved).
    """

    layer: int
    layers: int
    outside: int
    offloaded: int
    logits: int

    @property
    def saved(self) -> int:
        """Saved activations on the device at the end of forward."""
        return self.layers + self.outside


def _chunk(size: int, parts: int, index: int) -> int:
    step = math.ceil(size / parts)
    return max(0, min(step, size - index * step))


def _part(size: int, parts: int, index: int, split: bool) -> int:
    """A rank's part of ``size``: its chunk where the plan splits it, else all of it."""
    return _chunk(size, parts, index) if split else size


def _profile(spec: ModelSpec) -> ActivationProfile:
    profile = spec.policy.activations
    if profile is None:
        raise ValueError(
            f"policy {spec.policy.name!r} does not describe what its layers save for backward "
            "(ModelPolicy.activations), so the planner cannot size its activations; see "
            "docs/planner.md."
        )
    return profile


class _Sizer:
    """Sizes ``Saved`` terms for one rank."""

    def __init__(self, spec: ModelSpec, shape: ActivationShape) -> None:
        layout, heads = shape.layout, shape.heads
        tp, head_dim = layout.tp, spec.head_dim
        local_seq = shape.seq_len // layout.cp
        self.tokens = shape.micro_batch * local_seq
        # Plans that all-reduce region outputs (transformers' own) keep the stream whole.
        policy = spec.policy
        stream = _chunk(local_seq, tp, shape.tp_rank) if policy.sequence_parallel else local_seq
        self.rows = {
            "sequence": shape.micro_batch * stream,
            "gathered": self.tokens,
            "split": self.tokens,
            "positions": local_seq,
        }
        top_k = spec.policy.moe.top_k(spec.config) if spec.policy.moe else 0
        self.rows["routed"] = self.tokens * top_k
        # Note [Experts on every token] in probe_runs.py: TP splits such experts whole.
        experts = spec.num_experts or 0
        self.rows["every_expert"] = self.tokens * experts
        self.rows["own_experts"] = self.tokens * _chunk(experts, tp, shape.tp_rank)
        self.rows["local"] = self.tokens
        # A mask row spans every key of the sequence; context parallelism, which would cut
        # the keys, refuses sliding windows (the only masks modelled).
        num_heads, num_kv = heads.num_heads, heads.num_kv_heads
        expert_attr = expert_mlp_attr(spec.config)
        expert_mlp = (spec.dim(expert_attr, 0) if expert_attr else 0) or spec.mlp_size
        self.whole = {
            "hidden": spec.dim("hidden_size"),
            "q": num_heads * head_dim,
            "kv": num_kv * head_dim,
            "heads": num_heads,
            "mlp": spec.mlp_size,
            "one": 1,
            "vocab": spec.dim("vocab_size"),
            "experts": spec.num_experts,
            "topk": top_k,
            "expert_mlp": expert_mlp,
            "shared_mlp": spec.dim("shared_expert_intermediate_size", 0),
            "keys": shape.seq_len,
            "kv_heads": num_kv,
            "scores": num_heads * shape.seq_len,
        }
        latent = spec.latent
        if latent is not None:
            self.whole.update(latent.size_values(num_heads))
        self.split = dict(self.whole)
        if latent is not None:
            self.split.update(latent.size_values(heads.local_heads))
        self.split.update(
            q=heads.local_heads * head_dim,
            kv=heads.local_kv_heads * head_dim,
            heads=heads.local_heads,
            kv_heads=heads.local_kv_heads,
            scores=heads.local_heads * shape.seq_len,
            mlp=_part(self.whole["mlp"], tp, shape.tp_rank, policy.mlp_split),
            # a shared expert's columns, split like a dense MLP's (routed experts' rows are
            # sized whole: TP splits the experts, not their columns)
            expert_mlp=_part(self.whole["expert_mlp"], tp, shape.tp_rank, policy.mlp_split),
            shared_mlp=_part(self.whole["shared_mlp"], tp, shape.tp_rank, policy.mlp_split),
            vocab=_part(self.whole["vocab"], tp, shape.tp_rank, policy.vocab_parallel_logits),
        )
        self.local = {k: _chunk(v, tp, shape.tp_rank) for k, v in self.whole.items()}
        self.compute_bytes = shape.compute_bytes

    def bytes(self, terms: tuple[Saved, ...]) -> int:
        total = 0
        for t in terms:
            sizes = {"split": self.split, "local": self.local}.get(t.region, self.whole)
            size = sizes[t.size]
            width = self.compute_bytes if t.dtype == "compute" else DTYPE_BYTES[t.dtype]
            if t.cast and self.compute_bytes == DTYPE_BYTES["float32"]:
                continue  # the cast returned its source, counted in its own term
            total += t.count * self.rows[t.region] * size * width
        return total


def rotary_width(spec: ModelSpec, fraction_attr: str | None = None) -> int:
    """The rotary tables' width per position: the part of a head that rotary rotates.

    Transformers 5 keeps the fraction in ``rope_parameters["partial_rotary_factor"]``
    (GPT-NeoX's ``rotary_pct`` is folded into it and no longer an attribute); older configs
    keep it in ``fraction_attr`` (a profile's ``rotary_fraction_attr``). Either, in that order,
    else all of it.
    """
    fraction = 1.0
    rope = getattr(spec.config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
        fraction = float(rope["partial_rotary_factor"])
    elif fraction_attr:
        value = getattr(spec.config, fraction_attr, None)
        fraction = 1.0 if value is None else float(value)
    return int(spec.head_dim * fraction)


def window_layers(spec: ModelSpec, seq_len: int) -> set[int]:
    """Indices of the layers with a sliding window no longer than ``seq_len`` tokens.

    Every layer of a family with the window (Mistral, Mixtral), or the config's
    ``layer_types`` marked ``"sliding_attention"`` where it lists them (Qwen2 with
    ``use_sliding_window``, from ``max_window_layers`` on). Empty when the policy names no
    window attribute or the config sets none.
    """
    attr = spec.policy.sliding_window_attr
    window = getattr(spec.config, attr, None) if attr else None
    if window is None or seq_len < int(window):  # transformers skips the mask then
        return set()
    types = getattr(spec.config, "layer_types", None)
    if types is None:
        return set(range(spec.num_layers))
    return {i for i, kind in enumerate(types[: spec.num_layers]) if kind == "sliding_attention"}


def masked_layers(spec: ModelSpec, seq_len: int) -> set[int]:
    """Indices of the layers whose attention gets an explicit mask at ``seq_len`` tokens.

    The ``window_layers`` (Note [Masked attention saves more]), where the profile describes
    masked attention (``masked_attention``); empty otherwise.
    """
    profile = spec.policy.activations
    if profile is None or not profile.masked_attention:
        return set()
    return window_layers(spec, seq_len)


def rotary_bytes(spec: ModelSpec, positions: int, compute_bytes: int) -> int:
    """The rotary tables' bytes: cos and sin for ``positions`` positions, saved once."""
    profile = _profile(spec)
    width = rotary_width(spec, profile.rotary_fraction_attr)
    if profile.rotary_half_width:
        width //= 2
    dtype = profile.rotary_dtype
    dtype_bytes = compute_bytes if dtype == "compute" else DTYPE_BYTES[dtype]
    return profile.rotary_tables * 2 * positions * width * dtype_bytes


def experts_on_every_token(spec: ModelSpec) -> bool:
    """Whether the model's own MoE blocks run every expert on every token (Llama 4's).

    Read from what the profile says they save (Note [Experts on every token] in
    ``probe_runs.py``).
    """
    profile = spec.policy.activations
    every = ("every_expert", "own_experts")
    return profile is not None and any(t.region in every for t in profile.moe)


def sparse_layers(spec: ModelSpec) -> set[int]:
    """Indices of the layers with an MoE block (those holding expert weights)."""
    return {int(p.unit.partition(".")[2]) for p in spec.params if p.expert}


def activation_bytes(
    spec: ModelSpec,
    shape: ActivationShape,
    *,
    checkpointing: bool,
    offload: bool,
    horizon: int,
) -> ActivationBytes:
    """One rank's saved activations at the end of a forward pass (module docstring).

    Raises:
        ValueError: If the model's policy has no ``ActivationProfile``.
    """
    profile = _profile(spec)
    size = _Sizer(spec, shape)
    sparse = sparse_layers(spec)
    moe_terms = profile.moe
    if shape.moe_layer:  # the block's norm, then the library's layer
        # The block's norm: the MLP half's terms between the parallel regions (a dense
        # layer's, or a sparse one's where every layer is sparse), and the norm's output.
        norm = tuple(t for t in (profile.mlp or profile.moe) if t.region == "sequence")
        moe_terms = norm + (Saved("hidden", "compute", "gathered"),) + MOE_LAYER
    masked = masked_layers(spec, shape.seq_len)
    masked_bytes = size.bytes(profile.masked_attention) if masked else 0
    # Note [Layer kinds] in layer_kinds.py: a layer's attention by its kind, where kinds differ.
    by_kind = {kind: size.bytes(terms) for kind, terms in profile.attention_by_kind}
    unmasked = size.bytes(profile.attention)
    dense_mlp = size.bytes(profile.mlp)
    sparse_mlp = size.bytes(moe_terms) if sparse else 0
    per_layer = [
        (
            masked_bytes
            if index in masked
            else by_kind.get(layer_kind(spec.config, index), unmasked)
            if by_kind
            else unmasked
        )
        + (sparse_mlp if index in sparse else dense_mlp)
        for index in range(spec.num_layers)
    ]
    layer_input = size.bytes((Saved("hidden", "compute", "sequence"),))
    kept = [layer_input] * spec.num_layers if checkpointing else per_layer
    vocab_parallel = shape.layout.tp > 1 and spec.policy.vocab_parallel_logits
    loss = VOCAB_PARALLEL_LOSS if vocab_parallel else HF_LOSS
    outside = size.bytes(EMBEDDING + profile.final + loss)
    if not checkpointing:
        outside += rotary_bytes(spec, size.rows["positions"], shape.compute_bytes)
    elif masked:
        # Note [A checkpoint's closure keeps the mask]
        #     Under non-reentrant checkpointing a layer's arguments stay referenced by its
        #     recomputation until its backward, so the boolean sliding-window mask that the
        #     model builds once, a [1, 1, s, s] tensor expanded over the batch (s * s bytes),
        #     lives from the forward to the first layer's backward (a weak reference to it
        #     dies after the forward without checkpointing and survives it with). A
        #     saved_tensors_hooks does not see it, so the validation's count is lower by it.
        outside += shape.seq_len * shape.seq_len
    offloaded = 0
    layers = sum(kept)
    if offload:
        resident = sorted(kept, reverse=True)[: horizon + 1]
        offloaded = layers
        layers = sum(resident)
    logits = (
        size.tokens * (size.split if vocab_parallel else size.whole)["vocab"] * shape.compute_bytes
    )
    return ActivationBytes(
        layer=max(per_layer) if per_layer else 0,
        layers=layers,
        outside=outside,
        offloaded=offloaded,
        logits=logits,
    )


__all__ = [
    "ActivationBytes",
    "ActivationShape",
    "HF_LOSS",
    "MOE_LAYER",
    "VOCAB_PARALLEL_LOSS",
    "activation_bytes",
    "experts_on_every_token",
    "masked_layers",
    "rotary_bytes",
    "rotary_width",
    "sparse_layers",
    "window_layers",
]
