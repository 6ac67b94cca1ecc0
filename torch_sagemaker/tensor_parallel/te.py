"""Transformer Engine tensor parallelism, backend ``"te"`` (automatic with TE and CUDA, tp > 1).

NOT RUN on the machines this package is developed on (no CUDA, no Transformer Engine); it
is written against Transformer Engine's documented ``transformer_engine.pytorch.Linear``
API and its tests in ``tests/gpu`` skip without TE and two GPUs. The DTensor backend is
the tested reference.

What it does: every linear layer a policy marks ``colwise`` / ``rowwise`` (and ``kv_colwise``
when the degree divides the kv heads) becomes a ``te.Linear`` with ``parallel_mode``
``"column"`` / ``"row"``, ``tp_group`` = the TP group and this rank's slice of the original
weight, under the same attribute name (``weight``/``bias`` keys unchanged; TE adds an
``_extra_state`` entry per module for its FP8 metadata). Column layers take the replicated
input and produce this rank's heads or MLP columns; row layers all-reduce their output.
The other modules (embedding, norms, LM head) stay replicated Hugging Face modules, so the
loss is the model's ordinary one.

Why no sequence parallelism here: TE's sequence-parallel collectives gather and scatter
along the first activation dimension (TE and Megatron keep activations sequence-first),
while Hugging Face models are batch-first and derive positions and masks from the
*local* activation shape. With ``sequence_parallel=False`` no norm sees a sequence shard,
so the norm-weight gradient all-reduce that TE leaves to its caller under sequence
parallelism is not needed; ``allreduce_grads_over`` is the hook for policies that do run
norms on sequence shards.

Not supported on this backend (clear error, use ``use_backend("dtensor")``): MoE experts
split over TP ranks, kv heads replicated because there are fewer than the degree, and
the styles that only make sense with sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torch_sagemaker.policies import HeadSplit, ModelPolicy
from torch_sagemaker.tensor_parallel.plan import install_rng_region, matching_modules
from torch_sagemaker.tensor_parallel.random import RNGStatesTracker

# Styles this backend maps onto te.Linear, and the ones it leaves as replicated modules.
_TE_MODES = {"colwise": "column", "kv_colwise": "column", "rowwise": "row"}
_REPLICATED = {"vocab_embedding", "lm_head", "sequence_parallel_norm", "sequence_parallel_dropout"}


def supports(policy: ModelPolicy) -> bool:
    """Whether this backend can run ``policy``'s plan (its styles; head layouts are checked later).

    The styles of the replicated-activation layout (plans built from transformers') are not
    among them.
    """
    return set(policy.tp_plan.values()) <= set(_TE_MODES) | _REPLICATED


def allreduce_grads_over(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sums each parameter's gradient over ``group`` once it is accumulated.

    For norm weights computed on sequence shards with Transformer Engine's
    ``sequence_parallel=True``: each rank's gradient covers its part of the sequence only.
    """
    for param in params:
        param.register_post_accumulate_grad_hook(
            lambda p: dist.all_reduce(p.grad, group=group) if p.grad is not None else None
        )


def _te_linear(
    linear: nn.Linear, mode: str | None, group: dist.ProcessGroup | None, tp: int, rank: int
) -> nn.Module:
    """A ``te.Linear`` holding this rank's slice of ``linear``'s weight and bias.

    ``mode=None`` with ``tp=1`` and no group: an unsplit layer (``unsplit_te_linears``).
    """
    import transformer_engine.pytorch as te

    weight = linear.weight
    layer = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        parallel_mode=mode,
        tp_group=group,
        tp_size=tp,
        sequence_parallel=False,
        params_dtype=weight.dtype,
        device=weight.device,
    )
    dim = 0 if mode == "column" else 1
    expected = list(weight.shape)
    expected[dim] //= tp
    if list(layer.weight.shape) != expected:
        raise RuntimeError(
            f"te.Linear({mode}) allocated {tuple(layer.weight.shape)} but this rank's "
            f"slice is {tuple(expected)}; this Transformer Engine version splits "
            "differently. Use use_backend('dtensor')."
        )
    if not weight.is_meta:
        with torch.no_grad():
            layer.weight.copy_(weight.chunk(tp, dim=dim)[rank])
            if linear.bias is not None:
                bias = linear.bias if mode == "row" else linear.bias.chunk(tp)[rank]
                layer.bias.copy_(bias)
    return layer


