"""DTensor styles for the replicated-activation layout of transformers' own TP plans.

A Hugging Face ``base_model_tp_plan`` assumes a different layout from our policies'
sequence parallelism (``styles``): between the parallel regions every TP rank holds the
whole activation as a plain tensor, and only what happens inside a region is split:

    residual stream, norms       plain tensor        the whole activation on every rank
    column-parallel output       plain tensor        this rank's heads / MLP columns
    gathered column output       plain tensor        all-gathered back to the whole
    row-parallel output          plain tensor        all-reduced back to the whole
    logits (``lm_head``)         DTensor Shard(-1)   this rank's vocabulary slice

Every style here therefore takes plain tensors (or DTensors, which it redistributes) and
returns plain tensors, so the model's own code between the planned modules (residual
additions, scaling by plain tensors, softcapping) runs unchanged. Parameters are DTensors
on the TP mesh in both layouts, which is what FSDP, DCP and the exports see.

Note [Outputs of the replicated layout]: a whole output leaves its style as a tensor of its
own (one copy of the activation), not as the view ``DTensor.to_local`` returns: model code
updates such outputs in place (Llama 4 adds the routed experts into the shared expert's
output with ``add_``), which autograd forbids on a view made inside a custom function.

Note [Gradients of replicated activations]: a replicated activation that
feeds column-parallel layers gets a partial gradient on each rank; the DTensor boundary
of those layers (``from_local`` as ``Replicate``) sums it, so every module upstream sees
the whole gradient and replicated parameters get identical gradients on every rank. A
module that computes on *split* activations (a per-head norm inside attention) sees only
its rank's part: its parameter gradients are summed explicitly (``ReplicatedPartialGrad``).
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from torch_sagemaker.tensor_parallel import consistency
from torch_sagemaker.tensor_parallel.head_inputs import HeadInputs
from torch_sagemaker.tensor_parallel.local_parameters import (
    local_parameters,
    local_value,
    parameter_shapes,
)
from torch_sagemaker.tensor_parallel.styles import (
    AllReduceGrad,
    ExpertsParallel,
    SequenceParallelNorm,
    distribute_params,
    split_experts,
    to_local_partial_grad,
)

#: Attribute ``apply_tp_plan`` sets on every module it styles: the style's name.
STYLE_ATTR = "_tsm_tp_style"


def whole_local(x: Any, mesh: DeviceMesh) -> Any:
    """The plain value of a DTensor activation (made whole first); anything else as is."""
    if isinstance(x, DTensor):
        if x.placements != (Replicate(),):
            x = x.redistribute(mesh, [Replicate()])
        return x.to_local()
    return x


def _owned(out: Any) -> Any:
    """A plain output as a tensor of its own (Note [Outputs of the replicated layout])."""
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
        return out.clone()
    return out


def summed_output(x: Any, mesh: DeviceMesh) -> Any:
    """A partial-sum output (plain tensor, or tuple of them) summed over the TP ranks."""
    if isinstance(x, (tuple, list)):
        return type(x)(summed_output(o, mesh) for o in x)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    return _owned(x.redistribute(mesh, [Replicate()]).to_local())


def _replicate_plain(
    module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None, recurse: bool = False
) -> None:
    """Makes ``module``'s plain parameters (its own, or its subtree's) ``Replicate`` DTensors.

    A parameter tied to one parallelized earlier is a DTensor already and stays as it is.
    """
    for owner in module.modules() if recurse else (module,):
        plain = [n for n, p in owner.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        distribute_params(owner, mesh, [Replicate()], src_data_rank, plain)


def _swap_forward(
    module: nn.Module, shapes: dict[str, torch.Size], mesh: DeviceMesh, local_of: Any = None
) -> None:
    """Runs ``module``'s forward on plain inputs with local values of the named parameters.

    ``shapes``: their names and local shapes (``parameter_shapes``). ``local_of(param)``:
    the value that stands for a DTensor parameter (default: its local tensor).
    """
    forward_impl = type(module).forward
    swap = {"local_of": local_of} if local_of is not None else {}

    def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with local_parameters(mod, shapes, **swap):
            return forward_impl(
                mod,
                *(whole_local(a, mesh) for a in args),
                **{k: whole_local(v, mesh) for k, v in kwargs.items()},
            )

    module.forward = types.MethodType(forward, module)


class OwnedOutput(ParallelStyle):
    """``inner`` (one of PyTorch's styles with a whole, local output), its output owned.

    Note [Outputs of the replicated layout].
    """

    def __init__(self, inner: ParallelStyle) -> None:
        super().__init__()
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # parallelize_module set our src_data_rank; it sets the inner style's the same way.
        parallelize_module(module, device_mesh, self.inner, src_data_rank=self.src_data_rank)
        module.register_forward_hook(lambda _m, _a, out: _owned(out))
        return module


class ReplicatedLocal(ParallelStyle):
    """A subtree outside the split regions: parameters replicated, computed on plain tensors.

    The module and everything below it hold ``Replicate`` DTensors, and the module's
    forward runs with all of them swapped for their local values (a mixer that calls its
    convolution's weight directly sees a plain tensor). Its inputs must be whole on every
    rank (the residual stream), so every rank computes the same outputs and parameter
    gradients (Note [Gradients of replicated activations]); a first-use check enforces it
    (Note [Replicated module check]). For norms, routers, and whatever the plan leaves out.

    Args:
        name: The module's name in the model (for the check's message).
    """

    def __init__(self, *, name: str = "") -> None:
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_plain(module, device_mesh, self.src_data_rank, recurse=True)
        # Named now, read at each call (Note [Replicated parameters under FSDP1]).
        _swap_forward(module, parameter_shapes(module), device_mesh)
        consistency.install(module, self.name or type(module).__name__, device_mesh)
        return module


class ReplicatedPartialGrad(ParallelStyle):
    """Replicated parameters used on this rank's split activations; their gradients summed.

    transformers' ``replicated_with_grad_allreduce``: a per-head norm (Qwen3's ``q_norm``)
    sits between a column-parallel projection and attention, so each rank normalises only
    its heads and its parameter gradient covers only them. The forward uses the local
    values through an all-reduce-in-backward (Megatron's f), so the gradient of the
    replicated parameter is the sum over the TP ranks.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_plain(module, device_mesh, self.src_data_rank)
        group = device_mesh.get_group()
        _swap_forward(
            module,
            parameter_shapes(module, recurse=False),
            device_mesh,
            lambda p: AllReduceGrad.apply(p.to_local(), group),
        )
        return module


class LocalParams(ParallelStyle):
    """A module that computes with plain values of parameters it reaches directly.

    transformers' ``local_params``, for bare parameters with no forward of their own
    (attention sinks, one per head): the owner's forward sees this rank's slice. Own
    parameters that no entry split are replicated first. The forward also sees plain
    values of the replicated subtrees below it (``ReplicatedLocal``) up to the next styled
    module or transformer layer, because model code reads a child's weight directly
    (``F.conv1d(x, self.conv1d.weight)``) or calls a child's method other than ``forward``.

    Args:
        layer_class: Class name of the transformer layers, where the walk stops (each layer
            is its own FSDP unit: outside its forward its parameters are sharded).
    """

    def __init__(self, *, layer_class: str = "") -> None:
        super().__init__()
        self.layer_class = layer_class

    def _reachable(self, module: nn.Module) -> list[str]:
        """Paths of the replicated subtrees below ``module`` that its forward reaches."""
        paths = []
        todo = [(name, child) for name, child in module.named_children()]
        while todo:
            name, child = todo.pop()
            if any(cls.__name__ == self.layer_class for cls in type(child).__mro__):
                # Its own FSDP unit; its forward does this for its subtree. (The class's
                # ancestors: FSDP2's ``fully_shard`` swaps in a subclass named FSDP<class>.)
                continue
            style = getattr(child, STYLE_ATTR, None)
            if style == "replicate_local":
                paths.append(name)
            elif style is None:
                todo.extend((f"{name}.{n}", c) for n, c in child.named_children())
        return paths

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_plain(module, device_mesh, self.src_data_rank)
        forward_impl = type(module).forward
        # Every parameter below, named as applied: in its forward and its backward FSDP1 may
        # hold a parameter as an instance attribute, not a registered parameter (Note
        # [Replicated parameters under FSDP1]), so names are not read again at each call.
        shapes = parameter_shapes(module)

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            paths = tuple(f"{p}." for p in self._reachable(mod))
            reachable = {n: s for n, s in shapes.items() if "." not in n or n.startswith(paths)}
            # and names the module holds now (a module wrapped after the style: a LoRA layer)
            reachable.update(
                (n, s)
                for n, s in parameter_shapes(mod).items()
                if n not in reachable and ("." not in n or n.startswith(paths))
            )
            with local_parameters(mod, reachable):
                return forward_impl(mod, *args, **kwargs)

        module.forward = types.MethodType(forward, module)
        return module


class ReduceOutput(LocalParams):
    """A module whose output is a partial sum over the TP ranks: summed, returned whole.

    transformers' ``all_reduce`` (Inkling's shared experts: bare parameters split by their
    own entries, used by the module's own code). It computes like ``LocalParams`` (local
    values of its split parameters) and all-reduces its output.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        module.register_forward_hook(lambda _m, _a, out: summed_output(out, device_mesh))
        return module


class ReplicatedExperts(ExpertsParallel):
    """Fused MoE experts split whole over the TP ranks, their output summed and returned whole.

    ``ExpertsParallel`` returns the partial sum as a ``Partial`` DTensor for a policy that
    reduce-scatters it onto the sequence; here the MoE block's own code (shared experts,
    reshapes) runs on plain tensors, so the sum is all-reduced at once.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        sharded_forward = module.forward

        def forward(
            _mod: nn.Module,
            hidden: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
        ) -> torch.Tensor:
            return summed_output(sharded_forward(hidden, top_k_index, top_k_weights), device_mesh)

        module.forward = types.MethodType(forward, module)
        return module


