"""The sizes of the probe's runs, and the reduced configs that give a model those sizes.

``base_sizes(spec)`` picks small, distinct sizes for the sizes a config has; ``variations``
yields the runs (the base sizes, then each changed alone, then several at once: Note
[Probing what a family saves] in ``probe.py``); ``reduced_config`` writes one run's sizes
into a copy of the config; ``size_values`` names each size's value in a run, as the planner's
sizer reads it from the real config (``activations._Sizer``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch_sagemaker.planner.layer_kinds import LAYER_KIND_ATTRS, layer_kind
from torch_sagemaker.planner.model import LatentAttention, ModelSpec, expert_mlp_attr, mlp_size_attr
from torch_sagemaker.policies.model_policy import config_value

#: Tokens per sequence of the base run, and the sliding window of the windowed runs.
SEQ = 26
WINDOW = 8
_MAX_LAYERS = 6


class ProbeError(ValueError):
    """The probe cannot describe what the family saves (the message says why)."""


@dataclass(frozen=True)
class Sizes:
    """The sizes of one probe run (``None``: the config has no such size)."""

    hidden: int
    heads: int
    kv_heads: int | None
    head_dim: int | None
    mlp: int | None
    vocab: int
    seq: int
    experts: int | None
    top_k: int | None
    expert_mlp: int | None
    shared_mlp: int | None
    latent: LatentAttention | None = None  # multi-head latent attention's sizes


def base_sizes(spec: ModelSpec) -> Sizes:
    """The first run's sizes: small, distinct, and only those the config has."""
    config = spec.config
    heads, kv = spec.heads
    # (Falcon's config computes head_dim from the hidden size: a property, not a size of its own)
    explicit_head_dim = getattr(config, "head_dim", None) is not None and not isinstance(
        getattr(type(config), "head_dim", None), property
    )
    if kv == heads:
        kv_heads: int | None = None  # multi-head attention: kv heads follow the heads
    elif kv == 1:
        kv_heads = 1
    else:
        kv_heads = 2
    experts = spec.num_experts or None
    moe = spec.policy.moe
    latent = spec.latent
    if latent is not None:  # its head sizes are its own (Note [Latent attention's sizes])
        explicit_head_dim = False
        latent = LatentAttention(
            q_lora=40 if latent.q_lora else None, kv_lora=32, rope=8, nope=16, v_head=40
        )
    return Sizes(
        hidden=80 if explicit_head_dim or latent else 96,
        heads=6,
        kv_heads=kv_heads,
        head_dim=16 if explicit_head_dim else None,
        mlp=88 if spec.mlp_size else None,
        vocab=200,
        seq=SEQ,
        experts=6 if experts else None,
        top_k=2 if experts and moe is not None else None,
        expert_mlp=40 if expert_mlp_attr(config) else None,
        shared_mlp=72 if getattr(config, "shared_expert_intermediate_size", None) else None,
        latent=latent,
    )


def variations(base: Sizes) -> Iterator[Sizes]:
    """The base sizes, then each size changed alone."""
    yield base
    yield dataclasses.replace(base, hidden=base.hidden + 48)
    yield dataclasses.replace(base, heads=12)  # kv heads 2 and 1 divide 12
    if base.head_dim is not None:
        yield dataclasses.replace(base, head_dim=24)
    if base.kv_heads == 2:  # not 1: repeating a single kv head is a view, not a copy
        yield dataclasses.replace(base, kv_heads=3)
    for field, value in (
        ("mlp", 104),
        ("experts", 8),
        ("top_k", 3),
        ("expert_mlp", 48),
        ("shared_mlp", 64),
    ):
        if getattr(base, field) is not None:
            changed: dict[str, Any] = {field: value}
            yield dataclasses.replace(base, **changed)
    if base.latent is not None:
        for field, value in (("q_lora", 56), ("kv_lora", 48), ("rope", 16), ("nope", 24)):
            if getattr(base.latent, field) is not None:
                yield _with_latent(base, **{field: value})
        yield _with_latent(base, v_head=48)
    # The widths of heads are products (heads x head size): with each size changed alone,
    # the heads, the key/value heads and their widths would be linearly dependent over the
    # runs, so one run changes them all.
    products = dataclasses.replace(
        base,
        hidden=base.hidden + 96,  # without a head size of its own: 192 / 12 heads = 16
        heads=12,
        kv_heads=3 if base.kv_heads == 2 else base.kv_heads,
        head_dim=24 if base.head_dim is not None else None,
    )
    yield _with_latent(products, rope=16, nope=24, v_head=48) if base.latent else products
    yield dataclasses.replace(base, vocab=232)
    yield dataclasses.replace(base, seq=34)
    # One more run than there are sizes, changing several at once, so that a width the
    # sizes do not make cannot be fitted exactly by chance.
    several = _with_latent(base, q_lora=64, kv_lora=40) if base.latent else base
    yield dataclasses.replace(
        several,
        mlp=base.mlp and 120,
        vocab=264,
        seq=30,
        experts=base.experts and 4,
        expert_mlp=base.expert_mlp and 64,
        shared_mlp=base.shared_mlp and 88,
    )


