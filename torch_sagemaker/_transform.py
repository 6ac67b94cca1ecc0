"""``tsm.transform(model)``: policy lookup -> placement -> tensor parallelism -> weights -> record.

The model is changed in place and returned. Module names and ``state_dict`` keys stay
Hugging Face's; with tensor parallelism each parameter becomes a DTensor on
``tsm.state.tp_mesh`` (its ``full_tensor()`` is the unsharded value), the LM head returns
vocabulary-sharded logits (a DTensor; ``logits.full_tensor()`` gathers them) and the model's
loss function becomes the vocabulary-parallel cross entropy. The policy is recorded on the
model for FSDP wrapping, activation checkpointing, offloading and checkpointing
(``torch_sagemaker.policies.get_policy`` / ``transformer_layer_classes``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torch_sagemaker.context_parallel import prepare_model
from torch_sagemaker.context_parallel.prepare import check_config_supported, check_supported
from torch_sagemaker.fp8.prepare import prepare_linears
from torch_sagemaker.logger import log_rank0
from torch_sagemaker.moe import apply as moe_apply
from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.policies import (
    POLICY_ATTR,
    HeadSplit,
    ModelPolicy,
    check_model,
    lookup_policy,
)
from torch_sagemaker.state import state
from torch_sagemaker.tensor_parallel import full_state_dict, loading, transformer
from torch_sagemaker.tensor_parallel.implementation import forced_backend, select_backend
from torch_sagemaker.utils.hf_config import text_config

_CP_COMM_TYPES = ("p2p", "all_gather")

# Note [Transform under init_empty_weights]: SMP's scripts call ``transform`` inside
# accelerate's ``init_empty_weights()`` for MoE models with delayed initialization. That
# context replaces ``nn.Module.register_parameter`` with a version that rebuilds each new
# parameter on the meta device as ``type(param)(param.to(device), **param.__dict__)``, which
# fails for the DTensor parameters PyTorch's tensor parallel styles register. The model's
# parameters are meta already, so the replacement adds nothing there: the TP step registers
# with PyTorch's own method (captured when this module is imported, if it was PyTorch's then)
# and the context's comes back right after. A method is PyTorch's when it is defined in
# ``torch.nn.modules.module``; one captured inside such a context is not, and is never used.
_TORCH_MODULE = "torch.nn.modules.module"
_TORCH_REGISTER_PARAMETER = nn.Module.register_parameter


def _is_torchs(method: Any) -> bool:
    return getattr(method, "__module__", None) == _TORCH_MODULE


@contextlib.contextmanager
def _torch_register_parameter() -> Iterator[None]:
    """PyTorch's own ``register_parameter`` inside (Note [Transform under init_empty_weights]).

    Raises:
        RuntimeError: If the method is replaced and PyTorch's own was never seen (the package
            was first imported inside ``init_empty_weights``).
    """
    current = nn.Module.register_parameter
    if _is_torchs(current):
        yield
        return
    if not _is_torchs(_TORCH_REGISTER_PARAMETER):
        raise RuntimeError(
            "tsm.transform with tensor parallelism inside accelerate's init_empty_weights() "
            "needs PyTorch's own nn.Module.register_parameter, which that context replaces; "
            "torch.sagemaker was first imported inside such a context, so it never saw "
            "PyTorch's. Import torch.sagemaker before entering init_empty_weights()."
        )
    nn.Module.register_parameter = _TORCH_REGISTER_PARAMETER  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = current  # type: ignore[method-assign]


def check_model_config(
    policy: ModelPolicy,
    model_config: Any,
    *,
    tp: int,
    cp: int,
    ep: int,
    config: Any = None,
    cp_comm_type: str = "p2p",
    model_name: str | None = None,
) -> tuple[MoEConfig | None, HeadSplit]:
    """Every check ``transform`` makes before it changes the model, on its config alone.

    ``transform`` runs exactly these first; the parallelism planner runs them on a model it
    never builds, so a layout it calls valid is one ``transform`` accepts.

    Args:
        policy: The model's policy (``lookup_policy``).
        model_config: The model's Hugging Face config.
        tp: tensor_parallel_degree.
        cp: context_parallel_degree.
        ep: expert_parallel_degree.
        config: ``transform``'s ``config`` argument: ``None`` or a ``MoEConfig``.
        cp_comm_type: ``transform``'s ``cp_comm_type``.
        model_name: The model's class name, for messages (default: the policy's first class).

    Returns:
        The MoEConfig (or ``None``) and the head split over the TP ranks.

    Raises:
        TypeError: If ``config`` is neither ``None`` nor a ``MoEConfig``.
        ValueError: For a degree the model's heads, experts or split sizes do not allow, an
            MoEConfig on a dense model, with CP, or with TP on a plan that does not split
            the experts, expert parallelism without one,
            sliding-window attention with CP, or an unknown ``cp_comm_type``.
    """
    name = model_name or policy.model_classes[0]
    if cp_comm_type not in _CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type={cp_comm_type!r}; use one of {_CP_COMM_TYPES}.")
    moe_config = moe_apply.check_config(config, tp=tp, cp=cp, ep=ep)
    heads = check_model(policy, model_config, tp)
    if moe_config is not None:
        moe_apply.check_experts(policy, model_config, ep, name)
        moe_apply.check_policy(policy, moe_config)
        if tp > 1:
            moe_apply.check_tp_experts(policy, name, tp)
    if cp > 1:
        check_config_supported(model_config, policy, name)
    return moe_config, heads


def _check_initialized() -> None:
    if not state.initialized:
        raise RuntimeError(
            "tsm.transform needs torch.sagemaker.init() first (it reads the tensor "
            "parallel degree and the mesh from tsm.state)."
        )


def _check_placement(device: Any, dtype: Any) -> None:
    """Raises for a ``dtype`` that is not a floating ``torch.dtype`` or a ``device`` torch rejects.

    (``Tensor.to("float16")`` would read the string as a device and say it is invalid.)
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        name = str(dtype).removeprefix("torch.")
        named = getattr(torch, name, None)
        if isinstance(named, torch.dtype) and named.is_floating_point:  # a string such as "float16"
            fix = f"pass dtype=torch.{name}"
        else:  # a non-floating dtype, or anything else
            fix = "pass a floating dtype such as torch.bfloat16, or None to keep the model's dtype"
        kind = (
            "a non-floating torch.dtype" if isinstance(dtype, torch.dtype) else type(dtype).__name__
        )
        raise TypeError(
            f"tsm.transform(dtype={dtype!r}): dtype must be a floating torch.dtype "
            f"(it casts the floating parameters), got {kind}; {fix}."
        )
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(
                f"tsm.transform(device={device!r}) is not a device ({e}); pass e.g. "
                "device=torch.device('cuda', local_rank), 'cpu', or None to keep the "
                "model where it is (a dtype goes in dtype=)."
            ) from None
        if target.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (target.index is not None and target.index >= count):
                present = f"GPUs 0-{count - 1}" if count else "no GPU"
                raise ValueError(
                    f"tsm.transform(device={device!r}): this process sees {present}; pass "
                    "device=torch.device('cuda', local_rank) for a GPU it has, 'cpu', or "
                    "None to keep the model where it is."
                )


