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
3. the model's loss function is wrapped (Note [Context parallel loss]);
4. the model records that it is context parallel (``MODEL_ATTR``), which the FSDP entry
   points check.

Note [Context parallel input check]
Each forward pass all-gathers four integers per rank over the context parallel group:
the local length, a fingerprint of the local token ids, whether they are all equal, and
whether the rank found a problem with its own input (an odd local length, i.e. a
sequence that does not split into ``2 * cp`` chunks; a KV cache; a padding mask).
Unequal lengths mean the ranks were given different shapes; identical fingerprints on
every rank (for non-constant tokens) mean every rank got the same, unsplit sequences,
as when the batch was not passed through ``split_sequence``/SMP's
``get_batch_for_cp_rank``. All of these would silently train on garbage, so they raise,
and on every rank of the group at once (a rank raising alone would leave the others
waiting in the attention's first collective until the timeout). The cost is one tiny
collective per forward pass, not per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from torch_sagemaker.context_parallel import attention
from torch_sagemaker.context_parallel.comm import all_gather_stacked
from torch_sagemaker.context_parallel.layout import check_local_length, local_positions
from torch_sagemaker.context_parallel.loss import context_parallel_loss
from torch_sagemaker.policies import ModelPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Attribute set on a model prepared for context parallelism (its ``ContextParallelAttention``).
MODEL_ATTR = "_tsm_context_parallel_model"


def check_supported(model: nn.Module, policy: ModelPolicy) -> None:
    """Refuses model configurations context parallel attention cannot run exactly.

    Raises:
        ValueError: For a sliding-window configuration, naming the attribute and the fix.
    """
    check_config_supported(model.config, policy, type(model).__name__)


def check_config_supported(config: Any, policy: ModelPolicy, model_name: str) -> None:
    """``check_supported`` on a model's Hugging Face config alone (no model needed).

    Args:
        config: The model's config.
        policy: Its policy (which attribute holds a sliding window).
        model_name: The model's class name, for the message.

    Raises:
        ValueError: For a sliding-window configuration, naming the attribute and the fix.
    """
    attr = policy.sliding_window_attr
    window = getattr(config, attr, None) if attr else None
    if window is not None:
        raise ValueError(
            f"{model_name} has {attr}={window}: sliding-window attention is not "
            "supported with context parallelism (as in SMP). Set config."
            f"{attr} = None before building the model (full causal attention), or use "
            "context_parallel_degree=1."
        )


def _fingerprint(ids: torch.Tensor) -> tuple[int, int]:
    """A position-weighted checksum of token ids and whether they are all equal."""
    weights = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int64)
    flat = ids.reshape(-1).to(torch.int64)
    constant = bool(flat.numel() == 0 or bool((flat == flat[0]).all()))
    return int((flat * weights).sum()), int(constant)


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
        fingerprint, constant = _fingerprint(ids) if ids is not None else (self.rank, 1)
        mine = torch.tensor(
            [local_len, fingerprint, constant, problem is not None], dtype=torch.int64
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
    "InputCheck",
    "MODEL_ATTR",
    "check_config_supported",
    "check_prepared",
    "check_supported",
    "is_context_parallel",
    "prepare_model",
]
