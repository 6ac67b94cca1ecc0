"""Applies a policy's TP plan to a model in place, on PyTorch DTensor (the CPU-capable backend).

``apply_tp_plan`` resolves each pattern of the plan to the model's modules, parallelizes
each with its style (``styles.make_style``), keeps tied parameters tied, gives attention
modules their per-rank head bookkeeping and the TP-region random stream, and installs the
vocabulary-parallel loss. Module names and parameter names do not change; parameters
become DTensors on the TP mesh, so ``state_dict()`` keeps Hugging Face's keys and
``full_tensor()`` of each value is the unsharded parameter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker._torch_compat import compile as compile_compat
from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker.policies import HeadSplit, ModelPolicy
from torch_sagemaker.policies.module_layout import (
    FULL_WIDTH_ATTRS,
    attention_head_dim,
    packed_blocks,
)
from torch_sagemaker.tensor_parallel.fused_rows import FusedRowsColwise
from torch_sagemaker.tensor_parallel.generation import gather_logits_in_generate
from torch_sagemaker.tensor_parallel.loss import causal_lm_loss
from torch_sagemaker.tensor_parallel.projection_styles import (
    PROJECTION_STYLES,
    make_projection_style,
)
from torch_sagemaker.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from torch_sagemaker.tensor_parallel.replicated_styles import (
    REPLICATED_STYLES,
    STYLE_ATTR,
    OwnedOutput,
    make_replicated_style,
)
from torch_sagemaker.tensor_parallel.styles import (
    SequenceParallelNorm,
    make_style,
    shard_given_embeddings,
)
from torch_sagemaker.utils.hf_config import text_config

#: Styles that name a bare parameter (``self_attn.sinks``), not a module.
PARAMETER_STYLES = ("param_colwise", "param_rowwise")

# Attributes Hugging Face attention modules may keep head counts in (older code reshapes
# with them instead of -1); scaled to the per-rank counts when the plan splits the heads.
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")
# The widths of all heads together are scaled likewise (``FULL_WIDTH_ATTRS``).

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TPReport:
    """What ``apply_tp_plan`` did (for the one-line log and for tests).

    Attributes:
        modules: Number of modules parallelized, per style name.
        heads: The head split used.
    """

    modules: dict[str, int]
    heads: HeadSplit


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) pairs that share one parameter object, for each shared parameter."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Points every member of each tied group at one (parallelized) parameter.

    Note [Tied parameters of parameter holders]: a module styled ``local_params`` only holds
    parameters (its own forward sees their plain values); the ones no entry split are
    replicated. One of them may be tied to a parameter that a module below it splits:
    RoBERTa's ``lm_head.bias`` is its ``lm_head.decoder.bias``, split with the vocabulary.
    That parameter is split by an entry after all, so the split one wins there. Anywhere
    else two members given different layouts are an error (a holder elsewhere would compute
    with a split value where it expects the whole): the plan must split tied parameters
    alike.
    """
    for group in groups:
        split = next(
            ((m, n) for m, n in group if not _is_holder(m) and isinstance(getattr(m, n), DTensor)),
            None,
        )
        first_module, first_name = split if split is not None else group[0]
        param = getattr(first_module, first_name)
        for module, name in group:
            if module is first_module and name == first_name:
                continue
            current = getattr(module, name)
            above_split = _is_holder(module) and any(m is first_module for m in module.modules())
            if (
                not above_split
                and isinstance(current, DTensor)
                and isinstance(param, DTensor)
                and current.placements != param.placements
            ):
                raise ValueError(
                    f"tied parameters {first_name} ({param.placements}) and {name} "
                    f"({current.placements}) were given different TP layouts; the policy must "
                    "split tied parameters the same way (e.g. vocab_embedding with lm_head)."
                )
            module.register_parameter(name, param)


def _is_holder(module: nn.Module) -> bool:
    """Whether ``module`` is styled ``local_params`` (it only holds parameters)."""
    return getattr(module, STYLE_ATTR, None) == "local_params"


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of the modules of ``model`` whose full name matches ``pattern`` (``fnmatch``)."""
    return [name for name, _ in model.named_modules() if name and fnmatchcase(name, pattern)]


def _split_parameter(
    model: nn.Module, name: str, style_name: str, mesh: DeviceMesh, src_data_rank: int | None
) -> None:
    """Makes parameter ``name`` a DTensor split as ``style_name`` (``PARAMETER_STYLES``)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = getattr(owner, attr)
    placement: Placement
    if style_name == "param_colwise":
        placement = Shard(max(param.ndim - 2, 0))
    else:
        placement = Shard(param.ndim - 1) if param.ndim > 1 else Replicate()
    dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank)
    owner.register_parameter(attr, nn.Parameter(dt, requires_grad=param.requires_grad))