def _place(model: nn.Module, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
    """Casts floating parameters to ``dtype`` and moves real tensors to ``device``, keeping ties.

    Buffers keep their dtype (RoPE's ``inv_freq`` must stay fp32); meta tensors stay on meta.
    """
    with torch.no_grad():
        for param in model.parameters():
            if dtype is not None and param.is_floating_point():
                param.data = param.data.to(dtype)
            if device is not None and not param.is_meta:
                param.data = param.data.to(device)
        if device is not None:
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    if not buf.is_meta:
                        setattr(module, name, buf.to(device))


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (one tiny all-reduce, so all ranks decide alike)."""
    t = torch.tensor([int(flag)], device=_default_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _tie_as_configured(model: nn.Module) -> None:
    """Ties the weights the model's config ties, as transformers' ``from_pretrained`` does.

    Note [Tie before transform]: a model built from a config under accelerate's
    ``init_empty_weights`` (SMP's scripts do so on every rank but 0 with
    ``load_state_dict_from_rank0``, and on every rank for delayed initialization) has
    ``lm_head.weight`` and ``embed_tokens.weight`` as two meta parameters even where
    ``tie_word_embeddings`` says they are one (transformers 5), while rank 0's
    ``from_pretrained`` model has them tied. Tensor parallelism and the rank-0 broadcast
    must see one model on every rank, and the one the config describes: so transform ties
    first. A model whose config ties nothing is left as it is.
    """
    tie = getattr(model, "tie_weights", None)
    if getattr(text_config(model), "tie_word_embeddings", False) and callable(tie):
        tie()


def _local_split(
    model: nn.Module, load_state_dict_from_rank0: bool, tp: int, moe_config: MoEConfig | None
) -> bool:
    """Whether TP/EP split each rank's own weights (no rank has data to send), not rank 0's.

    Only a split over more than one rank reads it, so only then do the ranks agree on it
    with an all-reduce; with tensor and expert parallel degrees of 1 ``transform`` makes no
    collective call on the world group (rank-0 loading aside, which broadcasts by design).
    """
    if load_state_dict_from_rank0:
        return True
    has_meta = any(t.is_meta for t in model.parameters())
    if tp > 1 or (moe_config is not None and state.ep_size > 1):
        return _any_rank(has_meta)
    return has_meta


def transform(
    model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: str = "p2p",
) -> nn.Module:
    """Prepares a Hugging Face causal LM for SMP: tensor parallelism per its model policy.

    Args:
        model: A supported model (see ``torch_sagemaker.policies``), on a real device or meta.
        device: Move the model here first (meta tensors stay on meta).
        dtype: Cast floating parameters to this dtype first (buffers keep theirs); normally
            ``None``: train in fp32 and let FSDP's mixed precision cast.
        config: ``None``, or a ``torch.sagemaker.moe.moe_config.MoEConfig`` for an MoE model:
            its experts are split over the expert parallel ranks and, with ``smp_moe``, its
            sparse blocks become ``MoELayer`` (see ``torch_sagemaker.moe``).
        load_state_dict_from_rank0: Rank 0 holds the real weights and every other rank a
            meta-device model; afterwards every rank holds its shards of rank 0's weights.
        cp_comm_type: ``"p2p"`` (ring of key/value blocks) or ``"all_gather"``; used when
            ``context_parallel_degree > 1`` (docs/context_parallel.md).

    Returns:
        The same ``model`` object, transformed in place.

    Communication: with tensor, context and expert parallel degrees of 1 it makes no
    collective call on the world group; ``load_state_dict_from_rank0=True`` broadcasts rank
    0's weights (and its error, if any) to every rank, as it must.

    Raises:
        RuntimeError: If ``tsm.init`` was not called, or, with rank-0 loading, if the
            ranks' tensors differ only after sharding (e.g. in dtype; raised on every rank).
        TypeError: If ``dtype`` is not a floating ``torch.dtype`` (e.g. the string "float16").
        ValueError: For an unsupported model (listing the supported ones and how to register
            a policy), a degree that does not divide the heads, experts or MLP width
            (``intermediate_size``), a ``device`` torch rejects, or rank-0 loading without
            real weights on rank 0 (raised on every rank).

    Example:
        >>> tsm.init({"tensor_parallel_degree": 2})
        >>> model = tsm.transform(AutoModelForCausalLM.from_config(cfg))
        >>> loss = model(input_ids=ids, labels=ids).loss
    """
    # 1. Arguments, policy and the checks that depend only on the config.
    _check_initialized()
    if getattr(model, POLICY_ATTR, None) is not None:
        raise ValueError(
            f"{type(model).__name__} was already transformed by tsm.transform; call it "
            "once per model (before FSDP wrapping)."
        )
    policy = lookup_policy(model)  # a registered policy, else the model's transformers plan
    tp = state.tp_size
    moe_config, heads = check_model_config(
        policy,
        text_config(model),
        tp=tp,
        cp=state.cp_size,
        ep=state.ep_size,
        config=config,
        cp_comm_type=cp_comm_type,
        model_name=type(model).__name__,
    )
    if state.cp_size > 1:
        check_supported(model, policy)  # the modules too, before anything changes
    # 2. Placement before sharding (parameter identity, hence weight tying, is kept).
    _check_placement(device, dtype)
    _tie_as_configured(model)
    _place(model, device, dtype)
    rank0_state = loading.capture_rank0_state(model) if load_state_dict_from_rank0 else None
    local_split = _local_split(model, load_state_dict_from_rank0, tp, moe_config)
    # 3. Tensor parallelism on the "tp" mesh axis.
    backend = select_backend(policy)
    if tp > 1:
        with _torch_register_parameter():
            backend.apply(
                model,
                policy,
                heads,
                tp_mesh=state.tp_mesh,
                tracker=state.get_rng_state_tracker(),
                src_data_rank=None if local_split else 0,
            )
    # 3b. Expert parallelism and MoELayer (MoEConfig; never with CP; with TP the plan has
    # split the experts, Note [MoELayer under tensor parallelism]).
    moe_report = None
    if moe_config is not None:
        moe_report = moe_apply.apply_moe(
            model,
            policy,
            moe_config,
            ep_mesh=state.ep_mesh,
            src_data_rank=None if local_split else 0,
            tp=tp,
        )
    # 3c. Context parallelism over the "cp" mesh axis (attention, positions, loss).
    if state.cp_size > 1:
        prepare_model(model, policy, cp_comm_type, state.cp_process_group)
    # 3d. The plan's linear layers compute in FP8 inside fp8_autocast, as before outside it.
    fp8_report = prepare_linears(
        model, policy, backend=backend.name, tp=tp, backend_forced=forced_backend() is not None
    )
    # 4. Weights from rank 0.
    if load_state_dict_from_rank0 and state.world_size > 1:
        target = torch.device(device) if device is not None else _default_device()
        loading.broadcast_from_rank0(model, rank0_state, target)
    # 5. Record the policy, and mark the layers as SMP's TransformerLayer (wrap and checkpoint
    # unit). A full (Hugging Face) state dict loads into the DTensor parameters.
    setattr(model, POLICY_ATTR, policy)
    if tp > 1:
        full_state_dict.accept_full_tensors(model)
        _refuse_resizing(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):  # TP, or experts split (EP)
        _refuse_saving_shards(model)
    layer_cls = policy.layer_cls(model)
    num_layers = transformer.mark(model, layer_cls)
    log_rank0(
        f"tsm.transform: {type(model).__name__} with policy {policy.name!r}, "
        f"tensor_parallel_degree={tp} ({backend.name}), {num_layers} x {layer_cls.__name__}, "
        f"{heads.local_heads} heads / {heads.local_kv_heads} kv heads per rank, "
        f"{len(fp8_report.layers)} FP8-capable linear layers"
        + (
            f"; {moe_report.blocks} x {moe_report.layer} with {moe_report.local_experts}/"
            f"{moe_report.num_experts} experts per rank"
            if moe_report
            else ""
        )
    )
    return model


def _refuse_resizing(model: nn.Module) -> None:
    """Makes ``model.resize_token_embeddings`` raise when it would change the size, naming the fix.

    Hugging Face resizes by building new full-size embeddings and copying the old rows in,
    which fails inside DTensor with an operator error ("aten._is_all_true.default does not
    have a sharding strategy", or "mixed torch.Tensor and DTensor") once the vocabulary is
    split over the TP ranks. Calls that keep the size (``None``, or the current size, as
    scripts call it with ``len(tokenizer)``) go to Hugging Face's method, which returns the
    embedding unchanged. (Note [Methods replaced on the instance])
    """
    if callable(getattr(model, "resize_token_embeddings", None)) and callable(
        getattr(model, "get_input_embeddings", None)
    ):
        _replace_method(model, "resize_token_embeddings", _resize_token_embeddings)


def _refuse_saving_shards(model: nn.Module) -> None:
    """Makes ``model.save_pretrained`` raise, naming the fix, when it would write TP shards.

    Hugging Face's ``save_pretrained`` knows only the tensor parallelism transformers set up
    itself: given this model's DTensor parameters it handed them to safetensors, which
    failed on rank 0 ("invalid python storage", a ``config.json`` and no weights) while the
    other ranks returned having written nothing. Gathering instead is collective, and scripts
    often save on rank 0 alone, which would hang. A ``state_dict`` of plain tensors (what
    accelerate and the ``Trainer`` pass under FSDP) goes to Hugging Face's method.
    (Note [Methods replaced on the instance])
    """
    if callable(getattr(model, "save_pretrained", None)):
        _replace_method(model, "save_pretrained", _save_pretrained)


# Note [Methods replaced on the instance]: a few Hugging Face methods cannot work on the
# split weights and get an instance attribute that shadows the class's method: a bound method
# of a module-level function, which ``copy.deepcopy`` rebinds to the copy (a closure would
# keep acting on the original), calling the class's method when the call is fine. The
# arguments are read through the class method's own signature, positional ones included.
def _replace_method(model: nn.Module, name: str, function: Any) -> None:
    @functools.wraps(getattr(type(model), name))
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    # object.__setattr__: nn.Module's own __setattr__ is typed for tensors and modules.
    object.__setattr__(model, name, types.MethodType(method, model))


def _arguments(model: nn.Module, name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, as the class's method ``name`` would bind them."""
    signature = inspect.signature(getattr(type(model), name))
    return signature.bind_partial(model, *args, **kwargs).arguments


def _resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    bound = _arguments(self, "resize_token_embeddings", args, kwargs)
    new_num_tokens = bound.get("new_num_tokens")
    pad_to_multiple_of = bound.get("pad_to_multiple_of")
    current = self.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    wanted = new_num_tokens
    if wanted is not None and pad_to_multiple_of:
        wanted = -(-wanted // pad_to_multiple_of) * pad_to_multiple_of
    if wanted is None or wanted == current:
        return type(self).resize_token_embeddings(self, *args, **kwargs)  # type: ignore[attr-defined]
    raise RuntimeError(
        f"{type(self).__name__}.resize_token_embeddings({new_num_tokens}) after "
        f"tsm.transform with tensor_parallel_degree={state.tp_size}: the vocabulary "
        f"({current}) is split over the TP ranks and cannot be resized in place. Resize "
        "before tsm.transform (then transform splits the new size), or resize the "
        "untransformed model and load its weights."
    )


def _save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    bound = _arguments(self, "save_pretrained", args, kwargs)
    given = bound.get("state_dict")
    tensors = given.values() if isinstance(given, dict) else [*self.parameters(), *self.buffers()]
    if any(isinstance(t, DTensor) for t in tensors):
        raise RuntimeError(
            f"{type(self).__name__}.save_pretrained({str(bound.get('save_directory'))!r}) "
            "after tsm.transform: its weights are split over the tensor or expert parallel "
            "ranks. Call torch_sagemaker.checkpoint.save_hf_checkpoint(model, directory) on "
            "every rank (it gathers and writes the same files), or pass save_pretrained a "
            "state_dict of full tensors (torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), "
            "gathered on every rank)."
        )
    return type(self).save_pretrained(self, *args, **kwargs)  # type: ignore[attr-defined]


def _default_device() -> torch.device:
    """The device of the mesh: the current CUDA device when the groups talk CUDA, else CPU."""
    if state.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["check_model_config", "transform"]
