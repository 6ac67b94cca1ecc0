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
  module, the parent of planned projections within a layer, until its reducing projection
  returns: Note [A region ends at its reducing projection] in ``probe_runs.py``) or as a
  planned module's input, and ``sequence`` elsewhere (norms and the residual stream, which
  sequence parallelism splits);
- a projection that splits its whole input itself saves its own slice (``local``), also
  where that input was saved before;
- storages per position and not per sequence are the rotary tables, which the planner sizes
  itself; the probe checks that they are what it assumes, and reads their dtype.

Parameters that no run's outputs reach, in any layer, get no gradient
(``ActivationProfile.no_gradient``; the memory model gives them no gradient and no AdamW
state under FSDP2).
"""

import dataclasses

from torch_sagemaker.planner.layer_kinds import layer_kind
from torch_sagemaker.planner.model import ModelSpec
from torch_sagemaker.planner.probe_runs import Record, run_reduced
from torch_sagemaker.planner.probe_sizes import (
    SEQ,
    WINDOW,
    ProbeError,
    base_sizes,
    size_values,
    variations,
)
from torch_sagemaker.planner.probe_widths import (
    _kind_words,
    kind_terms,
    layer_terms,
    merged,
    parts_of,
    position_terms,
    solved_terms,
)
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


def _measure(
    spec: ModelSpec, window: int | None
) -> tuple[list[list[Record]], list[dict[str, int]], list[ModelSpec], tuple[str, ...]]:
    """The probe runs: their saved storages, sizes by name, reduced specs; and the untrained.

    The last are the parameters no run's outputs reach in any layer
    (``ActivationProfile.no_gradient``).
    """
    base = base_sizes(spec)
    runs, values, smalls = [], [], []
    reached: set[str] = set()
    unreached: set[str] = set()
    sizes_of = list(variations(base))
    for sizes in sizes_of:
        records, small, reach = run_reduced(spec, sizes, window)
        reached |= reach.reached
        unreached |= reach.unreached
        runs.append(records)
        try:
            values.append(size_values(sizes, small))
        except ValueError as e:
            raise ProbeError(f"the reduced {spec.name}'s sizes cannot be read ({e})") from None
        smalls.append(small)
    for i, records in enumerate(runs[1:], 1):
        if len(records) != len(runs[0]):
            # The sizes that run changed: a count that grows with the experts is a model that
            # runs its experts one by one (DBRX's loop over the experts tokens chose).
            changed = ", ".join(
                f"{field.name} {getattr(sizes_of[i], field.name)}"
                for field in dataclasses.fields(sizes_of[i])
                if getattr(sizes_of[i], field.name) != getattr(sizes_of[0], field.name)
            )
            raise ProbeError(
                f"the reduced {spec.name} saves {len(runs[0])} storages with the base sizes "
                f"and {len(records)} in run {i} ({changed}): the number of tensors it saves "
                "must not depend on the sizes"
            )
    return runs, values, smalls, tuple(sorted(unreached - reached))


#: Layer types whose attention is softmax attention over the sequence (a window, chunk or
#: selection of it): what they save grows with the sequence as the probe's runs show it.
#: Linear, recurrent and convolution layers hold blocks or state of sizes the short runs do
#: not reach (MiniMax's lightning attention works in blocks of 256 tokens), so a config with
#: any other type is refused (Note [Layer kinds] in layer_kinds.py).
SIZED_LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "indexed_attention",
)


def _check_layer_types(spec: ModelSpec) -> None:
    types = getattr(spec.config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in SIZED_LAYER_TYPES}, key=str)
    if other:
        layers = [i for i, t in enumerate(types) if t == other[0]]
        raise ProbeError(
            f"its layer_types include {other[0]!r} (layers {layers[:8]}"
            f"{', ...' if len(layers) > 8 else ''}), not softmax attention over the sequence "
            f"({', '.join(SIZED_LAYER_TYPES)}): what such a layer saves depends on block or "
            "state sizes that the probe's short sequences do not reach"
        )


def _probe(spec: ModelSpec) -> ActivationProfile:
    from torch_sagemaker.planner.activations import sparse_layers, window_layers

    _check_layer_types(spec)

    window_attr = spec.policy.sliding_window_attr
    windowed = bool(window_attr and getattr(spec.config, window_attr, None))
    # Unmasked: a window longer than every probe sequence (transformers then passes no mask).
    runs, values, smalls, no_gradient = _measure(spec, 4096 if windowed else None)
    parts, small = parts_of(runs), smalls[0]
    sparse = sparse_layers(small)
    dense = set(range(small.num_layers)) - sparse
    if spec.num_experts and not sparse:
        raise ProbeError(f"the first {small.num_layers} layers of {spec.name} have no experts")
    masked_attention: tuple[Saved, ...] = ()
    if windowed:
        masked_runs, masked_values, masked_smalls, _ = _measure(spec, WINDOW)
        masked = window_layers(masked_smalls[0], SEQ)
        if masked:
            masked_attention = layer_terms(
                parts_of(masked_runs), masked_values, masked, "attention", "sliding-window"
            )
    everything = set(range(small.num_layers))
    # Note [Layer kinds]: one set of attention terms, or one per kind where kinds differ.
    kinds = {i: layer_kind(small.config, i) for i in everything}
    attention, attention_by_kind = kind_terms(parts, values, kinds, "attention", "attention")
    if attention_by_kind:
        measured = dict(attention_by_kind)
        missing = {layer_kind(spec.config, i) for i in range(spec.num_layers)} - set(measured)
        if missing:
            raise ProbeError(
                f"its layers' attention saves different tensors by kind, and the reduced "
                f"copy's {small.num_layers} layers hold no layer of kind "
                f"{_kind_words(sorted(missing)[0])}"
            )
    final = merged(
        solved_terms(parts.get((None, "final"), [[] for _ in values]), values, "the head")
    )
    positions, rotary_tables, rotary_dtype, half_width = position_terms(
        parts.get((None, "positions"), [[] for _ in values]), values, smalls
    )
    return ActivationProfile(
        attention=attention,
        attention_by_kind=attention_by_kind,
        mlp=layer_terms(parts, values, dense, "mlp", "dense") if dense else (),
        moe=layer_terms(parts, values, sparse, "mlp", "sparse") if sparse else (),
        final=merged([*final, *positions]),
        masked_attention=masked_attention,
        rotary_tables=rotary_tables,
        rotary_dtype=rotary_dtype,
        rotary_half_width=half_width,
        no_gradient=no_gradient,
        probed=True,
    )


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