def _splits_heads(attention: nn.Module) -> bool:
    """Whether ``attention`` holds a parameter split over the TP ranks (its heads are split).

    A plan may leave some attention modules whole (a hybrid's linear attention): those keep
    their head counts and draw from the shared random stream.
    """
    return any(
        isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
        for p in attention.parameters()
    )


def _set_head_counts(
    attention: nn.Module, heads: HeadSplit, width_attrs: tuple[tuple[str, str | None], ...] = ()
) -> None:
    """Per-rank head bookkeeping on one attention module (Hugging Face's attributes)."""
    # Hugging Face attention infers the head count from the shapes (view(..., -1, head_dim));
    # the query-per-kv grouping is stored, and it changes only when kv heads are replicated
    # (split evenly, each rank keeps the same grouping; some families give layers their own
    # kv head counts, which the module's value already reflects).
    # (torch types nn.Module attributes as tensors or modules; these are ints)
    if hasattr(attention, "num_key_value_groups") and heads.kv_replicated:
        attention.num_key_value_groups = heads.local_heads // heads.local_kv_heads  # type: ignore[assignment]
    for attrs, full, local in (
        (_HEAD_ATTRS, heads.num_heads, heads.local_heads),
        (_KV_HEAD_ATTRS, heads.num_kv_heads, heads.local_kv_heads),
    ):
        for attr in attrs:
            if getattr(attention, attr, None) == full:
                setattr(attention, attr, local)
    # Older BERT-style attention reshapes the heads' concatenation by ``all_head_size`` rather
    # than by -1, and GPT-2's splits its packed [q | k | v] output by ``split_size`` (Note
    # [Packed projections]): those widths are per rank too. (Not ``embed_dim``, which looks
    # alike in XGLM: CodeGen divides it into its own fused layout's blocks, and rescaling it
    # gave wrong values there; a policy names it where it means that: ``width_attrs``.)
    # (Once per module, as the plan is applied: a width without a head size is scaled by
    # the heads' share whatever its value, so each attribute is scaled at most once here.)
    scaled: set[str] = set()
    for attr, size_attr in (*FULL_WIDTH_ATTRS, *width_attrs):
        width = getattr(attention, attr, None)
        if attr in scaled or not isinstance(width, int) or width <= 0:
            continue
        if size_attr is None:  # (a policy's width without a head size: by the heads' share)
            if width % heads.num_heads == 0:
                setattr(attention, attr, width // heads.num_heads * heads.local_heads)
                scaled.add(attr)
            continue
        size = getattr(attention, size_attr, None)
        if isinstance(size, int) and size > 0 and width == heads.num_heads * size:
            setattr(attention, attr, heads.local_heads * size)
            scaled.add(attr)


# Note [TP regions under torch.compile]: a TP region swaps the default generator's state
# (``RNGStatesTracker.fork``), which Dynamo cannot trace: it breaks the graph there. A graph
# break inside a compiled layer of DTensors made PyTorch's compiled autograd return wrong
# gradients (a tiny Llama at tp 2 with compiled decoder layers: the input norm's gradient
# 127% off) or fail ("'Tensor' object has no attribute 'elem'"). While compiling, a region
# that draws nothing (the module in eval mode, or every dropout rate it or its config names
# at 0, SMP's setting for its models) is therefore skipped: it would only have swapped the
# states back and forth. A region that may draw raises instead, naming the fixes: its
# per-rank streams cannot be compiled. Eager execution is unchanged.
_DROPOUT_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def region_may_draw(module: nn.Module) -> bool:
    """Whether a TP region around ``module`` can draw random numbers in its forward.

    True in training mode unless every dropout rate found is 0: ``nn.Dropout`` submodules,
    numbers in the module's attributes whose name holds "drop" (``attention_dropout``,
    ``resid_pdrop``), and in its ``config``'s attention and residual ones
    (``attention_dropout``, ``attn_pdrop``, ``resid_pdrop``); also True when no rate is found
    at all (nothing says the region draws nothing).
    """
    if not module.training:
        return False
    rates = [m.p for m in module.modules() if isinstance(m, _DROPOUT_MODULES)]
    config = getattr(module, "config", None)
    named = [(n, v) for n, v in vars(module).items() if "drop" in n]
    if config is not None:  # the config's attention and residual rates, not the model's others
        named += [
            (n, v) for n, v in vars(config).items() if "drop" in n and ("att" in n or "resid" in n)
        ]
    rates += [float(v) for _, v in named if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return not rates or any(rate > 0 for rate in rates)


def install_rng_region(
    module: nn.Module, tracker: RNGStatesTracker, ends_at: tuple[nn.Module, ...] = ()
) -> None:
    """Runs ``module``'s forward inside ``tracker.fork()`` (a TP region: per-rank random draws).

    Args:
        module: The attention module.
        tracker: The TP ranks' random streams.
        ends_at: Submodules whose input is where the region ends (Note [Residual dropout
            inside attention]): the rest of the forward draws from the shared stream.

    Raises:
        RuntimeError: In a forward that ``torch.compile`` traces, when the region may draw
            random numbers (Note [TP regions under torch.compile]).
    """
    stack: list[Any] = []

    def enter(mod: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            if region_may_draw(mod):
                # Not a raise: Dynamo would break the graph there and run this hook eagerly,
                # where it would not raise.
                compile_compat.fail_compilation(
                    lambda: (
                        f"torch.compile of {type(mod).__name__} under tensor parallelism: it "
                        "may apply dropout, whose per-rank random streams (a TP region) cannot "
                        "be compiled. Set its dropout rates to 0 (SMP's setting), compile it in "
                        "eval mode, or leave the attention uncompiled."
                    )
                )
            stack.append(None)  # draws nothing: no swap (Note [TP regions under torch.compile])
            return
        ctx = tracker.fork(MODEL_PARALLEL_RNG)
        ctx.__enter__()
        stack.append(ctx)

    def leave(*_: Any) -> None:
        if stack:
            ctx = stack.pop()
            if ctx is not None:
                # An always_call hook runs while the forward's exception (if any) is in
                # flight: the region learns of it (Note [Unreplayed TP-region draws]).
                ctx.__exit__(*sys.exc_info())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    for end in ends_at:
        end.register_forward_pre_hook(leave)


# Note [Nested attention modules]: some models wrap their attention in another module that a
# plan also names as attention (GPT-Neo's GPTNeoAttention holds GPTNeoSelfAttention). Each got
# a TP region ending at the same output projection, so the two regions were left out of
# order: the default generator was left holding this rank's TP stream, and every later
# shared draw (residual dropout) differed between the TP ranks; under activation
# checkpointing the backward raised as if a region had drawn unreplayed. The head counts are
# set on every level (either may reshape with them); the region and the gathering of
# attention weights belong to the outermost attention module only.


#: Row-parallel styles whose output is whole on every rank (the replicated layout).
_WHOLE_OUTPUT_ROWWISE = ("rowwise_allreduce", "rowwise_split_input", "conv1d_rowwise_allreduce")


def _whole_output_projections(attention: nn.Module) -> tuple[nn.Module, ...]:
    """The attention's output projections after which every TP rank holds the whole output.

    Note [Residual dropout inside attention]: the TP region (per-rank draws, for the
    attention probabilities of this rank's heads) used to span the whole attention forward.
    Some models drop out the projected output inside it too (StarCoder2's
    ``residual_dropout``, GPT-J's and CodeGen's ``resid_pdrop``): a replicated activation,
    which must get the same mask on every rank. It got a different one, and the first-use
    check blamed the next norm's plan entry (or, had the check passed, the replicated
    parameters trained apart). On the replicated layout the region now ends where the
    all-reduced output projection starts. The policies' sequence-parallel layout splits
    that output over the sequence instead; no policy model drops out inside attention.
    """
    return tuple(
        m for m in attention.modules() if getattr(m, STYLE_ATTR, None) in _WHOLE_OUTPUT_ROWWISE
    )


def gather_attention_weights(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Makes an attention module whose heads are split return every head's weights.

    With ``output_attentions=True`` Hugging Face attention returns ``(output, weights)``,
    the weights of this rank's heads (``batch, local heads, queries, keys``): the model's
    ``attentions`` silently held a fraction of the heads. They are all-gathered over the TP
    ranks in head order (rank r holds heads ``[r * h / tp, (r + 1) * h / tp)``).
    """

    def gather(_mod: nn.Module, _args: Any, out: Any) -> Any:
        if not (isinstance(out, tuple) and len(out) > 1 and isinstance(out[1], torch.Tensor)):
            return out
        weights = out[1]
        if isinstance(weights, DTensor) or weights.dim() != 4:
            return out
        heads = DTensor.from_local(weights.contiguous(), tp_mesh, [Shard(1)], run_check=False)
        return (out[0], heads.full_tensor(), *out[2:])

    module.register_forward_hook(gather)


def _head_dim(model: nn.Module, name: str, attention: list[str]) -> int:
    """Head size for the module ``name``: that of the attention module holding it."""
    owner = next((a for a in attention if name.startswith(f"{a}.")), None)
    module = model.get_submodule(owner) if owner is not None else model
    return attention_head_dim(module, text_config(model))


def _replicates_buffers(style: Any) -> bool:
    """Whether applying ``style`` replicates its module's buffers with ``distribute_module``.

    PyTorch's column-, row- and sequence-parallel styles, ours built on them and our
    sequence-parallel norms do; the replicated-layout styles swap parameters only and leave
    buffers plain.
    """
    inner = style.inner if isinstance(style, OwnedOutput) else style
    return isinstance(
        inner, (ColwiseParallel, RowwiseParallel, SequenceParallel, SequenceParallelNorm)
    )


def _wait_when_dropped(_module: nn.Module, _args: Any, output: Any) -> None:
    """Forward hook: the collectives behind ``output`` are waited for even if nothing uses it.

    A row-parallel output's reduce-scatter that a checkpointed layer's recompute never uses
    stayed registered for good (Note [Collectives nobody waits for] in _torch_compat/c10d.py).
    """
    if torch.compiler.is_compiling():
        return  # a compiled graph waits for its collectives itself
    for value in output if isinstance(output, (tuple, list)) else (output,):
        c10d_compat.wait_when_dropped(value)


def _replicate_buffers_locally(module: nn.Module, mesh: DeviceMesh) -> None:
    """Makes the plain buffers under ``module`` ``Replicate`` DTensors, with no communication.

    ``parallelize_module`` replicates every buffer its style leaves plain with PyTorch's
    ``distribute_module``, which broadcasts from rank 0 whatever ``src_data_rank`` it was
    given. With a local split (``src_data_rank=None``: rank-0 loading, where the other ranks
    hold meta tensors) only rank 0 entered that broadcast, and the next collective paired
    the wrong messages: loading Gemma (its embedding's ``embed_scale`` buffer) from rank 0
    failed with a collective mismatch. Rank 0's buffer values reach the others afterwards,
    with the parameters (``loading.broadcast_from_rank0``).
    """
    for sub in module.modules():
        buffers = nn_compat.own_buffers(sub)
        for key, buffer in buffers.items():
            if buffer is not None and not isinstance(buffer, DTensor):
                buffers[key] = distribute_tensor(
                    buffer, mesh, [Replicate()] * mesh.ndim, src_data_rank=None
                )


def apply_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    policy: ModelPolicy,
    heads: HeadSplit,
    *,
    tracker: RNGStatesTracker,
    src_data_rank: int | None = 0,
) -> TPReport:
    """Tensor-parallelizes ``model`` in place according to ``policy.tp_plan``.

    Args:
        model: A Hugging Face causal LM covered by ``policy`` (real or meta device).
        tp_mesh: 1-D mesh of the TP group.
        policy: The model's policy.
        heads: The head split (``policy.check_model``).
        tracker: RNG tracker whose stream the attention modules draw from.
        src_data_rank: ``0`` makes TP rank 0's weights authoritative (scatter/broadcast);
            ``None`` splits locally without communication (meta models, rank-0 loading).

    Returns:
        A ``TPReport``.

    Raises:
        ValueError: If a plan pattern matches no module, or a parameter is left unsharded
            (the policy does not fit the model).
    """
    tp_rank = tp_mesh.get_local_rank()
    kv_head = heads.kv_head_of(tp_rank) if heads.kv_replicated else None
    attention_names = [n for n, _ in policy.attention_modules(model)]
    tied = _tied_groups(model)
    counts: dict[str, int] = {}
    for pattern, style_name in policy.tp_plan.items():
        if style_name in PARAMETER_STYLES:
            names = [n for n, _ in model.named_parameters() if fnmatchcase(n, pattern)]
        else:
            names = matching_modules(model, pattern)
        if not names:
            raise ValueError(
                f"policy {policy.name!r}: TP plan pattern {pattern!r} matches no "
                f"{'parameter' if style_name in PARAMETER_STYLES else 'module'} "
                f"of {type(model).__name__}; the policy does not fit this model."
            )
        for name in names:
            if style_name in PARAMETER_STYLES:
                _split_parameter(model, name, style_name, tp_mesh, src_data_rank)
                continue
            style: ParallelStyle
            if style_name == "shared_kv_colwise":  # one key and one value head
                shared = 2 * _head_dim(model, name, attention_names)
                style = FusedRowsColwise(shared=shared, name=name)
            elif style_name == "linear_packed_colwise":
                widths = packed_blocks(model, name, attention_names)
                # (inside attention each rank's part of each block must be whole heads:
                # refused where the key/value heads do not divide over the degree)
                inside = any(name.startswith(f"{a}.") for a in attention_names)
                head_dim = _head_dim(model, name, attention_names) if inside else 1
                style = FusedRowsColwise(blocks=widths, head_dim=head_dim, name=name)
            elif style_name in PROJECTION_STYLES:
                blocks = 1
                if style_name == "conv1d_packed_colwise":
                    widths = packed_blocks(model, name, attention_names)
                    if len(set(widths)) > 1:
                        raise ValueError(
                            f"{name}: a packed Conv1D projection splits equal blocks only, "
                            f"not {widths} (Note [Packed projections])."
                        )
                    blocks = len(widths)
                style = make_projection_style(style_name, blocks=blocks)
            elif style_name in REPLICATED_STYLES:
                style = make_replicated_style(
                    style_name,
                    module_name=name,
                    config=text_config(model),
                    layer_class=policy.layer_class,
                )
            else:
                head_dim = _head_dim(model, name, attention_names) if kv_head is not None else 0
                style = make_style(style_name, head_dim=head_dim, kv_head=kv_head)
            # parallelize_module sets the style's src_data_rank from its own argument.
            module = model.get_submodule(name)
            if src_data_rank is None and _replicates_buffers(style):
                _replicate_buffers_locally(module, tp_mesh)
            parallelize_module(module, tp_mesh, style, src_data_rank=src_data_rank)
            module.register_forward_hook(_wait_when_dropped)
            setattr(module, STYLE_ATTR, style_name)
            if style_name == "vocab_embedding" and "." in name:
                shard_given_embeddings(model.get_submodule(name.rsplit(".", 1)[0]), tp_mesh)
            if style_name == "lm_head":
                gather_logits_in_generate(model, name)
        counts[style_name] = counts.get(style_name, 0) + len(names)
    _retie(tied)
    attention_modules = policy.attention_modules(model)
    outer = {n for n, _ in attention_modules}
    for name, attention in attention_modules:
        if policy.heads_split and _splits_heads(attention):
            _set_head_counts(attention, heads, policy.width_attrs)
            if any(name.startswith(f"{o}.") for o in outer):
                continue  # Note [Nested attention modules]
            install_rng_region(attention, tracker, ends_at=_whole_output_projections(attention))
            gather_attention_weights(attention, tp_mesh)
    left = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise ValueError(
            f"policy {policy.name!r} left parameters unsharded: {left[:6]}"
            f"{' ...' if len(left) > 6 else ''}; add a TP plan entry for their modules "
            "(use 'replicate' for small replicated modules)."
        )
    if counts.get("lm_head"):
        # Vocabulary-parallel logits need the vocabulary-parallel loss. Other heads (sequence
        # or token classification) give replicated logits, and the model's own loss applies.
        cast("PreTrainedModel", model).loss_function = causal_lm_loss
    return TPReport(modules=counts, heads=heads)


__all__ = ["TPReport", "apply_tp_plan", "install_rng_region", "matching_modules"]