class TransformerEngineBackend:
    """Tensor parallelism with Transformer Engine linear layers (see the module docstring)."""

    name = "te"  # as use_backend("te") spells it

    def apply(
        self,
        model: nn.Module,
        policy: ModelPolicy,
        heads: HeadSplit,
        *,
        tp_mesh: DeviceMesh,
        tracker: RNGStatesTracker,
        src_data_rank: int | None,
    ) -> None:
        """See ``implementation.TPBackend.apply``.

        ``src_data_rank`` is not used: weights are sliced locally.

        Raises:
            ValueError: For plans or head layouts this backend does not support.
        """
        del src_data_rank
        unsupported = sorted({s for s in policy.tp_plan.values()} - set(_TE_MODES) - _REPLICATED)
        if unsupported or heads.kv_replicated:
            what = unsupported or ["kv heads fewer than tensor_parallel_degree"]
            raise ValueError(
                f"the Transformer Engine backend does not support {what} (policy "
                f"{policy.name!r}); call torch_sagemaker.tensor_parallel.use_backend("
                "'dtensor') before tsm.transform."
            )
        group, tp, rank = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()
        for pattern, style in policy.tp_plan.items():
            if style not in _TE_MODES:
                continue
            for name in matching_modules(model, pattern):
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                setattr(
                    parent,
                    attr,
                    _te_linear(getattr(parent, attr), _TE_MODES[style], group, tp, rank),
                )
        for _, attention in policy.attention_modules(model):
            if hasattr(attention, "num_key_value_groups"):
                # (torch types nn.Module attributes as tensors or modules; this one is an int)
                attention.num_key_value_groups = heads.local_heads // heads.local_kv_heads  # type: ignore[assignment]
            install_rng_region(attention, tracker)


def unsplit_te_linears(model: nn.Module, policy: ModelPolicy) -> list[str]:
    """Makes the plan's linear layers unsplit ``te.Linear`` modules (tensor_parallel_degree 1).

    The ``colwise``/``rowwise``/``kv_colwise`` layers get ``parallel_mode=None``.

    SMP's ``transform`` builds Transformer Engine layers whatever the degree, and only those
    run in FP8 under Transformer Engine's ``fp8_autocast``. Here that is opt-in: the FP8 step
    of ``tsm.transform`` (``torch_sagemaker/fp8/prepare.py``) calls this at degree 1 only
    after ``use_backend("te")``. Modules that are not exactly ``nn.Linear`` are left alone.

    Returns:
        The names of the modules replaced.
    """
    names = []
    for pattern, style in policy.tp_plan.items():
        if style not in _TE_MODES:
            continue
        for name in matching_modules(model, pattern):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            module = getattr(parent, attr)
            if type(module) is nn.Linear:
                setattr(parent, attr, _te_linear(module, None, None, 1, 0))
                names.append(name)
    return names


def te_checkpoint_kwargs(state: Any) -> dict[str, Any]:
    """Keyword arguments for ``transformer_engine.pytorch.checkpoint`` under SMP's state.

    Returns:
        ``get_rng_state_tracker`` and ``tp_group`` as SMP's documentation passes them.
    """
    return {
        "get_rng_state_tracker": state.get_rng_state_tracker,
        "tp_group": state.tp_process_group,
        "use_reentrant": False,
        "distribute_saved_activations": False,
    }


__all__ = [
    "TransformerEngineBackend",
    "allreduce_grads_over",
    "supports",
    "te_checkpoint_kwargs",
    "unsplit_te_linears",
]