class BatchedExperts(ParallelStyle):
    """Experts that run every expert on its own block of rows, split whole over the TP ranks.

    For experts modules called as ``experts(rows)`` with ``rows`` of shape
    ``(num_experts * tokens, hidden)``, expert-major (Llama 4: every token goes to every
    expert, scaled by its router score beforehand), and fused parameters of shape
    ``(num_experts, ...)``. Rank ``r`` keeps its ``num_experts / tp`` experts
    (``Shard(0)``), runs them on their rows, and the rows of every expert are summed over
    the ranks (each rank contributes its experts' rows, zeros elsewhere).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        num_experts, first, num_local = split_experts(module, device_mesh, self.src_data_rank)
        forward_impl = type(module).forward
        shapes = parameter_shapes(module, recurse=False)  # Note [Replicated parameters under FSDP1]

        def forward(mod: nn.Module, rows: torch.Tensor) -> torch.Tensor:
            rows = to_local_partial_grad(rows, device_mesh)
            if rows.shape[0] % num_experts:
                raise ValueError(
                    f"{type(mod).__name__} got {rows.shape[0]} rows, not a multiple of its "
                    f"{num_experts} experts: its input is not one block of rows per expert."
                )
            per_expert = rows.shape[0] // num_experts
            mine = rows[first * per_expert : (first + num_local) * per_expert]
            with local_parameters(mod, shapes):
                out = forward_impl(mod, mine)
            after = (num_experts - first - num_local) * per_expert
            full = torch.cat(
                [
                    out.new_zeros((first * per_expert, *out.shape[1:])),
                    out,
                    out.new_zeros((after, *out.shape[1:])),
                ]
            )
            return summed_output(full, device_mesh)

        module.forward = types.MethodType(forward, module)
        return module


class MlaKvAProjection(ParallelStyle):
    """The shared key/value down-projection of multi-head latent attention (DeepSeek-V2 style).

    transformers' ``mla_kv_a_proj``: a replicated Linear whose output is the latent part
    (normalised, then up-projected by a column-parallel layer, whose input boundary sums
    its gradient) followed by the rotary part of the key, which goes straight to this
    rank's heads: the gradient of that last slice is partial and is summed here.

    Args:
        rope_dim: Width of the rotary slice (the config's ``qk_rope_head_dim``).
    """

    def __init__(self, *, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or not 0 < self.rope_dim < module.out_features:
            raise ValueError(
                f"mla_kv_a_proj applies to an nn.Linear wider than qk_rope_head_dim="
                f"{self.rope_dim}, got {type(module).__name__}."
            )
        _replicate_plain(module, device_mesh, self.src_data_rank)
        group, rope = device_mesh.get_group(), self.rope_dim

        def forward(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            weight = local_value(mod, "weight", cast(DTensor, mod.weight))
            bias = None
            if mod.bias is not None:
                bias = local_value(mod, "bias", cast(DTensor, mod.bias))
            out = F.linear(whole_local(x, device_mesh), weight, bias)
            latent, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, AllReduceGrad.apply(rotary, group)], dim=-1)

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return module


class LocalSequenceParallelNorm(SequenceParallelNorm):
    """transformers' ``sequence_parallel`` on a replicated input: computed on a sequence slice.

    Each rank normalises ``seq / tp`` positions of the whole input and the output is
    all-gathered back to a plain tensor; the parameter gradients come out ``Partial`` and
    are summed, as for ``SequenceParallelNorm``.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)

        def whole_to_slice(_m: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return (x, *args[1:])

        # Runs before distribute_module's input hook, which then takes the sequence slice.
        module.register_forward_pre_hook(whole_to_slice, prepend=True)
        module.register_forward_hook(lambda _m, _a, out: whole_local(out, device_mesh))
        return module


def make_replicated_style(
    name: str, *, module_name: str = "", config: Any = None, layer_class: str = ""
) -> ParallelStyle:
    """The style of ``name`` in the replicated-activation layout (see the module docstring).

    Args:
        name: Style name (``REPLICATED_STYLES``).
        module_name: The module's name in the model (messages).
        config: The model's (text) config (``mla_kv_a_proj`` reads ``qk_rope_head_dim`` from
            it, as transformers' style of that name does; ``head_inputs`` the head count).
        layer_class: The transformer layer class name (``local_params`` stops there).

    Raises:
        ValueError: For a name this module does not define.
    """
    style: ParallelStyle
    if name in ("colwise_gather", "hidden_embedding"):  # split output features, gathered
        # (ColwiseParallel splits a Linear's weight along 0 and an Embedding's along 1)
        style = OwnedOutput(ColwiseParallel(output_layouts=Replicate()))
    elif name == "rowwise_allreduce":
        style = OwnedOutput(RowwiseParallel())
    elif name == "rowwise_split_input":
        style = OwnedOutput(RowwiseParallel(input_layouts=Replicate()))
    elif name == "vocab_embedding_allreduce":
        style = OwnedOutput(RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    elif name == "replicate_local":
        style = ReplicatedLocal(name=module_name)
    elif name == "replicate_partial_grad":
        style = ReplicatedPartialGrad()
    elif name == "reduce_output":
        style = ReduceOutput(layer_class=layer_class)
    elif name == "local_params":
        style = LocalParams(layer_class=layer_class)
    elif name == "experts_allreduce":
        style = ReplicatedExperts()
    elif name == "experts_allreduce_local_slots":
        style = ReplicatedExperts(local_slots=True)
    elif name == "experts_batched":
        style = BatchedExperts()
    elif name == "mla_kv_a_proj":
        style = MlaKvAProjection(rope_dim=int(getattr(config, "qk_rope_head_dim", 0) or 0))
    elif name == "sequence_parallel_local":
        style = LocalSequenceParallelNorm()
    elif name == "head_inputs":
        heads = int(getattr(config, "num_attention_heads", 0) or 0)
        style = HeadInputs(heads, name=module_name)
    else:
        raise ValueError(f"unknown replicated-layout style {name!r}.")
    return style


#: Style names ``make_replicated_style`` defines (documented in ``policies.STYLES``).
REPLICATED_STYLES = (
    "colwise_gather",
    "hidden_embedding",
    "rowwise_allreduce",
    "rowwise_split_input",
    "vocab_embedding_allreduce",
    "replicate_local",
    "replicate_partial_grad",
    "reduce_output",
    "local_params",
    "experts_allreduce",
    "experts_allreduce_local_slots",
    "experts_batched",
    "mla_kv_a_proj",
    "sequence_parallel_local",
    "head_inputs",
)

__all__ = [
    "REPLICATED_STYLES",
    "STYLE_ATTR",
    "BatchedExperts",
    "LocalParams",
    "MlaKvAProjection",
    "OwnedOutput",
    "LocalSequenceParallelNorm",
    "ReduceOutput",
    "ReplicatedExperts",
    "ReplicatedLocal",
    "ReplicatedPartialGrad",
    "make_replicated_style",
    "summed_output",
    "whole_local",
]
