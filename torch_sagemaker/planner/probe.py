"""What a family saves for backward, measured on reduced copies of the model.

The planner measures it where the policy does not say (``ModelPolicy.activations`` is
``None``: the families ``tsm.transform`` splits by transformers' plan or a shipped one).

``probe_activations(spec)`` builds the model's own class from its config, shrunk to a few
layers and small sizes, runs one bfloat16 forward pass on the CPU under a
``saved_tensors_hooks`` and records every storage autograd saves, the way the validation
counts them (Note [Counting storages] in ``benchmarks/planner/measure.py``): once per storage,
leaving out parameters and buffers. It does so several times, each time changing one size
(the hidden size, the heads, the head size, the key/value heads, the MLP, the vocabulary, the
sequence, the experts), and solves, per saved storage, for the sizes its width is made of:
the result is an ``ActivationProfile`` in the terms hand-written profiles use, so the planner
sizes it for any layout (Note [Probing what a family saves]).

Where each storage lives under tensor parallelism is read from the modules running as it was
saved and the policy's plan:

- widths that tensor parallelism splits (query and key/value heads, MLP columns, the
  vocabulary) are ``split``;
- rows of an MoE block's chosen experts (a first dimension of tokens x top-k) are ``routed``;
- other widths (hidden, per token) are ``gathered`` inside a parallel region (an attention
  module, the parent of planned projections within a layer) or as a planned module's input,
  and ``sequence`` elsewhere (norms and the residual stream, which sequence parallelism
  splits);
- storages per position and not per sequence are the rotary tables, which the planner sizes
  itself; the probe checks that they are what it assumes.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_sagemaker.planner.model import ModelSpec, describe, mlp_size_attr, model_class
from torch_sagemaker.policies.model_policy import ActivationProfile, Saved

# Note [Probing what a family saves]
#     A saved storage's width per token (or per routed row, or per position) is a sum of the
#     model's sizes with small whole multiples: a fused QKV output is q + 2 kv, a fused
#     gate/up output 2 mlp, a float32 log-sum-exp the heads. One run cannot tell which sizes
#     make a width (a hidden size of 64 and four heads of 16 look alike), so the probe runs
#     the reduced model once with base sizes, once more per size changed alone, and a few
#     times with several changed at once (the heads' widths are products, and the last run
#     leaves the system over-determined). Each storage's widths over the runs are then
#     explained by the fewest sizes, at most three, with whole multiples of at least 1 that
#     fit every run exactly; a width no such sum explains is refused rather than guessed.
#     Sizes equal in every run (the hidden size and the heads' total when the config has no
#     head size of its own; the key/value heads and the heads in multi-head attention) are
#     one size for the solve, named by where the storage lives: inside a parallel region the
#     split size, at a norm or a module's input the hidden one. Both give the same bytes on
#     every layout, since the real model has them equal too. Storages are matched across
#     runs by the order autograd saves them, and the runs must save as many, of the same
#     kinds and dtypes, in the same places; a family whose code path changes with a size (a
#     dimension that must be divisible, a kernel chosen by size) fails that check with a
#     clear error. Head sizes are multiples of 8 (partial rotary fractions keep an even
#     width) and so are the hidden and MLP sizes (bfloat16 grouped GEMMs need rows of 16
#     bytes).

#: Widths that tensor parallelism splits inside a parallel region.
_SPLIT_SIZES = (
    "q",
    "kv",
    "heads",
    "kv_heads",
    "scores",
    "mlp",
    "expert_mlp",
    "shared_mlp",
    "vocab",
)
#: Order in which equal sizes are named: a storage inside a parallel region that is not a
#: gathering projection's input takes the split names first, any other the whole ones.
#: A width that no run changes is a constant ("one") first: with as many sizes as runs, any
#: size would otherwise absorb it.
_SPLIT_FIRST = ("one", *_SPLIT_SIZES, "hidden", "keys", "experts", "topk")
_WHOLE_FIRST = ("one", "hidden", "keys", "experts", "topk", "expert_mlp", *_SPLIT_SIZES)
#: Styles whose module's input arrives split over the TP ranks (the rest take it whole).
_SPLIT_INPUT_STYLES = ("rowwise", "rowwise_allreduce")
#: Styles whose module takes its input whole and saves its own slice of it (a copy): that
#: input is divided over the TP ranks even where the plan computes every head on every rank.
_LOCAL_INPUT_STYLES = ("rowwise_split_input",)
#: Styles of modules that make their parent (within a layer) a parallel region.
_REGION_STYLE_WORDS = ("colwise", "rowwise", "experts", "router", "lm_head")

#: Sequences per probe run: 7 divides none of the probe's sizes, so a storage holds whole
#: tokens (a multiple of 7 x the sequence) only if it is per token; eager attention flattens
#: the batch with the heads, so the shape alone cannot say.
_BATCH = 7
#: The widest storage per token the probe accepts as the same in every run (a norm's
#: statistics, a gate's score); wider, it is a size the probe does not vary.
_MAX_CONSTANT_WIDTH = 4
_SEQ = 26
_WINDOW = 8
_MAX_LAYERS = 6
_DTYPE_NAMES = {
    torch.bfloat16: "compute",
    torch.float32: "float32",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
    torch.complex64: "complex64",  # rotary frequencies kept as complex numbers (Llama 4)
}


@dataclass(frozen=True)
class _Sizes:
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


@dataclass
class _Record:
    """One saved storage of a run."""

    layer: int | None  # None: outside the layers
    attention: bool  # saved inside the layer's attention module
    rows: str  # "token", "routed", "position" or "constant"
    width: int  # elements per row
    dtype: str
    inside: bool  # in a parallel region, or a planned module's input
    whole_input: bool  # the input of a planned module that takes it whole (gathered)
    split_input: bool  # the input of a projection whose input is split
    local_input: bool  # the input of a projection that saves its own slice of it


class ProbeError(ValueError):
    """The probe cannot describe what the family saves (the message says why)."""


def _base_sizes(spec: ModelSpec) -> _Sizes:
    config = spec.config
    heads, kv = spec.heads
    explicit_head_dim = getattr(config, "head_dim", None) is not None
    if kv == heads:
        kv_heads: int | None = None  # multi-head attention: kv heads follow the heads
    elif kv == 1:
        kv_heads = 1
    else:
        kv_heads = 2
    experts = spec.num_experts or None
    moe = spec.policy.moe
    return _Sizes(
        hidden=80 if explicit_head_dim else 96,
        heads=6,
        kv_heads=kv_heads,
        head_dim=16 if explicit_head_dim else None,
        mlp=88 if spec.mlp_size else None,
        vocab=200,
        seq=_SEQ,
        experts=6 if experts else None,
        top_k=2 if experts and moe is not None else None,
        expert_mlp=40 if getattr(config, "moe_intermediate_size", None) else None,
        shared_mlp=72 if getattr(config, "shared_expert_intermediate_size", None) else None,
    )


def _variations(base: _Sizes) -> Iterator[_Sizes]:
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
            yield dataclasses.replace(base, **{field: value})
    # The widths of heads are products (heads x head size): with each size changed alone,
    # the heads, the key/value heads and their widths would be linearly dependent over the
    # runs, so one run changes them all.
    yield dataclasses.replace(
        base,
        hidden=base.hidden + 96,  # without a head size of its own: 192 / 12 heads = 16
        heads=12,
        kv_heads=3 if base.kv_heads == 2 else base.kv_heads,
        head_dim=24 if base.head_dim is not None else None,
    )
    yield dataclasses.replace(base, vocab=232)
    yield dataclasses.replace(base, seq=34)
    # One more run than there are sizes, changing several at once, so that a width the
    # sizes do not make cannot be fitted exactly by chance.
    yield dataclasses.replace(
        base,
        mlp=base.mlp and 120,
        vocab=264,
        seq=30,
        experts=base.experts and 4,
        expert_mlp=base.expert_mlp and 64,
        shared_mlp=base.shared_mlp and 88,
    )


def _set(config: Any, attr: str | None, value: Any) -> None:
    if attr and getattr(config, attr, None) is not None:
        setattr(config, attr, value)


def _reduced_config(spec: ModelSpec, sizes: _Sizes, window: int | None) -> Any:
    config = copy.deepcopy(spec.config)
    policy = spec.policy
    layers = min(spec.num_layers, _MAX_LAYERS)
    config.num_hidden_layers = layers
    types = getattr(config, "layer_types", None)
    if types is not None:
        config.layer_types = list(types[:layers])
    # Sizes the config keeps under other names equal to the hidden size (OPT's
    # word_embed_proj_dim) follow it, so that they shrink and change with it.
    hidden = spec.dim("hidden_size")
    for attr, value in list(vars(config).items()):
        named = any(word in attr for word in ("dim", "size", "embed"))
        if named and attr != "hidden_size" and type(value) is int and value == hidden:
            setattr(config, attr, sizes.hidden)
    config.hidden_size = sizes.hidden
    setattr(config, policy.num_heads_attr, sizes.heads)
    if policy.num_kv_heads_attr:
        kv = sizes.kv_heads if sizes.kv_heads is not None else sizes.heads
        _set(config, policy.num_kv_heads_attr, kv)
    if sizes.head_dim is not None:
        config.head_dim = sizes.head_dim
    _set(config, mlp_size_attr(config), sizes.mlp)
    config.vocab_size = sizes.vocab
    for attr in [a for a in vars(config) if a.endswith("_token_id")]:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= sizes.vocab:  # an id the vocabulary lost
            setattr(config, attr, 0)
    _set(config, policy.num_experts_attr, sizes.experts)
    if policy.moe is not None:
        _set(config, policy.moe.top_k_attr, sizes.top_k)
    _set(config, "moe_intermediate_size", sizes.expert_mlp)
    _set(config, "shared_expert_intermediate_size", sizes.shared_mlp)
    if policy.sliding_window_attr and getattr(config, policy.sliding_window_attr, None):
        setattr(config, policy.sliding_window_attr, window)
    if getattr(config, "max_position_embeddings", None) is not None:
        config.max_position_embeddings = max(int(config.max_position_embeddings), 64)
    return config


def _region_modules(model: nn.Module, policy: Any, layer_names: list[str]) -> set[str]:
    """Modules within a layer that are parallel regions.

    Attention modules, and the parents of planned projections.
    """
    regions = {name for name, _ in policy.attention_modules(model)}
    for name, _ in model.named_modules():
        style = _planned_style(policy, name)
        if style is None or not any(word in style for word in _REGION_STYLE_WORDS):
            continue
        parent = name.rpartition(".")[0]
        if any(parent.startswith(layer + ".") for layer in layer_names):
            regions.add(parent)
    return regions


def _planned_style(policy: Any, name: str) -> str | None:
    from fnmatch import fnmatchcase

    return next((s for p, s in policy.tp_plan.items() if fnmatchcase(name, p)), None)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _run(spec: ModelSpec, sizes: _Sizes, window: int | None) -> tuple[list[_Record], Any]:
    """One forward pass of the reduced model; its saved storages in order, and its spec."""
    # The reduced model is the same family, so the spec's own policy (the user's plan, where
    # they gave one) names its modules; regions and styles come from it.
    policy = spec.policy
    try:
        config = _reduced_config(spec, sizes, window)
        cls = model_class(config)
        # The kernel the model runs by default: SDPA where the family supports it, else
        # eager (whose scores per head and key are the ``scores`` size).
        sdpa = getattr(cls, "_supports_sdpa", False)
        config._attn_implementation = "sdpa" if sdpa else "eager"
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(0)
            model = cls(config).to(torch.bfloat16)
        small = describe(model, policy)
        attention = {name for name, _ in policy.attention_modules(model)}
    except Exception as e:  # noqa: BLE001 - any failure to build is the probe's refusal
        raise ProbeError(
            f"cannot build a reduced {spec.name} to measure ({type(e).__name__}: {e})"
        ) from None
    model.train()
    layer_names = [n for n, m in model.named_modules() if type(m).__name__ == policy.layer_class]
    regions = _region_modules(model, policy, layer_names)
    styles = {name: _planned_style(policy, name) for name, _ in model.named_modules()}
    ignored = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}

    stack: list[tuple[str, set[int]]] = []
    handles = []
    for name, module in model.named_modules():

        def pre(_m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            stack.append((name, {_storage_key(a) for a in inputs}))

        def post(_m: nn.Module, _args: tuple, _out: Any) -> None:
            stack.pop()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))

    batch, seq = _BATCH, sizes.seq
    tokens = batch * seq
    routed = tokens * sizes.top_k if sizes.top_k else None
    # Note [Storages the forward frees]: autograd frees the saved tensors of graph parts no
    # output reaches (an MoE router's auxiliary scores) while the forward still runs, and
    # the allocator hands their addresses to later storages. A storage is the one already
    # seen at its address only while a tensor saved with it lives; the records whose saved
    # tensors all died before the forward returned are dropped, as they hold no memory then.
    seen: dict[int, list[tuple[weakref.ref, int]]] = {}
    records: list[_Record] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key in ignored or tensor.untyped_storage().nbytes() == 0:
            return tensor
        alive = [(ref, i) for ref, i in seen.get(key, []) if ref() is not None]
        if alive:  # one more tensor of a storage already recorded
            seen[key] = [*alive, (weakref.ref(tensor), alive[0][1])]
            return tensor
        seen[key] = [(weakref.ref(tensor), len(records))]
        names = [n for n, _ in stack]
        layer = next((i for i, n in enumerate(layer_names) if n in names), None)
        planned = next(((n, k) for n, k in reversed(stack) if styles.get(n)), None)
        style = styles[planned[0]] if planned else None
        # A norm's input is the residual stream's; a projection's is gathered or split.
        is_input = (
            planned is not None
            and key in planned[1]
            and any(word in str(style) for word in _REGION_STYLE_WORDS)
        )
        elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        shape = tuple(tensor.shape)
        # The first row kind the shape shows and the storage divides into (a tensor expanded
        # over the batch keeps one sequence's storage: per position).
        kinds = [
            ("routed", routed, routed is not None and routed in shape),
            ("token", tokens, tokens in shape or seq in shape),
            ("position", seq, seq in shape),
        ]
        rows, count = next(
            ((k, n) for k, n, shown in kinds if shown and n and elements % n == 0),
            ("constant", 1),
        )
        # A storage smaller than one element per token, expanded (a cast weight), is not
        # an activation; a larger one that no row kind divides is not understood.
        if rows == "constant" and any(shown for _, _, shown in kinds) and elements >= tokens:
            rows = "unexplained"
        if tensor.dtype not in _DTYPE_NAMES or rows == "unexplained":
            raise ProbeError(
                f"a saved {tensor.dtype} tensor of shape {shape} (storage of {elements} "
                f"elements) in {names[-1] if names else 'the model'} is not a whole number "
                "of elements per token, routed row or position"
            )
        records.append(
            _Record(
                layer=layer,
                attention=any(n in attention for n in names),
                rows=rows,
                width=elements // count,
                dtype=_DTYPE_NAMES[tensor.dtype],
                inside=any(n in regions for n in names) or is_input,
                whole_input=is_input and style not in _SPLIT_INPUT_STYLES,
                split_input=is_input and style in _SPLIT_INPUT_STYLES,
                local_input=is_input and style in _LOCAL_INPUT_STYLES,
            )
        )
        return tensor

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sizes.vocab, (batch, seq), generator=generator)
    ignored.add(_storage_key(ids))  # the embedding's saved ids are the planner's own term
    try:
        with (
            torch.random.fork_rng(devices=[]),  # dropout draws leave the caller's state alone
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            output = model(input_ids=ids)  # held while the records' liveness is read
        held = {i for refs in seen.values() for ref, i in refs if ref() is not None}
        del output
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the forward is the refusal
        raise ProbeError(
            f"the reduced {spec.name} fails its forward pass ({type(e).__name__}: {e})"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    return [r for i, r in enumerate(records) if i in held], small


def _values(sizes: _Sizes, small: ModelSpec) -> dict[str, int]:
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
        values["expert_mlp"] = small.dim("moe_intermediate_size", 0) or values["mlp"]
    if sizes.shared_mlp:
        values["shared_mlp"] = small.dim("shared_expert_intermediate_size", 0)
    return values


def _solve(widths: list[int], values: list[dict[str, int]], order: tuple[str, ...]) -> dict:
    """The fewest sizes whose sum, with whole multiples, is each run's width.

    At most three sizes, names earlier in ``order`` preferred; ``{name: multiple}``, or empty
    if none explains the widths exactly.
    """
    names = [n for n in order if n in values[0]]
    for name in names:  # one size: the same whole multiple in every run
        if all(v[name] for v in values) and len({w / v[name] for v, w in zip(values, widths)}) == 1:
            multiple = widths[0] / values[0][name]
            if multiple >= 1 and multiple == int(multiple):
                return {name: int(multiple)}
    target = torch.tensor(widths, dtype=torch.float64).unsqueeze(1)
    for k in (2, 3):
        for combo in itertools.combinations(names, k):
            matrix = torch.tensor([[v[n] for n in combo] for v in values], dtype=torch.float64)
            if int(torch.linalg.matrix_rank(matrix)) < k:
                continue
            solution = torch.linalg.lstsq(matrix, target).solution.squeeze(1)
            multiples = [round(float(x)) for x in solution]
            if min(multiples) < 1:
                continue
            if all(
                sum(m * v[n] for m, n in zip(multiples, combo, strict=True)) == w
                for v, w in zip(values, widths, strict=True)
            ):
                return dict(zip(combo, multiples, strict=True))
    return {}


def _matched(runs: list[list[_Record]], where: str) -> Iterator[tuple[_Record, ...]]:
    """The records of the runs, matched by order; every run must have as many."""
    if len({len(records) for records in runs}) > 1:
        counts = ", ".join(str(len(records)) for records in runs)
        raise ProbeError(f"the runs save different numbers of storages in {where} ({counts})")
    return zip(*runs, strict=True)


def _terms(runs: list[list[_Record]], values: list[dict[str, int]], where: str) -> list[Saved]:
    """``Saved`` terms of matched records across runs."""
    terms: list[Saved] = []
    for matched in _matched(runs, where):
        first = matched[0]
        if first.rows == "constant":
            continue
        key = dataclasses.astuple(dataclasses.replace(first, width=0))
        if any(dataclasses.astuple(dataclasses.replace(r, width=0)) != key for r in matched):
            raise ProbeError(f"the runs save different tensors in {where}")
        split_first = (
            first.split_input
            or first.local_input
            or (first.inside and not first.whole_input and first.rows == "token")
        )
        order = _SPLIT_FIRST if split_first else _WHOLE_FIRST
        multiples = _solve([r.width for r in matched], values, order)
        if multiples.get("one", 0) > _MAX_CONSTANT_WIDTH:
            raise ProbeError(
                f"a {first.dtype} tensor saved in {where} is {multiples['one']} wide per "
                f"{'token' if first.rows == 'token' else 'row'} in every run: a size of the "
                "config's own that the probe does not shrink, which it cannot place"
            )
        if not multiples:
            widths = ", ".join(str(r.width) for r in matched)
            raise ProbeError(
                f"a {first.dtype} tensor saved in {where} has widths {widths} over the runs, "
                "which the model's sizes do not explain"
            )
        for name, count in multiples.items():
            if first.rows == "position":
                region = "positions"
            elif first.rows == "routed":
                region = "routed"
            elif first.local_input:
                region = "local"
            elif name in _SPLIT_SIZES:
                region = "split"
            else:
                region = "gathered" if first.inside else "sequence"
            terms.append(Saved(name, first.dtype, region, count))
    return terms


def _merged(terms: list[Saved]) -> tuple[Saved, ...]:
    counts: dict[tuple[str, str, str], int] = {}
    for t in terms:
        key = (t.size, t.dtype, t.region)
        counts[key] = counts.get(key, 0) + t.count
    return tuple(Saved(s, d, r, c) for (s, d, r), c in counts.items())


def _parts(
    runs: list[list[_Record]],
) -> dict[tuple[int | None, str], list[list[_Record]]]:
    """Each run's records by (layer, half).

    Halves are ``attention``, ``mlp`` or, outside the layers, ``final``; per-position
    storages (rotary tables, masks), whichever layer saved them, are under
    ``(None, "positions")``.
    """
    parts: dict[tuple[int | None, str], list[list[_Record]]] = {}
    for index, records in enumerate(runs):
        last_attention: dict[int, int] = {}
        for i, r in enumerate(records):
            if r.layer is not None and r.attention:
                last_attention[r.layer] = i
        for i, r in enumerate(records):
            if r.rows == "position":  # built once, first saved by whichever layer
                half = "positions"
                part = parts.setdefault((None, half), [[] for _ in runs])
                part[index].append(r)
                continue
            if r.layer is None:
                half = "final"
            else:
                half = "attention" if i <= last_attention.get(r.layer, -1) else "mlp"
            part = parts.setdefault((r.layer, half), [[] for _ in runs])
            part[index].append(r)
    return parts


def _measure(
    spec: ModelSpec, window: int | None
) -> tuple[list[list[_Record]], list[dict[str, int]], list[ModelSpec]]:
    """The probe runs: each run's saved storages, its sizes by name, and its reduced spec."""
    base = _base_sizes(spec)
    runs, values, smalls = [], [], []
    for sizes in _variations(base):
        records, small = _run(spec, sizes, window)
        runs.append(records)
        try:
            values.append(_values(sizes, small))
        except ValueError as e:
            raise ProbeError(f"the reduced {spec.name}'s sizes cannot be read ({e})") from None
        smalls.append(small)
    for i, records in enumerate(runs[1:], 1):
        if len(records) != len(runs[0]):
            raise ProbeError(
                f"the reduced {spec.name} saves {len(runs[0])} storages with the base sizes "
                f"and {len(records)} in run {i}"
            )
    return runs, values, smalls


