"""Makes a Hugging Face causal LM context parallel, in place (called by ``tsm.transform``).

Four changes, none of which touches a parameter (so context parallelism composes with
tensor parallelism, delayed initialisation, FSDP and checkpoints unchanged):

1. every attention module of the policy gets a ``ContextParallelAttention`` and the
   config's attention implementation becomes ``ATTENTION_NAME``
   (Note [Context parallel attention dispatch]);
2. a forward pre-hook on the decoder stack (``model.base_model``) checks the input
   (Note [Context parallel input check]) and supplies the global positions of the local
   tokens as ``position_ids``, from which every family computes RoPE; Hugging Face would
   otherwise number the local tokens ``0 .. 2c-1``;
3. the model's loss function is wrapped (Note [Context parallel loss]), and a forward hook
   recomputes a mixture of experts' router auxiliary loss over the whole sequences
   (Note [Context parallel router auxiliary loss]);
4. the model records that it is context parallel (``MODEL_ATTR``), which the FSDP entry
   points check.

Note [Context parallel input check]
Each forward pass all-gathers four integers per rank over the context parallel group:
the local length, a fingerprint of the local token ids, whether they are all equal, and
whether the rank found a problem with its own input (an odd local length, i.e. a
sequence that does not split into ``2 * cp`` chunks; a KV cache; a padding mask).
Unequal lengths mean the ranks were given different shapes; identical fingerprints on
every rank mean every rank got the same, unsplit sequences, as when the batch was not
passed through ``split_sequence``/SMP's ``get_batch_for_cp_rank``, unless each rank's two
chunks are equal too: a correctly split sequence whose ``2 * cp`` chunks all repeat (constant
or periodic tokens, e.g. a period dividing ``S / (2 * cp)``) gives every rank the same tokens,
and is accepted (an unsplit batch of such sequences then goes unnoticed; natural text does
not repeat chunk for chunk). All of these would silently train on garbage, so they raise,
and on every rank of the group at once (a rank raising alone would leave the others
waiting in the attention's first collective until the timeout). The cost is one tiny
collective per forward pass, not per layer.
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from torch_sagemaker.context_parallel import attention
from torch_sagemaker.context_parallel.comm import all_gather_stacked
from torch_sagemaker.context_parallel.layout import check_local_length, local_positions
from torch_sagemaker.context_parallel.loss import RouterAuxLoss, context_parallel_loss
from torch_sagemaker.policies import ModelPolicy
from torch_sagemaker.utils.hf_config import text_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Attribute set on a model prepared for context parallelism (its ``ContextParallelAttention``).
MODEL_ATTR = "_tsm_context_parallel_model"


#: ``layer_types`` entries context parallelism runs exactly: softmax attention over the whole
#: causal sequence (a sliding window is refused on its own, by ``sliding_window_attr``) and
#: layers that mix no positions. Every other kind (``linear_attention``, ``conv``, ``hybrid``,
#: ``indexed_attention``, ``chunked_attention``, ...) is refused (Note [Context parallel
#: sequence mixers]).
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "mlp", "moe"})

_FIX = (
    "Use context_parallel_degree=1 for this model (tensor or data parallelism split it "
    "without splitting the sequence)."
)


def check_supported(model: nn.Module, policy: ModelPolicy) -> None:
    """Refuses models context parallel attention cannot run exactly.

    The config checks of ``check_config_supported``, then the model's own modules
    (Note [Context parallel sequence mixers]).

    Raises:
        ValueError: For a sliding-window configuration or a layer that mixes positions other
            than through the attention modules context parallelism prepares, naming the
            attribute or the modules and the fix.
    """
    name = type(model).__name__
    check_config_supported(text_config(model), policy, name)
    found = unsupported_mixers(model, policy)
    if found:
        listed = "; ".join(f"{n} ({kind}: {why})" for n, kind, why in found[:6])
        more = f"; and {len(found) - 6} more" if len(found) > 6 else ""
        raise ValueError(
            f"{name} is not supported with context parallelism: its decoder layers mix "
            "sequence positions in modules that are not the softmax attention context "
            f"parallelism splits over the ranks: {listed}{more}. Each rank would run them on "
            f"its part of the sequence alone. {_FIX}"
        )


def _text_configs(config: Any) -> list[Any]:
    """``config`` and, for a multimodal one, its text config (where the layers are)."""
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # a config that refuses to name one: only itself
            text = None
        if text is not None and text is not config:
            configs.append(text)
    return configs


def check_config_supported(config: Any, policy: ModelPolicy, model_name: str) -> None:
    """``check_supported`` on a model's Hugging Face config alone (no model needed).

    Args:
        config: The model's config.
        policy: Its policy (which attribute holds a sliding window).
        model_name: The model's class name, for the message.

    Raises:
        ValueError: For a sliding-window configuration, or layer types, chunked attention or
            a sparse attention indexer context parallelism cannot split (Note [Context
            parallel sequence mixers]), naming the attribute and the fix.
    """
    attr = policy.sliding_window_attr
    window = getattr(config, attr, None) if attr else None
    if window is not None:
        raise ValueError(
            f"{model_name} has {attr}={window}: sliding-window attention is not "
            f"supported with context parallelism (as in SMP). Set {attr} = None in the "
            "model's config (a multimodal model's text_config) before building the model "
            "(full causal attention), or use context_parallel_degree=1."
        )
    for cfg in _text_configs(config):
        layer_types = getattr(cfg, "layer_types", None)
        if isinstance(layer_types, (list, tuple)):
            bad: dict[str, list[int]] = {}
            for i, kind in enumerate(layer_types):
                if kind not in SUPPORTED_LAYER_TYPES:
                    bad.setdefault(str(kind), []).append(i)
            if bad:
                listed = ", ".join(f"{k!r} (layers {v})" for k, v in bad.items())
                raise ValueError(
                    f"{model_name} is not supported with context parallelism: its config's "
                    f"layer_types include {listed}. Context parallelism splits only softmax "
                    "attention over the whole causal sequence (layer types "
                    f"{sorted(SUPPORTED_LAYER_TYPES)}); recurrent, linear-attention, "
                    "convolution, state-space, chunked or sparse (indexed) attention layers "
                    f"would run on each rank's part of the sequence alone. {_FIX}"
                )
        chunk = getattr(cfg, "attention_chunk_size", None)
        if chunk is not None:
            raise ValueError(
                f"{model_name} has attention_chunk_size={chunk}: chunked attention is not "
                f"supported with context parallelism (it attends over the whole causal "
                f"sequence). {_FIX}"
            )
        topk = getattr(cfg, "index_topk", None)
        if topk is not None:
            raise ValueError(
                f"{model_name} has index_topk={topk}: sparse attention whose keys a lightning "
                "indexer selects (DeepSeek sparse attention) is not supported with context "
                f"parallelism (the indexer scores only the rank's own tokens). {_FIX}"
            )


def _uses_attention_interface(module: nn.Module) -> bool | None:
    """Whether ``module``'s forward dispatches through Hugging Face's attention interface.

    ``None`` when its source cannot be read (then nothing is claimed).
    """
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    return any(
        word in source
        for word in ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "_attn_implementation")
    )


def _sequence_mixing(module: nn.Module, attention: set[int]) -> str | None:
    """Why ``module`` (inside a decoder layer) mixes positions CP would not see, or ``None``."""
    named_attention = re.search(r"(Attention|Attn)$", type(module).__name__) is not None
    if id(module) in attention and named_attention and _uses_attention_interface(module) is False:
        return (
            "an attention module that computes its own (linear or recurrent) attention "
            "instead of calling Hugging Face's AttentionInterface"
        )
    for name, child in module.named_modules():
        if name and id(child) in attention:
            continue
        if isinstance(child, nn.Conv1d) and child.kernel_size[0] > 1:
            where = f"{name}: " if name else ""
            return (
                f"a convolution over the sequence ({where}Conv1d, kernel "
                f"{child.kernel_size[0]}), as in state-space, short-convolution and "
                "delta-rule layers"
            )
        if type(child).__name__.endswith("Indexer"):
            return f"a sparse attention indexer ({name}: {type(child).__name__})"
    return None


def unsupported_mixers(model: nn.Module, policy: ModelPolicy) -> list[tuple[str, str, str]]:
    """Modules of ``model``'s decoder layers that mix positions outside CP's attention.

    Note [Context parallel sequence mixers]
    Context parallelism splits every sequence over the ranks and makes exactly one kind of
    module see the whole of it: the attention modules of the policy, whose forward calls
    the function registered in Hugging Face's ``AttentionInterface`` (causal softmax
    attention). Every other module must act on each position alone. Hybrid models break
    this (lfm2_moe's short convolutions, falcon_h1/nemotron_h/bamba's Mamba mixers,
    qwen3_next/olmo_hybrid's gated delta nets, minimax's lightning attention, kimi_linear
    and bailing_hybrid's delta attention), and so do attention kinds the function does not
    compute (DeepSeek sparse attention's indexer, llama4's chunked attention): run on a
    rank's part of the sequence they silently give other numbers, or crash. Two checks
    refuse them at transform time:

    - the config (``check_config_supported``, which the planner also runs): every entry of
      ``layer_types`` must be in ``SUPPORTED_LAYER_TYPES``, and ``attention_chunk_size``
      and ``index_topk`` must be unset;
    - the modules (this function, for configs that do not describe their layers): inside
      every decoder layer, a module of the policy's attention must call the attention
      interface (read from its forward's source) if its class is named ``...Attention`` or
      ``...Attn`` (a pattern may also match a hybrid layer's MLP); no module may hold an
      ``...Indexer`` (sparse attention's key selection) or an ``nn.Conv1d`` with a kernel
      longer than 1 (a convolution along the sequence, which every state-space,
      short-convolution and delta-rule mixer of transformers has).

    Args:
        model: The model (any device, meta included).
        policy: Its policy (the attention modules and the decoder layer class).

    Returns:
        ``(module name, class name, why)`` of each offending module, first per layer child.
    """
    attention = {id(m) for _, m in policy.attention_modules(model)}
    try:
        layer_cls = policy.layer_cls(model)
    except ValueError:
        return []
    found = []
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, layer_cls):
            continue
        for child_name, child in layer.named_children():
            why = _sequence_mixing(child, attention)
            if why is not None:
                found.append((f"{layer_name}.{child_name}", type(child).__name__, why))
    return found


def _fingerprint(ids: torch.Tensor) -> tuple[int, int]:
    """A position-weighted checksum of token ids and whether their two chunks are equal.

    Equal chunks (every row's first half equal to its second: constant or periodic tokens)
    are what a correctly split sequence whose chunks all repeat gives every rank, so the
    identical fingerprints of such input prove nothing (Note [Context parallel input check]).
    """
    weights = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int64)
    flat = ids.reshape(-1).to(torch.int64)
    half = ids.shape[1] // 2
    repeating = ids.shape[1] % 2 == 0 and bool(torch.equal(ids[:, :half], ids[:, half:]))
    return int((flat * weights).sum()), int(repeating)


class InputCheck:
    """Forward pre-hook of the decoder stack: input checks, positions, no KV cache.

    Args:
        group: The context parallel group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict]:
        """The checked inputs as keywords: cache and mask off, this rank's position ids added.

        Raises:
            TypeError: For more than one positional input.
            ValueError: For inputs context parallelism cannot take, on any rank of the group.
        """
        if len(args) > 1:
            raise TypeError(
                "a context parallel model takes its inputs as keywords (input_ids=..., "
                "labels=...); got more than one positional argument."
            )
        if args:
            kwargs["input_ids"], args = args[0], ()
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        source = ids if ids is not None else embeds
        if source is None:
            raise ValueError("a context parallel model needs input_ids or inputs_embeds.")
        local_len = source.shape[1]
        # Every rank must reach the same verdict, or the others would wait in the next
        # collective: local problems travel with the gathered check (Note [Context parallel
        # input check]).
        problem = self._local_problem(kwargs, local_len)
        self._check_group(local_len, ids, problem)
        kwargs["use_cache"] = False
        kwargs["attention_mask"] = None
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = local_positions(
                self.rank, self.cp, local_len, device=source.device
            ).unsqueeze(0)
        return args, kwargs

    def _local_problem(self, kwargs: dict[str, Any], local_len: int) -> str | None:
        """What is wrong with this rank's input alone, or ``None``."""
        try:
            check_local_length(local_len, self.cp)
        except ValueError as e:
            return str(e)
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (and renames a caller's
        # past_key_values before this hook sees it); both spellings are checked.
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return (
                "context parallelism has no KV cache (generation); pass use_cache=False and "
                "no cache (past_key_values=None, or cache=None from transformers 5.24)."
            )
        mask = kwargs.get("attention_mask")
        if mask is not None and (
            mask.dim() != 2 or mask.shape[1] != local_len or not bool(mask.bool().all())
        ):
            return (
                "context parallel attention is causal over the whole sequence and supports no "
                f"padding or custom attention mask (got a mask of shape {tuple(mask.shape)} "
                "that is not all ones). Pass attention_mask=None and give padding tokens the "
                "label -100."
            )
        return None

    def _check_group(self, local_len: int, ids: torch.Tensor | None, problem: str | None) -> None:
        """Note [Context parallel input check]."""
        fingerprint, repeating = _fingerprint(ids) if ids is not None else (self.rank, 1)
        mine = torch.tensor(
            [local_len, fingerprint, repeating, problem is not None], dtype=torch.int64
        )
        if ids is not None:
            mine = mine.to(ids.device)
        gathered = all_gather_stacked(mine, self.group)
        if problem is not None:
            raise ValueError(problem)
        failed = [r for r, flag in enumerate(gathered[:, 3].tolist()) if flag]
        if failed:
            raise ValueError(
                f"context parallel rank(s) {failed} of this group rejected their "
                "input (see their error); every rank of the group stops."
            )
        lengths = gathered[:, 0].tolist()
        if len(set(lengths)) > 1:
            raise ValueError(
                f"the context parallel ranks got sequences of different local lengths {lengths}; "
                "every rank of a context parallel group must get its part of the same sequences "
                "(split with torch_sagemaker.context_parallel.split_sequence)."
            )
        same = bool((gathered[:, 1] == gathered[0, 1]).all())
        if same and not bool(gathered[:, 2].all()):
            raise ValueError(
                f"every context parallel rank got the same {local_len} tokens per sequence: the "
                "input looks unsplit. With context_parallel_degree="
                f"{self.cp}, rank r must get chunks r and {2 * self.cp - 1}-r of each sequence cut "
                f"into {2 * self.cp} (torch_sagemaker.context_parallel.split_sequence, or SMP's "
                "get_batch_for_cp_rank)."
            )


def prepare_model(
    model: nn.Module, policy: ModelPolicy, comm_type: str, group: dist.ProcessGroup
) -> None:
    """Makes ``model`` context parallel over ``group`` in place (see the module docstring).

    Args:
        model: A Hugging Face causal LM covered by ``policy`` (after tensor parallelism).
        policy: Its policy (attention modules, sliding-window attribute).
        comm_type: ``"p2p"`` or ``"all_gather"``.
        group: The context parallel process group.

    Raises:
        ValueError: For an unsupported configuration or a model without attention modules.
    """
    check_supported(model, policy)
    plan = attention.ContextParallelAttention(group, comm_type)
    modules = policy.attention_modules(model)
    if not modules:
        raise ValueError(
            f"policy {policy.name!r}: attention pattern {policy.attention!r} matches "
            f"no module of {type(model).__name__}."
        )
    for _, module in modules:
        setattr(module, attention.CP_ATTR, plan)
    attention.register()
    hf = cast("PreTrainedModel", model)  # a Hugging Face causal LM (see Args)
    hf.config._attn_implementation = attention.ATTENTION_NAME
    decoder = hf.base_model
    if decoder is model:
        raise ValueError(
            f"{type(model).__name__} has no decoder stack (base_model); context "
            "parallelism prepares causal LM classes (e.g. LlamaForCausalLM)."
        )
    decoder.register_forward_pre_hook(InputCheck(group), with_kwargs=True)
    hf.loss_function = context_parallel_loss(hf.loss_function, group)
    model.register_forward_hook(RouterAuxLoss(group), with_kwargs=True)
    setattr(model, MODEL_ATTR, plan)


def is_context_parallel(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it, e.g. under wrappers) was prepared."""
    return any(getattr(m, MODEL_ATTR, None) is not None for m in model.modules())


def check_prepared(module: nn.Module, cp_size: int, where: str) -> None:
    """Refuses to wrap a model that was not prepared while ``context_parallel_degree > 1``.

    Args:
        module: The module being wrapped (FSDP's root).
        cp_size: The context parallel degree.
        where: What is wrapping, for the message (``"FSDP"``).

    Raises:
        ValueError: If ``cp_size > 1`` and ``module`` was not prepared.
    """
    if cp_size > 1 and not is_context_parallel(module):
        raise ValueError(
            f"context_parallel_degree={cp_size} but {type(module).__name__} given to {where} did "
            "not go through tsm.transform: each rank holds only part of every sequence, so the "
            "model must run context parallel attention. Call model = tsm.transform(model) before "
            f"{where}, or set context_parallel_degree=1."
        )


__all__ = [
    "SUPPORTED_LAYER_TYPES",
    "InputCheck",
    "MODEL_ATTR",
    "check_config_supported",
    "check_prepared",
    "check_supported",
    "is_context_parallel",
    "prepare_model",
    "unsupported_mixers",
]