def _with_latent(sizes: Sizes, **changes: int) -> Sizes:
    """``sizes`` with latent attention's sizes ``changes`` (a query rank only where it has one)."""
    latent = sizes.latent
    assert latent is not None
    if latent.q_lora is None:
        changes.pop("q_lora", None)
    changed: LatentAttention = dataclasses.replace(latent, **changes)
    return dataclasses.replace(sizes, latent=changed)


def _set(config: Any, attr: str | None, value: Any) -> None:
    """Sets ``attr`` (dotted: in a nested config) where the config gives it a value."""
    if not attr or config_value(config, attr) is None:
        return
    outer, _, last = attr.rpartition(".")
    setattr(config_value(config, outer) if outer else config, last, value)


def _nested_configs(config: Any) -> list[Any]:
    """``config`` and the configs it holds as attributes (DBRX's ``ffn_config``)."""
    from transformers import PretrainedConfig

    return [config] + [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]


def _kind_layers(spec: ModelSpec, layers: int) -> list[int]:
    """The real layers whose kinds the reduced copy's ``layers`` layers take, in order.

    The first ``layers``, but where a kind appears only later (a pattern longer than the
    copy), the last of them give way to the first layer of each such kind (Note [Layer
    kinds]).
    """
    kinds = [layer_kind(spec.config, i) for i in range(spec.num_layers)]
    chosen = list(range(layers))
    seen = {kinds[i] for i in chosen}
    missing: list[int] = []
    for index, kind in enumerate(kinds):
        if kind not in seen:
            seen.add(kind)
            missing.append(index)
    if missing and len(missing) < layers:
        chosen = chosen[: layers - len(missing)] + missing
    return chosen


def reduced_config(spec: ModelSpec, sizes: Sizes, window: int | None) -> Any:
    """A copy of ``spec``'s config with ``sizes`` (and ``window``) written into it."""
    config = copy.deepcopy(spec.config)
    policy = spec.policy
    layers = min(spec.num_layers, _MAX_LAYERS)
    config.num_hidden_layers = layers
    chosen = _kind_layers(spec, layers)
    for attr in LAYER_KIND_ATTRS:  # one entry per layer (Note [Layer kinds])
        values = getattr(config, attr, None)
        if isinstance(values, list | tuple):
            setattr(config, attr, [values[i] for i in chosen if i < len(values)])
    # Sizes the config keeps under other names equal to the hidden size (OPT's
    # word_embed_proj_dim) follow it, so that they shrink and change with it.
    # So do a nested config's (DBRX's ffn_config.hidden_size, its router's input width).
    hidden = spec.dim("hidden_size")
    for owner in _nested_configs(config):
        for attr, value in list(vars(owner).items()):
            named = any(word in attr for word in ("dim", "size", "embed"))
            top_hidden = owner is config and attr == "hidden_size"
            if named and not top_hidden and type(value) is int and value == hidden:
                setattr(owner, attr, sizes.hidden)
    config.hidden_size = sizes.hidden
    setattr(config, policy.num_heads_attr, sizes.heads)
    if policy.num_kv_heads_attr:
        kv = sizes.kv_heads if sizes.kv_heads is not None else sizes.heads
        _set(config, policy.num_kv_heads_attr, kv)
    if sizes.head_dim is not None:
        config.head_dim = sizes.head_dim
    if sizes.latent is not None:
        _set_latent(spec, config, sizes.latent)
    _set(config, mlp_size_attr(config), sizes.mlp)
    config.vocab_size = sizes.vocab
    for attr in [a for a in vars(config) if a.endswith("_token_id")]:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= sizes.vocab:  # an id the vocabulary lost
            setattr(config, attr, 0)
    _set(config, policy.num_experts_attr, sizes.experts)
    if policy.moe is not None:
        _set(config, policy.moe.top_k_attr, sizes.top_k)
    _set(config, expert_mlp_attr(config), sizes.expert_mlp)
    # Group-limited routing (DeepSeek V3's experts in n_group groups, of which topk_group are
    # searched) divides the experts into groups; one group of the probe's experts keeps the
    # division whole. It only picks indices, and autograd frees what that saves during the
    # forward (Note [Storages the forward frees] in probe_runs.py), so one group saves the
    # same as many.
    if isinstance(getattr(config, "n_group", None), int) and config.n_group > 1:
        config.n_group = 1
        _set(config, "topk_group", 1)
    _set(config, "shared_expert_intermediate_size", sizes.shared_mlp)
    if policy.sliding_window_attr and getattr(config, policy.sliding_window_attr, None):
        setattr(config, policy.sliding_window_attr, window)
    if getattr(config, "max_position_embeddings", None) is not None:
        config.max_position_embeddings = max(int(config.max_position_embeddings), 64)
    return config


