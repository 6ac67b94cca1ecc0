"""The probe's runs: reduced copies of a model, and the storages each forward pass saves.

``run_reduced(spec, sizes, window)`` builds the model's own class from its config with the
sizes of one run (``variations``: the base sizes, then each changed alone), runs one bfloat16
forward pass under a ``saved_tensors_hooks`` and returns a ``Record`` per saved storage: its
rows (per token, routed, per expert, per position), its width, its dtype and where it was
saved; and the parameters the outputs reach through autograd (``Reach``: the others get no
gradient). What the widths are made of is ``probe_widths``'s concern (Note [Probing what a
family saves] in ``probe.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_sagemaker.planner.model import ModelSpec, describe, model_class
from torch_sagemaker.planner.probe_attention import FusedAttention
from torch_sagemaker.planner.probe_casts import Casts, storage_key
from torch_sagemaker.planner.probe_sizes import ProbeError, Sizes, reduced_config
from torch_sagemaker.policies.model_policy import ModelPolicy

#: Styles whose module's input arrives split over the TP ranks (the rest take it whole).
_SPLIT_INPUT_STYLES = ("rowwise", "rowwise_allreduce", "conv1d_rowwise_allreduce")
#: Styles whose module takes its input whole and saves its own slice of it (a copy): that
#: input is divided over the TP ranks even where the plan computes every head on every rank.
_LOCAL_INPUT_STYLES = ("rowwise_split_input",)
#: Styles of modules that make their parent (within a layer) a parallel region.
_REGION_STYLE_WORDS = ("colwise", "rowwise", "experts", "router", "lm_head")
#: Styles of subtrees that compute whole, on whole activations, inside a region.
_WHOLE_BLOCK_STYLES = ("replicate_local", "replicate", "router")
#: Words of styles whose module computes split widths: running one (re)opens its regions.
_SPLITTING_STYLE_WORDS = ("colwise", "experts", "router", "lm_head")
#: Styles whose module's output leaves the parallel region: all-reduced or reduce-scattered
#: (Note [A region ends at its reducing projection]).
_REDUCING_STYLES = (
    "rowwise",
    "rowwise_allreduce",
    "conv1d_rowwise_allreduce",
    "rowwise_split_input",
    "reduce_output",
    "reduce_scatter_output",
    "experts_allreduce",
    "experts_allreduce_local_slots",
    "experts_batched",
)

#: Styles of experts modules that compute every token for the experts each TP rank holds
#: (Note [Experts on every token]).
_EXPERT_SPLIT_STYLES = ("experts_batched",)

# Note [Experts on every token]
#     Llama 4's MoE block runs every expert on every token: it repeats its input once per
#     expert, scales each copy by the router's score (zero for the experts a token did not
#     pick) and hands the experts one block of rows per expert. What it saves is per (token,
#     expert) row, tokens x experts rows, not per routed row: ``every_expert`` in the block,
#     and ``own_experts`` inside the experts module, which under TP
#     (``experts_batched``) computes only the experts its rank holds on their rows. The
#     probe knows such a storage by its shape: tokens x experts rows, or experts then
#     tokens as its first dimensions. The time model gives each expert every token's rows.

#: Sequences per probe run: 7 divides none of the probe's sizes, so a storage holds whole
#: tokens (a multiple of 7 x the sequence) only if it is per token; eager attention flattens
#: the batch with the heads, so the shape alone cannot say.
_BATCH = 7
_DTYPE_NAMES = {
    torch.bfloat16: "compute",
    torch.float32: "float32",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
    torch.complex64: "complex64",  # rotary frequencies kept as complex numbers (Llama 4)
}


@dataclass
class Record:
    """One saved storage of a run."""

    layer: int | None  # None: outside the layers
    attention: bool  # saved inside the layer's attention module
    rows: str  # "token", "routed", "every_expert", "position" or "constant"
    width: int  # elements per row
    dtype: str
    inside: bool  # in a parallel region, or a planned module's input
    whole_input: bool  # the input of a planned module that takes it whole (gathered)
    split_input: bool  # the input of a projection whose input is split
    local_input: bool  # the input of a projection that saves its own slice of it
    cast: bool = False  # a compute <-> float32 cast of another saved storage (Saved.cast)
    whole_block: bool = False  # in a region's block that the plan leaves whole (a router)
    own_experts: bool = False  # computed by an experts module that TP splits by experts


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


@dataclass(frozen=True)
class Reach:
    """Which parameters a forward's outputs reach, by name (a layer's number as ``*``).

    A name is in both where some layers' parameter is reached and others' is not.
    """

    reached: frozenset[str]
    unreached: frozenset[str]


def _reach(model: nn.Module, output: Any, layer_names: list[str]) -> Reach:
    """The parameters autograd would give a gradient from ``output``'s tensors."""
    values = output.values() if hasattr(output, "values") else output
    tensors = [t for t in values if isinstance(t, torch.Tensor)]
    nodes: list[Any] = [t.grad_fn for t in tensors if t.grad_fn is not None]
    visited: set[Any] = set()
    leaves: set[int] = set()
    while nodes:
        node = nodes.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
        if variable is not None:
            leaves.add(id(variable))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    reached: set[str] = set()
    unreached: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        layer = next((n for n in layer_names if name.startswith(n + ".")), None)
        if layer is not None:
            name = f"{layer.rpartition('.')[0]}.*{name[len(layer) :]}"
        (reached if id(param) in leaves else unreached).add(name)
    return Reach(frozenset(reached), frozenset(unreached))