def _layer_terms(
    parts: dict, values: list[dict[str, int]], layers: set[int], half: str, what: str
) -> tuple[Saved, ...]:
    found = None
    for layer in sorted(layers):
        runs = parts.get((layer, half), [[] for _ in values])
        terms = _merged(_terms(runs, values, f"layer {layer}'s {half}"))
        if found is None:
            found = terms
        elif sorted(map(repr, terms)) != sorted(map(repr, found)):
            raise ProbeError(f"the reduced model's {what} layers save different tensors")
    return found or ()


def _probe(spec: ModelSpec) -> ActivationProfile:
    from torch_sagemaker.planner.activations import sparse_layers, window_layers

    window_attr = spec.policy.sliding_window_attr
    windowed = bool(window_attr and getattr(spec.config, window_attr, None))
    # Unmasked: a window longer than every probe sequence (transformers then passes no mask).
    runs, values, smalls = _measure(spec, 4096 if windowed else None)
    parts, small = _parts(runs), smalls[0]
    sparse = sparse_layers(small)
    dense = set(range(small.num_layers)) - sparse
    if spec.num_experts and not sparse:
        raise ProbeError(f"the first {small.num_layers} layers of {spec.name} have no experts")
    masked_attention: tuple[Saved, ...] = ()
    if windowed:
        masked_runs, masked_values, masked_smalls = _measure(spec, _WINDOW)
        masked = window_layers(masked_smalls[0], _SEQ)
        if masked:
            masked_attention = _layer_terms(
                _parts(masked_runs), masked_values, masked, "attention", "sliding-window"
            )
    everything = set(range(small.num_layers))
    final = _merged(_terms(parts.get((None, "final"), [[] for _ in values]), values, "the head"))
    positions, rotary_tables = _positions(
        parts.get((None, "positions"), [[] for _ in values]), values, smalls
    )
    return ActivationProfile(
        attention=_layer_terms(parts, values, everything, "attention", "attention"),
        mlp=_layer_terms(parts, values, dense, "mlp", "dense") if dense else (),
        moe=_layer_terms(parts, values, sparse, "mlp", "sparse") if sparse else (),
        final=_merged([*final, *positions]),
        masked_attention=masked_attention,
        rotary_tables=rotary_tables,
        probed=True,
    )


