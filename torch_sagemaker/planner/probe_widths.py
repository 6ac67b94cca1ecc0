"""What the probe's widths are made of: the sizes that explain a storage over the runs.

``solved_terms(runs, values, where)`` matches the runs' records (``probe_runs.Record``) by
order and solves each storage's widths for the fewest sizes with whole multiples (``solve``),
placing each term in its tensor-parallel region; ``position_terms`` separates per-position
storages from the rotary tables the planner sizes itself (Note [Probing what a family saves] in
``probe.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch

from torch_sagemaker.planner.model import ModelSpec
from torch_sagemaker.planner.probe_runs import Record
from torch_sagemaker.planner.probe_sizes import ProbeError
from torch_sagemaker.policies.model_policy import Saved

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
    "heads_nope",  # latent attention's per-head widths (Note [Latent attention's sizes])
    "heads_v",
)
#: Latent attention's whole sizes: the query's and key/value latent's ranks, and the rotary
#: part of a key that every head shares.
_LATENT_WHOLE = ("q_lora", "kv_lora", "rope")
#: Order in which equal sizes are named: a storage inside a parallel region that is not a
#: gathering projection's input takes the split names first, any other the whole ones.
#: A width that no run changes is a constant ("one") first: with as many sizes as runs, any
#: size would otherwise absorb it.
_SPLIT_FIRST = ("one", *_SPLIT_SIZES, "hidden", "keys", "experts", "topk", *_LATENT_WHOLE)
_WHOLE_FIRST = (
    "one",
    "hidden",
    "keys",
    "experts",
    "topk",
    *_LATENT_WHOLE,
    "expert_mlp",
    *_SPLIT_SIZES,
)
_BATCH = 7
#: The widest storage per token the probe accepts as the same in every run (a norm's
#: statistics, a gate's score); wider, it is a size the probe does not vary.
_MAX_CONSTANT_WIDTH = 4


def solve(widths: list[int], values: list[dict[str, int]], order: tuple[str, ...]) -> dict:
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


def matched_records(runs: list[list[Record]], where: str) -> Iterator[tuple[Record, ...]]:
    """The records of the runs, matched by order; every run must have as many."""
    if len({len(records) for records in runs}) > 1:
        counts = ", ".join(str(len(records)) for records in runs)
        raise ProbeError(f"the runs save different numbers of storages in {where} ({counts})")
    return zip(*runs, strict=True)


def solved_terms(runs: list[list[Record]], values: list[dict[str, int]], where: str) -> list[Saved]:
    """``Saved`` terms of matched records across runs."""
    terms: list[Saved] = []
    for matched in matched_records(runs, where):
        first = matched[0]
        if first.rows == "constant":
            continue
        key = dataclasses.astuple(dataclasses.replace(first, width=0))
        if any(dataclasses.astuple(dataclasses.replace(r, width=0)) != key for r in matched):
            raise ProbeError(f"the runs save different tensors in {where}")
        split_first = not first.whole_block and (
            first.split_input
            or first.local_input
            or (first.inside and not first.whole_input and first.rows == "token")
        )
        order = _SPLIT_FIRST if split_first else _WHOLE_FIRST
        multiples = solve([r.width for r in matched], values, order)
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
            elif first.rows == "every_expert":  # Note [Experts on every token]
                region = "own_experts" if first.own_experts else "every_expert"
            elif first.local_input:
                region = "local"
            elif name in _SPLIT_SIZES and not first.whole_block:
                region = "split"
            else:
                region = "gathered" if first.inside else "sequence"
            terms.append(Saved(name, first.dtype, region, count, first.cast))
    return terms


def merged(terms: list[Saved]) -> tuple[Saved, ...]:
    """``terms`` with those of the same size, dtype, region and ``cast`` added up."""
    counts: dict[tuple[str, str, str, bool], int] = {}
    for t in terms:
        key = (t.size, t.dtype, t.region, t.cast)
        counts[key] = counts.get(key, 0) + t.count
    return tuple(Saved(s, d, r, c, cast) for (s, d, r, cast), c in counts.items())


def parts_of(
    runs: list[list[Record]],
) -> dict[tuple[int | None, str], list[list[Record]]]:
    """Each run's records by (layer, half).

    Halves are ``attention``, ``mlp`` or, outside the layers, ``final``; per-position
    storages (rotary tables, masks), whichever layer saved them, are under
    ``(None, "positions")``.
    """
    parts: dict[tuple[int | None, str], list[list[Record]]] = {}
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


def layer_terms(
    parts: dict, values: list[dict[str, int]], layers: set[int], half: str, what: str
) -> tuple[Saved, ...]:
    """The terms of one half (``attention`` or ``mlp``) of ``layers``, which must agree.

    Raises:
        ProbeError: If two of the layers save different terms.
    """
    found = None
    for layer in sorted(layers):
        runs = parts.get((layer, half), [[] for _ in values])
        terms = merged(solved_terms(runs, values, f"layer {layer}'s {half}"))
        if found is None:
            found = terms
        elif sorted(map(repr, terms)) != sorted(map(repr, found)):
            raise ProbeError(f"the reduced model's {what} layers save different tensors")
    return found or ()


def kind_terms(
    parts: dict, values: list[dict[str, int]], kinds: dict[int, tuple], half: str, what: str
) -> tuple[tuple[Saved, ...], tuple[tuple[tuple, tuple[Saved, ...]], ...]]:
    """The terms of one half of the layers ``kinds`` maps to their kind (Note [Layer kinds]).

    Returns the first layer's terms, and, where layers save different terms, each kind's
    (empty where all agree).

    Raises:
        ProbeError: If two layers of one kind save different terms.
    """
    per_layer = {
        layer: merged(
            solved_terms(
                parts.get((layer, half), [[] for _ in values]), values, f"layer {layer}'s {half}"
            )
        )
        for layer in sorted(kinds)
    }
    first = per_layer[min(kinds)]
    if all(sorted(map(repr, t)) == sorted(map(repr, first)) for t in per_layer.values()):
        return first, ()
    by_kind: dict[tuple, tuple[Saved, ...]] = {}
    for layer, terms in per_layer.items():
        kind = kinds[layer]
        if sorted(map(repr, by_kind.setdefault(kind, terms))) != sorted(map(repr, terms)):
            alike = f" of one kind ({_kind_words(kind)})" if kind else ""
            raise ProbeError(f"the reduced model's {what} layers{alike} save different tensors")
    return first, tuple(by_kind.items())


def _kind_words(kind: tuple) -> str:
    return ", ".join(f"{attr} {value!r}" for attr, value in kind)


def position_terms(
    matched_runs: list[list[Record]], values: list[dict[str, int]], smalls: list[ModelSpec]
) -> tuple[tuple[Saved, ...], int, str, bool]:
    """Per-position storages: the terms the sizes explain, and the rotary tables.

    Returns the ``positions`` terms (masks, ids), how many pairs of rotary tables the rest
    are, their dtype, and whether they are half-width (``ActivationProfile.rotary_half_width``).

    The rest must be a whole number of the pairs the planner sizes itself
    (``activations.rotary_bytes``: cos and sin, as wide as the part of a head rotary
    rotates), the same number in every run; the rotary width is a fraction of the head size,
    not a sum of sizes, so the solve leaves it over. Tables all in float32 are float32
    pairs (OLMo 2 keeps them so under bfloat16 compute: one pair, not two of bfloat16, which
    a float32 run would halve); others are counted in pairs of the compute dtype. Pairs of
    half the width are tables of one value per rotated pair of channels (GPT-OSS's), where
    full-width pairs do not divide the bytes.

    Raises:
        ProbeError: If per-position storages are saved that are neither.
    """
    from torch_sagemaker.planner.activations import DTYPE_BYTES, rotary_width

    terms: list[Saved] = []
    rest = [0] * len(values)
    dtypes = set()
    for matched in matched_records(matched_runs, "per-position storages"):
        # Masks (a row of keys per position), ids and per-position scales, and widths no run
        # changes (rotary tables as wide as a config's own fixed rotary dimension): the
        # tables the planner sizes change with the head size, which no run keeps.
        multiples = solve([r.width for r in matched], values, ("one", "keys"))
        if multiples:
            terms += [Saved(n, matched[0].dtype, "positions", c) for n, c in multiples.items()]
            continue
        dtypes.add(matched[0].dtype)
        for i, r in enumerate(matched):
            rest[i] += r.width * (2 if r.dtype == "compute" else DTYPE_BYTES[r.dtype])
    # Complex frequencies (Llama 4's, half as many elements of 8 bytes) are a compute pair.
    dtype = "float32" if dtypes == {"float32"} else "compute"
    table_bytes = 2 if dtype == "compute" else DTYPE_BYTES[dtype]  # compute: bfloat16
    # Full-width tables first; then tables of one value per rotated pair (GPT-OSS's).
    for half in (False, True):
        pairs = [2 * (rotary_width(small) // (2 if half else 1)) * table_bytes for small in smalls]
        if all(pair and measured % pair == 0 for measured, pair in zip(rest, pairs, strict=True)):
            break
    else:
        raise ProbeError(
            f"it saves {rest[0]} bytes per position that are not rotary tables (pairs of "
            f"{2 * rotary_width(smalls[0]) * table_bytes}, or of half the width) nor "
            "explained by its sizes"
        )
    counts = {measured // pair for measured, pair in zip(rest, pairs, strict=True)}
    if len(counts) != 1:
        raise ProbeError(f"its rotary tables change with its sizes ({sorted(counts)} pairs)")
    return merged(terms), counts.pop(), dtype, half