# Note [A region ends at its reducing projection]
#     A parallel region is a module (an attention module, the parent of planned projections),
#     but not all that runs inside it is split: the BERT family's ``attention.output`` and
#     ``output`` modules hold the row-parallel projection, then a dropout and a LayerNorm
#     over its all-reduced, whole output. Within a region, what is saved after a reducing
#     projection (``_REDUCING_STYLES``) has returned, and before a splitting one starts
#     again, is outside the region: the residual stream's (``sequence``), never a split
#     width. (Sizes the solve cannot tell apart are named by the region: BERT's query width
#     equals its hidden size, and its four hidden-wide storages per layer after the
#     projections were taken for split query widths, half their size under TP 2.)


# Note [Blocks a region leaves whole]
#     Inside a parallel region not everything is split: an MoE block is a region (its
#     experts are planned), but its router, and a shared expert the plan does not name
#     (Qwen2-MoE's), run whole on every rank; the translated plan marks such subtrees
#     (``_WHOLE_BLOCK_STYLES``: ``replicate_local``, computed on whole activations). A storage
#     saved while one runs inside the innermost region is whole (``Record.whole_block``):
#     named by whole sizes first where sizes are equal in every run (a router's input, hidden
#     wide, is the query heads' width too where the config has no head size of its own), and
#     never split. Before, Qwen2-MoE's shared expert was sized split under TP, and a router's
#     input could be.


class _Modules:
    """The modules running as a storage is saved, and which regions are open."""

    def __init__(self, model: nn.Module, regions: set[str], styles: dict) -> None:
        self.regions, self.styles = regions, styles
        # (name, storages of its inputs, storages it sliced itself), innermost last.
        self.stack: list[tuple[str, set[int], set[int]]] = []
        self.closed: set[str] = set()
        self.handles = []
        named = dict(model.named_modules())
        # Note [Blocks a region leaves whole]
        self.whole_blocks = {n for n in named if styles.get(n) in _WHOLE_BLOCK_STYLES}
        for name, module in named.items():
            pre = functools.partial(self._pre, name)
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, name: str, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        style = str(self.styles.get(name))
        if name in self.regions:
            self.closed.discard(name)
        if any(word in style for word in _SPLITTING_STYLE_WORDS):
            self.closed.difference_update(n for n, *_ in self.stack)
        self.stack.append((name, {storage_key(a) for a in inputs}, set()))

    def _post(self, _m: nn.Module, _args: tuple, _out: Any) -> None:
        name = self.stack.pop()[0]
        if self.styles.get(name) in _REDUCING_STYLES:
            self.closed.update(n for n, *_ in self.stack if n in self.regions)

    @property
    def names(self) -> list[str]:
        """The running modules, outermost first."""
        return [n for n, *_ in self.stack]

    def inside(self) -> bool:
        """Whether an open region is running."""
        return any(n in self.regions and n not in self.closed for n in self.names)

    def in_whole_block(self) -> bool:
        """Whether a block the plan keeps whole runs inside the innermost region."""
        names = self.names
        opened = [i for i, n in enumerate(names) if n in self.regions]
        return bool(opened) and any(n in self.whole_blocks for n in names[opened[-1] + 1 :])

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self.handles:
            handle.remove()