# Note [Latent attention's sizes]
#     Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, ...) has head sizes of its own
#     (``LatentAttention``): the query's and the shared key/value latent's ranks, the rotary
#     part of a key every head shares, and each head's key part without rotary and value. Its
#     ``head_dim`` is not a size of its own but names either the rotary part (rotary tables of
#     the Llama kind are that wide) or the whole query/key head (Mistral 4, whose rotary
#     fraction is rope / head). The probe shrinks and varies the five sizes (a run each, and
#     the heads' products with them), writes ``head_dim`` to match the way the family's
#     config relates it, and names the per-head widths as products of the heads (split under
#     TP) and the ranks and the shared rotary part as whole sizes.


def _set_latent(spec: ModelSpec, config: Any, latent: LatentAttention) -> None:
    real = spec.latent
    assert real is not None
    head_dim = getattr(spec.config, "head_dim", None)
    qk = latent.nope + latent.rope
    if head_dim == real.rope:
        config.head_dim = latent.rope
    elif head_dim == real.nope + real.rope:
        config.head_dim = qk
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and "partial_rotary_factor" in rope:
            config.rope_parameters = {**rope, "partial_rotary_factor": latent.rope / qk}
    else:
        raise ProbeError(
            f"{spec.name}'s head_dim ({head_dim}) is neither its rotary part "
            f"(qk_rope_head_dim {real.rope}) nor a whole query/key head ({real.nope + real.rope}) "
            "(Note [Latent attention's sizes])"
        )
    _set(config, "q_lora_rank", latent.q_lora)
    config.kv_lora_rank = latent.kv_lora
    config.qk_rope_head_dim = latent.rope
    config.qk_nope_head_dim = latent.nope
    config.v_head_dim = latent.v_head
    if getattr(config, "qk_head_dim", None) is not None:
        config.qk_head_dim = qk


def size_values(sizes: Sizes, small: ModelSpec) -> dict[str, int]:
    """Each size name's value in a run, as the planner's sizer reads it from the config."""
    heads, kv = small.heads
    head_dim = small.head_dim
    top_k = sizes.top_k or 0
    values = {
        "hidden": small.dim("hidden_size"),
        "q": heads * head_dim,
        "kv": kv * head_dim,
        "heads": heads,
        "kv_heads": kv,
        "mlp": small.mlp_size,
        "vocab": small.dim("vocab_size"),
        "keys": sizes.seq,
        "scores": heads * sizes.seq,
        "one": 1,
    }
    if sizes.experts:
        values["experts"] = small.num_experts
        values["topk"] = top_k
        attr = expert_mlp_attr(small.config)
        values["expert_mlp"] = (small.dim(attr, 0) if attr else 0) or values["mlp"]
    if sizes.shared_mlp:
        values["shared_mlp"] = small.dim("shared_expert_intermediate_size", 0)
    latent = small.latent
    if sizes.latent is not None and latent is not None:
        values.update(latent.size_values(heads))
    return values