def _positions(
    matched_runs: list[list[_Record]], values: list[dict[str, int]], smalls: list[ModelSpec]
) -> tuple[tuple[Saved, ...], int]:
    """Per-position storages: the terms the sizes explain, and the rotary tables.

    Returns the ``positions`` terms (masks, ids) and how many pairs of rotary tables the rest
    are.

    The rest must be a whole number of the pairs the planner sizes itself
    (``activations.rotary_bytes``: cos and sin, as wide as the part of a head rotary
    rotates), the same number in every run; the rotary width is a fraction of the head size,
    not a sum of sizes, so the solve leaves it over.

    Raises:
        ProbeError: If per-position storages are saved that are neither.
    """
    from torch_sagemaker.planner.activations import DTYPE_BYTES, rotary_width

    terms: list[Saved] = []
    rest = [0] * len(values)
    for matched in _matched(matched_runs, "per-position storages"):
        # Masks (a row of keys per position), ids and per-position scales, and widths no run
        # changes (rotary tables as wide as a config's own fixed rotary dimension): the
        # tables the planner sizes change with the head size, which no run keeps.
        multiples = _solve([r.width for r in matched], values, ("one", "keys"))
        if multiples:
            terms += [Saved(n, matched[0].dtype, "positions", c) for n, c in multiples.items()]
            continue
        for i, r in enumerate(matched):
            rest[i] += r.width * (2 if r.dtype == "compute" else DTYPE_BYTES[r.dtype])
    counts = set()
    for measured, small in zip(rest, smalls, strict=True):
        pair = 2 * rotary_width(small) * 2  # cos and sin, bfloat16
        if not pair or measured % pair:
            raise ProbeError(
                f"it saves {measured} bytes per position that are not rotary tables (pairs "
                f"of {pair}) nor explained by its sizes"
            )
        counts.add(measured // pair)
    if len(counts) != 1:
        raise ProbeError(f"its rotary tables change with its sizes ({sorted(counts)} pairs)")
    return _merged(terms), counts.pop()


_CACHE: dict[str, ActivationProfile] = {}


def probe_activations(spec: ModelSpec) -> ActivationProfile:
    """What ``spec``'s family saves for backward, measured on reduced copies of it.

    Args:
        spec: The model (``load_model``); its policy need not describe its activations.

    Returns:
        An ``ActivationProfile`` with ``probed=True``.

    Raises:
        ProbeError: If the reduced model cannot be built or run, or what it saves is not
            explained by its sizes (the message says which).
    """
    policy = spec.policy
    key = f"{spec.config.to_json_string()}|{policy.name}|{sorted(policy.tp_plan.items())}"
    if key not in _CACHE:
        try:
            _CACHE[key] = _probe(spec)
        except ProbeError as e:
            raise ProbeError(
                f"{spec.name}: policy {spec.policy.name!r} does not describe what its layers "
                f"save for backward, and measuring it on a reduced model failed: {e}. Give "
                "the policy an ActivationProfile (docs/planner.md)."
            ) from None
    return _CACHE[key]


def with_activations(spec: ModelSpec) -> ModelSpec:
    """``spec`` with its policy's ``activations`` measured where the policy does not give them.

    Raises:
        ProbeError: As ``probe_activations``.
    """
    if spec.policy.activations is not None:
        return spec
    policy = dataclasses.replace(spec.policy, activations=probe_activations(spec))
    return dataclasses.replace(spec, policy=policy)


__all__ = ["ProbeError", "probe_activations", "with_activations"]