def _rekeyed(policy: ModelPolicy, model: nn.Module) -> ModelPolicy:
    """``policy`` with its module names moved to where ``model`` holds its layer stack.

    A multimodal model's text model is built on its own from the text config, so its
    layers sit below another prefix than in the whole model (Fuyu's, Gemma 3's
    ``model.language_model.layers`` are ``model.layers`` in the causal LM of their text
    config): the plan's entries below the whole model's base are moved to the reduced
    model's. Unchanged where the prefixes agree or no layer stack is found.
    """
    layers = [n for n, m in model.named_modules() if type(m).__name__ == policy.layer_class]
    stack = next((k.split(".*.")[0] for k in policy.tp_plan if ".*." in k), "")
    if not layers or not stack:
        return policy
    here = layers[0].rpartition(".")[0]  # "model.layers"
    if here == stack or here.rpartition(".")[2] != stack.rpartition(".")[2]:
        return policy
    old, new = stack.rpartition(".")[0], here.rpartition(".")[0]
    if not old:
        return policy

    def moved(name: str) -> str:
        if not name.startswith(f"{old}."):
            return name
        return f"{new}.{name[len(old) + 1 :]}" if new else name[len(old) + 1 :]

    patterns = (policy.attention,) if isinstance(policy.attention, str) else policy.attention
    return dataclasses.replace(
        policy,
        tp_plan={moved(k): v for k, v in policy.tp_plan.items()},
        attention=tuple(moved(p) for p in patterns),
    )


def run_reduced(
    spec: ModelSpec, sizes: Sizes, window: int | None
) -> tuple[list[Record], Any, Reach]:
    """One forward pass of the reduced model.

    Returns its saved storages in order, its spec, and which of its parameters the outputs
    reach.
    """
    try:
        config = reduced_config(spec, sizes, window)
        cls = model_class(config)
        # The kernel the model runs by default: SDPA where the family supports it, else
        # eager (whose scores per head and key are the ``scores`` size).
        sdpa = getattr(cls, "_supports_sdpa", False)
        config._attn_implementation = "sdpa" if sdpa else "eager"
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(0)
            model = cls(config).to(torch.bfloat16)
        # The reduced model is the same family, so the spec's own policy (the user's plan,
        # where they gave one) names its modules; regions and styles come from it.
        policy = _rekeyed(spec.policy, model)
        small = describe(model, policy)
        attention = {name for name, _ in policy.attention_modules(model)}
    except Exception as e:  # noqa: BLE001 - any failure to build is the probe's refusal
        raise ProbeError(
            f"cannot build a reduced {spec.name} to measure ({type(e).__name__}: {e})"
        ) from None
    if spec.policy.attention and not attention:
        raise ProbeError(
            f"the policy names no attention module of the reduced {type(model).__name__} "
            f"(its patterns: {spec.policy.attention}), so it cannot say where what the "
            "model saves lives under tensor parallelism"
        )
    model.train()
    layer_names = [n for n, m in model.named_modules() if type(m).__name__ == policy.layer_class]
    regions = _region_modules(model, policy, layer_names)
    styles = {name: _planned_style(policy, name) for name, _ in model.named_modules()}
    ignored = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}

    modules = _Modules(model, regions, styles)
    batch, seq = _BATCH, sizes.seq
    tokens = batch * seq
    routed = tokens * sizes.top_k if sizes.top_k else None
    every = tokens * sizes.experts if sizes.experts else None  # Note [Experts on every token]
    # Note [Storages the forward frees]: autograd frees the saved tensors of graph parts no
    # output reaches (an MoE router's auxiliary scores) while the forward still runs, and
    # the allocator hands their addresses to later storages. A storage is the one already
    # seen at its address only while a tensor saved with it lives; the records whose saved
    # tensors all died before the forward returned are dropped, as they hold no memory then.
    seen: dict[int, list[tuple[weakref.ref, int]]] = {}
    records: list[Record] = []
    casts = Casts(records)
    # Note [Casts that float32 compute skips]: a saved cast is paired with its saved source
    # (record indices) when the source's storage is provably the one cast: a record of that
    # storage made before the cast and alive since, or the source tensor itself, alive when
    # either is saved. An address reused by another storage pairs nothing. The pair counts
    # once under float32 only where both records are alike but for the dtype and width (same
    # layer part, rows and region; a cast of a slice is narrower than its source).
    cast_pairs: list[tuple[int, int]] = []  # (the cast's record, its source's record)
    waiting: dict[int, list[tuple[int, weakref.ref]]] = {}  # source storage -> casts saved

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key in ignored or tensor.untyped_storage().nbytes() == 0:
            return tensor
        names = modules.names
        planned = next((e for e in reversed(modules.stack) if styles.get(e[0])), None)
        style = styles[planned[0]] if planned else None
        # A norm's input is the residual stream's; a projection's is gathered or split.
        is_input = (
            planned is not None
            and key in planned[1]
            and any(word in str(style) for word in _REGION_STYLE_WORDS)
        )
        alive = [(ref, i) for ref, i in seen.get(key, []) if ref() is not None]
        # A projection that splits its whole input itself saves its own slice, a storage
        # of its own under TP, even where the input was saved before (OLMo 2's: the
        # attention kernel's output, which the CPU kernel lays out so that the reshape
        # before the projection copies nothing).
        slices = planned[2] if planned is not None and style in _LOCAL_INPUT_STYLES else None
        sliced = is_input and slices is not None and key not in slices
        if alive and not sliced:  # one more tensor of a storage already recorded
            seen[key] = [*alive, (weakref.ref(tensor), alive[0][1])]
            return tensor
        if sliced and slices is not None:
            slices.add(key)
        seen[key] = [*alive, (weakref.ref(tensor), len(records))]
        layer = next((i for i, n in enumerate(layer_names) if n in names), None)
        elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        shape = tuple(tensor.shape)
        # The first row kind the shape shows and the storage divides into (a tensor expanded
        # over the batch keeps one sequence's storage: per position).
        expert_major = every is not None and (
            every in shape or shape[:2] == (sizes.experts, tokens)
        )
        kinds = [
            ("routed", routed, routed is not None and routed in shape),
            ("every_expert", every, expert_major),
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
        index = len(records)
        made = casts.of(tensor)
        if made is not None:
            source_key, source, made_at = made
            earlier = [i for ref, i in seen.get(source_key, []) if ref() is not None]
            origin = source()
            # (saved before the cast was made, or since, while the source itself lives)
            very = origin is not None and storage_key(origin) == source_key
            if earlier and (earlier[0] < made_at or very):
                cast_pairs.append((index, earlier[0]))
            else:
                waiting.setdefault(source_key, []).append((index, source))
        for cast_index, source in waiting.pop(key, []):
            origin = source()
            if origin is not None and storage_key(origin) == key:  # the very source
                cast_pairs.append((cast_index, index))
        records.append(
            Record(
                layer=layer,
                attention=any(n in attention for n in names),
                rows=rows,
                width=elements // count,
                dtype=_DTYPE_NAMES[tensor.dtype],
                inside=modules.inside() or is_input,
                whole_input=is_input and style not in _SPLIT_INPUT_STYLES,
                split_input=is_input and style in _SPLIT_INPUT_STYLES,
                local_input=is_input and style in _LOCAL_INPUT_STYLES,
                whole_block=modules.in_whole_block(),
                own_experts=style in _EXPERT_SPLIT_STYLES and not is_input,
            )
        )
        return tensor

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sizes.vocab, (batch, seq), generator=generator)
    ignored.add(storage_key(ids))  # the embedding's saved ids are the planner's own term
    try:
        with (
            torch.random.fork_rng(devices=[]),  # dropout draws leave the caller's state alone
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            casts,
            FusedAttention(),  # Note [Attention with unequal head sizes]
        ):
            output = model(input_ids=ids)  # held while the records' liveness is read
        held = {i for refs in seen.values() for ref, i in refs if ref() is not None}
        for cast_index, source_index in cast_pairs:
            cast, source = records[cast_index], records[source_index]
            # (one storage under float32, if both are held and saved alike: the same layer
            # part, rows and region, where sequence parallelism would split one and not the
            # other; the widths may differ, a cast of part of its source: Flint's sinks)
            alike = dataclasses.replace(cast, dtype="", width=0) == dataclasses.replace(
                source, dtype="", width=0
            )
            if cast_index in held and source_index in held and alike:
                records[cast_index] = dataclasses.replace(cast, cast=True)
        reach = _reach(model, output, layer_names)
        del output
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the forward is the refusal
        raise ProbeError(
            f"the reduced {spec.name} fails its forward pass ({type(e).__name__}: {e})"
        ) from None
    finally:
        modules.remove()
    return [r for i, r in enumerate(records) if i in held], small, reach
