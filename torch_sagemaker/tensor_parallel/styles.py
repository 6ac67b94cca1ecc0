"""DTensor parallel styles that PyTorch does not ship, and the factory of styles by name.

Layouts between the parallel regions (Megatron's sequence parallelism, in DTensor terms):

    residual stream            DTensor Shard(1)    [batch, seq / tp, hidden] on each rank
    norm output (gathered)     DTensor Replicate   all-gather over the sequence
    column-parallel output     local tensor        this rank's heads / MLP columns
    row-parallel output        DTensor Shard(1)    reduce-scatter back onto the sequence
    logits                     DTensor Shard(-1)   this rank's vocabulary slice

PyTorch's ``ColwiseParallel``/``RowwiseParallel`` cover the linear layers, embedding and LM
head; the styles below cover sequence-parallel norms whose output is gathered, residual
dropout that draws the unsharded model's mask, replicated modules (MoE routers), fused MoE
experts split over the TP ranks, and key/value projections with fewer heads than ranks.

Every style distributes parameters with ``src_data_rank`` (``0``: TP rank 0's values are
scattered/broadcast so the group agrees; ``None``: local split, no communication, used for
meta-device models and rank-0 loading).
"""

from __future__ import annotations

import types
from typing import Any, SupportsInt, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
)

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker.moe.unused_experts import may_leave_weights_unused, tie_to
from torch_sagemaker.smddp.direct import all_reduce_direct
from torch_sagemaker.tensor_parallel.local_parameters import (
    local_parameters,
    local_value,
    parameter_shapes,
)


def distribute_params(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: list[Placement],
    src_data_rank: int | None,
    names: list[str] | None = None,
) -> None:
    """Replaces ``module``'s own parameters (all, or ``names``) by DTensors with ``placements``."""
    for name, param in list(module.named_parameters(recurse=False)):
        if names is not None and name not in names:
            continue
        dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def to_local_partial_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The local value of a replicated activation whose gradient will differ per TP rank.

    Each rank uses the replicated ``x`` for its own share of a computation (its experts, its
    kv head), so the gradient each rank produces is a partial sum. Marking it ``Partial``
    makes DTensor sum it at the next layout change (the reduce-scatter at the sequence
    boundary). A plain tensor is taken to be replicated.
    """
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    elif x.placements != (Replicate(),):
        x = x.redistribute(placements=[Replicate()])
    return x.to_local(grad_placements=[Partial()])


# Note [Gradient all-reduce under torch.compile]: Dynamo traces an autograd.Function's backward
# with its forward. The direct all-reduce (``all_reduce_direct``) asks the group for its
# backend object, which Dynamo cannot trace: compiling a layer that held such a style (a kv
# projection with fewer heads than ranks, the fused projections computed by rows) failed
# with "Attempted to access unregistered member on an OpaqueObject". While compiling, the
# gradient is summed by the functional all-reduce instead, which the graph records.
class AllReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over ``group`` in backward (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``x`` itself (a view, so autograd records this function)."""
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The gradient summed over the group."""
        grad = grad.contiguous()
        if torch.compiler.is_compiling():  # Note [Gradient all-reduce under torch.compile]
            return c10d_compat.traceable_all_reduce(grad, ctx.group), None
        all_reduce_direct(grad, group=ctx.group)
        return grad, None


def shard_given_embeddings(model: nn.Module, mesh: DeviceMesh) -> None:
    """Makes ``inputs_embeds`` passed to ``model`` enter as the embedding's output would.

    ``model`` is the module that owns the ``vocab_embedding``-styled embedding (a Hugging
    Face base model, whose ``forward`` takes ``input_ids`` or ``inputs_embeds``). From
    ``input_ids`` the embedding returns the sequence-sharded DTensor that the layers'
    ``SequenceParallelNorm`` and residual adds expect; embeddings given directly (prompt
    tuning, multimodal inputs) skip it, and the first norm would read the whole sequence as
    this rank's shard. A forward pre-hook shards them the same way: the same values in the
    same layout, and their gradient all-gathered back to the whole sequence.

    Args:
        model: The module whose ``forward`` takes ``inputs_embeds`` as a keyword.
        mesh: The 1-D tensor parallel mesh.
    """

    def shard(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = kwargs.get("inputs_embeds")
        if isinstance(given, torch.Tensor) and not isinstance(given, DTensor):
            whole = DTensor.from_local(given, mesh, [Replicate()], run_check=False)
            kwargs = {**kwargs, "inputs_embeds": whole.redistribute(placements=[Shard(1)])}
        return args, kwargs

    model.register_forward_pre_hook(shard, with_kwargs=True)


class SequenceParallelNorm(ParallelStyle):
    """A norm computed on a sequence shard, its output all-gathered for the next parallel region.

    Parameters are replicated; their gradients come out ``Partial`` (each rank saw part of
    the sequence) and DTensor sums them over the TP ranks, which is the all-reduce that
    sequence parallelism needs for norm weights.

    Args:
        sequence_dim: Sequence dimension of the input.
        gather_output: All-gather the output to a replicated DTensor (the input of the
            column-parallel layers that follow).
    """

    def __init__(self, *, sequence_dim: int = 1, gather_output: bool = True) -> None:
        super().__init__()
        self.sequence = (Shard(sequence_dim),)
        self.gather_output = gather_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            distribute_params(mod, mesh, [Replicate()], self.src_data_rank)

        def prepare_input(_mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x = inputs[0]
            if isinstance(x, DTensor):
                if x.placements != self.sequence:
                    x = x.redistribute(placements=self.sequence)
            else:
                x = DTensor.from_local(x, mesh, self.sequence, run_check=False)
            return (x, *inputs[1:])

        def prepare_output(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> DTensor:
            return out.redistribute(placements=[Replicate()]) if self.gather_output else out

        # torch annotates input_fn/output_fn as returning None, but uses their results as the
        # hooks' results (new inputs, new output).
        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)  # type: ignore[arg-type]


class SequenceParallelDropout(ParallelStyle):
    """Dropout on a sequence-sharded activation that applies the unsharded model's mask.

    Every TP rank draws the mask of the *whole* activation from the shared default stream
    (all TP ranks hold the same generator state) and keeps its own slice, so the result is
    exactly what the untransformed model computes, and the stream advances identically on
    every rank. Costs one activation-sized mask per call.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Dropout):
            raise TypeError(
                f"sequence_parallel_dropout applies to nn.Dropout, got {type(module).__name__}."
            )

        def forward(mod: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
            if not mod.training or mod.p == 0.0:
                return x
            ones = torch.ones(x.shape, dtype=x.dtype, device=x.device)
            mask = F.dropout(ones, mod.p, training=True)  # same draws as F.dropout(full x)
            if isinstance(x, DTensor):
                mask = distribute_tensor(mask, x.device_mesh, x.placements, src_data_rank=None)
            return x * mask

        # A per-instance forward (nn.Module calls it like its own); mypy forbids method assignment.
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return module


class ReplicateParallel(ParallelStyle):
    """Every parameter replicated over the TP ranks; the module computes on their local values.

    For small modules inside a parallel region whose inputs are replicated (an MoE router).
    The parameters stay DTensors (``Replicate``), so FSDP and the optimizer see one kind of
    parameter, and the tensor outputs are ``Replicate`` DTensors as before. The forward
    itself runs on the local values of the inputs and parameters (Note [Replicated modules
    compute locally]).

    Args:
        plain_outputs: Positions of tuple outputs returned as plain tensors instead: outputs
            the module's caller discards and Hugging Face records for a loss computed alike
            on every TP rank (an MoE router's logits for the auxiliary load-balancing loss,
            which mixes them with plain tensors). Their gradient is complete on every rank,
            as a replicated parameter's must be; an output whose consumers split work over
            the TP ranks (the routing weights) must stay a DTensor, whose backward sums it.

    Note [Replicated modules compute locally]: every TP rank computes the same values, so
    the local computation is the DTensor one without dispatch; gradients flow back through
    ``to_local`` as ``Replicate``, which they are (every rank's are equal). Computing on
    DTensors failed on torch 2.11: the backward of ``topk`` (a router's expert choice)
    builds a plain zero tensor and scatters the DTensor gradient into it, which DTensor
    refuses ("aten.scatter.src got mixed torch.Tensor and DTensor").
    """

    def __init__(self, plain_outputs: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.plain_outputs = plain_outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_params(module, device_mesh, [Replicate()], self.src_data_rank)
        forward_impl = type(module).forward
        plain = self.plain_outputs

        def local(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.redistribute(device_mesh, [Replicate()]).to_local()
            return x  # a plain tensor is taken to be replicated

        def replicated(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return x

        shapes = parameter_shapes(module)  # Note [Replicated parameters under FSDP1]

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with local_parameters(mod, shapes):
                out = forward_impl(
                    mod, *(local(a) for a in args), **{k: local(v) for k, v in kwargs.items()}
                )
            if isinstance(out, (tuple, list)):  # a router returns (logits, scores, indices)
                return type(out)(o if i in plain else replicated(o) for i, o in enumerate(out))
            return replicated(out)

        module.forward = types.MethodType(forward, module)
        return module


def _holds_parameters(module: nn.Module) -> bool:
    """Whether ``module`` or a module below it holds parameters, as FSDP1 may hold them.

    In FSDP1's forward and backward a parameter may be an instance attribute (a tensor in
    the module's ``__dict__``) rather than a registered one (Note [Replicated parameters
    under FSDP1] in ``local_parameters.py``); in DBRX's recomputed forward its experts'
    child registered none, and its weights were read whole, as DTensors.
    """
    return any(
        any(True for _ in m.parameters(recurse=False))
        or any(isinstance(v, torch.Tensor) for v in vars(m).values())
        for m in module.modules()
    )


class _LocalView:
    """Attribute view of a module whose DTensor parameters read as their local tensors.

    A child module holding parameters reads as such a view too; calling the view runs the
    module's own forward on it (DBRX's experts compute with their child's weights).
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, DTensor):
            return local_value(self._module, name, value)
        if isinstance(value, nn.Module) and _holds_parameters(value):
            return _LocalView(value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self._module).forward(self, *args, **kwargs)


class _LocalExpertsView(_LocalView):
    """An experts module's local view (``_LocalView``) with the local expert count.

    ``_is_expert_parallel`` tells Hugging Face's expert kernels that indices may hold the
    sentinel (they then zero the rows their grouped GEMMs leave uninitialized for it).
    """

    def __init__(self, module: nn.Module, num_local: int) -> None:
        super().__init__(module)
        self.num_experts = num_local
        self._is_expert_parallel = True


def split_experts(
    module: nn.Module, device_mesh: DeviceMesh, src_data_rank: int | None
) -> tuple[int, int, int]:
    """Splits ``module``'s expert parameters whole over the TP ranks (``Shard(0)``).

    Returns:
        ``(experts, first local expert, local experts)``.

    Raises:
        ValueError: The TP degree does not divide the module's ``num_experts``.
    """
    tp = device_mesh.size()
    num_experts = int(cast(SupportsInt, module.num_experts))
    if num_experts % tp:
        raise ValueError(
            f"{type(module).__name__}: {num_experts} experts cannot be split over "
            f"tensor_parallel_degree={tp} ranks; use a degree dividing {num_experts}."
        )
    for holder in module.modules():  # (DBRX's experts keep their weights on a child)
        distribute_params(holder, device_mesh, [Shard(0)], src_data_rank)
    num_local = num_experts // tp
    return num_experts, device_mesh.get_local_rank() * num_local, num_local


class ExpertsParallel(ParallelStyle):
    """Fused MoE experts (expert dimension first) split whole over the TP ranks.

    Rank ``r`` keeps experts ``[r * E / tp, (r + 1) * E / tp)`` (``Shard(0)``). Its forward
    remaps the router's expert indices to local ones, marks tokens routed elsewhere with
    the sentinel index ``E / tp`` (which Hugging Face expert implementations skip, the same
    convention as their expert parallelism), runs the module's own forward on local
    parameters and returns a ``Partial`` DTensor: the sum over ranks is the MoE output.
    The module must have ``num_experts`` and take ``(hidden, top_k_index, top_k_weights)``.

    Args:
        local_slots: For a forward that does not skip the sentinel (DBRX's): it runs on
            this rank's (token, choice) pairs only, one choice a row, and the rows' outputs
            are summed back onto their tokens (Note [Experts that run every index]).
    """

    def __init__(self, *, local_slots: bool = False) -> None:
        super().__init__()
        self.local_slots = local_slots

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        num_experts, first, num_local = split_experts(module, device_mesh, self.src_data_rank)
        forward_impl = type(module).forward
        local_slots = self.local_slots

        def forward(
            mod: nn.Module,
            hidden: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
        ) -> DTensor:
            hidden = to_local_partial_grad(hidden, device_mesh)
            weights = to_local_partial_grad(top_k_weights, device_mesh)
            index = top_k_index.to_local() if isinstance(top_k_index, DTensor) else top_k_index
            local = index - first
            elsewhere = (local < 0) | (local >= num_local)
            view = _LocalExpertsView(mod, num_local)
            if local_slots:
                out = _run_local_slots(forward_impl, view, hidden, local, weights, elsewhere)
            else:
                nothing_here = may_leave_weights_unused(mod) and bool(elsewhere.all())
                local = local.masked_fill(elsewhere, num_local)
                out = forward_impl(view, hidden, local, weights.masked_fill(elsewhere, 0.0))
                if nothing_here:  # Note [Experts without a token on this rank]
                    out = tie_to(out, view, mod, hidden, weights)
            return DTensor.from_local(out, device_mesh, [Partial()], run_check=False)

        module.forward = types.MethodType(forward, module)
        return module


# Note [Experts that run every index]: ``ExpertsParallel`` marks a token's choice of another
# rank's expert with the sentinel index ``E / tp``; transformers' expert loops skip it (the
# index one past their experts) and its grouped kernels zero its rows. DBRX's loop
# (transformers 5.24) skips nothing: it would index its weights with the sentinel. For such
# experts the forward sees only this rank's choices, each (token, choice) pair a row of its
# own with one choice (``top_k`` 1), so no index is foreign; the rows' outputs are summed back
# onto their tokens. The same products (a token that chose two of this rank's experts is
# two rows, as it was two choices); beyond them, a gather of those rows and a sum back, and
# on an accelerator one wait per layer for the count of this rank's pairs (``nonzero``).
# Which families need it is model knowledge: ``policies.shipped_plans.experts_without_sentinel``.
def _run_local_slots(
    forward_impl: Any,
    view: _LocalExpertsView,
    hidden: torch.Tensor,
    local: torch.Tensor,
    weights: torch.Tensor,
    elsewhere: torch.Tensor,
) -> torch.Tensor:
    """The experts' output for this rank's (token, choice) pairs, summed onto the tokens."""
    width = hidden.shape[-1]
    tokens = hidden.reshape(-1, width)
    choices = local.shape[-1]
    mine = (~elsewhere).reshape(-1).nonzero().squeeze(1)  # flat (token, choice) indices
    owner = mine // choices
    out = tokens.new_zeros(tokens.shape)
    if mine.numel():
        rows = forward_impl(
            view,
            tokens.index_select(0, owner),
            local.reshape(-1, 1).index_select(0, mine),
            weights.reshape(-1, 1).index_select(0, mine),
        )
        out = out.index_add(0, owner, rows.reshape(mine.numel(), width))
    else:  # Note [Experts without a token on this rank]
        out = tie_to(out, view, view._module, hidden, weights)
    return out.reshape(hidden.shape)


class ReplicatedKVColwise(ParallelStyle):
    """Key/value projection when the model has fewer kv heads than TP ranks.

    The full projection is replicated; rank ``r`` computes only kv head ``kv_head`` (the one
    its query heads attend with). Ranks sharing a kv head each produce part of its weight
    gradient, so the weight gradient is all-reduced over the TP group in backward.

    Args:
        head_dim: Size of one head.
        kv_head: Index of the kv head this rank computes.
    """

    def __init__(self, *, head_dim: int, kv_head: int) -> None:
        super().__init__()
        self.rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"kv_colwise applies to nn.Linear, got {type(module).__name__}.")
        distribute_params(module, device_mesh, [Replicate()], self.src_data_rank)
        group, rows = device_mesh.get_group(), self.rows

        def forward(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            x = to_local_partial_grad(x, device_mesh)
            weight = AllReduceGrad.apply(
                local_value(mod, "weight", cast(DTensor, mod.weight)), group
            )[rows]
            bias = None
            if mod.bias is not None:
                bias = AllReduceGrad.apply(
                    local_value(mod, "bias", cast(DTensor, mod.bias)), group
                )[rows]
            return F.linear(x, weight, bias)

        # A per-instance forward (nn.Module calls it like its own); mypy forbids method assignment.
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return module


def make_style(name: str, *, head_dim: int = 0, kv_head: int | None = None) -> ParallelStyle:
    """The parallel style for a style name of ``torch_sagemaker.policies.STYLES``.

    Args:
        name: Style name.
        head_dim: Head size (``kv_colwise`` with replicated kv heads only).
        kv_head: The kv head this rank computes when kv heads are replicated, else ``None``.

    Returns:
        A configured ``ParallelStyle`` (``parallelize_module`` sets its ``src_data_rank``).
    """
    if name == "colwise" or (name == "kv_colwise" and kv_head is None):
        style: ParallelStyle = ColwiseParallel()
    elif name == "kv_colwise" and kv_head is not None:  # always, after the first test
        style = ReplicatedKVColwise(head_dim=head_dim, kv_head=kv_head)
    elif name == "rowwise":
        style = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    elif name == "vocab_embedding":
        style = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    elif name == "lm_head":
        style = ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
    elif name == "sequence_parallel_norm":
        style = SequenceParallelNorm()
    elif name == "sequence_parallel_dropout":
        style = SequenceParallelDropout()
    elif name == "replicate":
        style = ReplicateParallel()
    elif name == "router":
        style = ReplicateParallel(plain_outputs=(0,))
    elif name == "experts":
        style = ExpertsParallel()
    elif name == "reduce_scatter_output":
        style = PrepareModuleOutput(
            output_layouts=Partial(), desired_output_layouts=Shard(1), use_local_output=False
        )
    else:
        raise ValueError(f"unknown tensor parallel style {name!r}.")
    return style


#: The dimension each style splits its module's parameters along (by attribute name, ``*``
#: for the others), or ``None`` for replicated. It restates, as data, what ``make_style``'s
#: styles do to parameters (PyTorch's ``ColwiseParallel`` splits weight and bias along 0,
#: ``RowwiseParallel`` the weight along 1 and replicates the bias; on an ``nn.Embedding``
#: it splits the vocabulary, dim 0), so that the parallelism planner can size every rank's
#: shards without building a mesh. tests/distributed/test_planner_memory.py checks the
#: planner's bytes against the DTensors these styles make.
PARAM_SPLIT_DIMS: dict[str, dict[str, int | None]] = {
    "colwise": {"*": 0},
    "kv_colwise": {"*": 0},  # replicated instead when kv heads are fewer than the degree
    "rowwise": {"weight": 1, "*": None},
    "vocab_embedding": {"*": 0},
    "lm_head": {"*": 0},
    "sequence_parallel_norm": {"*": None},
    "sequence_parallel_dropout": {"*": None},
    "replicate": {"*": None},
    "router": {"*": None},
    "experts": {"*": 0},
    "reduce_scatter_output": {"*": None},
    # The replicated-activation layout (replicated_styles, plans built from transformers').
    "colwise_gather": {"*": 0},
    "hidden_embedding": {"*": 1},
    "rowwise_allreduce": {"weight": 1, "*": None},
    "rowwise_split_input": {"weight": 1, "*": None},
    "vocab_embedding_allreduce": {"*": 0},
    "replicate_local": {"*": None},
    "replicate_partial_grad": {"*": None},
    "reduce_output": {"*": None},  # its bare parameters are split by entries of their own
    "local_params": {"*": None},  # likewise
    "experts_allreduce": {"*": 0},
    "experts_allreduce_local_slots": {"*": 0},
    "experts_batched": {"*": 0},
    "mla_kv_a_proj": {"*": None},
    "sequence_parallel_local": {"*": None},
    # transformers' Conv1D (projection_styles) holds its weight transposed; a packed one's
    # blocks are split one by one (the same bytes per rank), its bias replicated.
    "conv1d_colwise": {"weight": 1, "*": 0},
    "conv1d_packed_colwise": {"weight": 1, "*": None},
    "conv1d_rowwise_allreduce": {"weight": 0, "*": None},
    # Fused nn.Linear projections computed by rows (fused_rows): whole on every TP rank.
    "linear_packed_colwise": {"*": None},
    "shared_kv_colwise": {"*": None},
    "head_inputs": {"*": None},  # an attention module's own inputs; no parameters of its own
    "param_colwise": {"*": 0},  # the 1-D and 2-D bare parameters plans name
    "param_rowwise": {"*": -1},  # (a 1-D one is replicated)
}


def param_split_dim(style: str, attr: str, *, kv_replicated: bool = False) -> int | None:
    """The dimension ``style`` splits its module's parameter ``attr`` along, or ``None``.

    Args:
        style: A style name of ``torch_sagemaker.policies.STYLES``.
        attr: The parameter's attribute name on its module (``"weight"``, ``"bias"``).
        kv_replicated: The model has fewer kv heads than ranks (``kv_colwise`` replicates).

    Raises:
        ValueError: For an unknown style.
    """
    if style not in PARAM_SPLIT_DIMS:
        raise ValueError(f"unknown tensor parallel style {style!r}.")
    if style == "kv_colwise" and kv_replicated:
        return None
    dims = PARAM_SPLIT_DIMS[style]
    return dims.get(attr, dims["*"])


__all__ = [
    "AllReduceGrad",
    "PARAM_SPLIT_DIMS",
    "ExpertsParallel",
    "ReplicateParallel",
    "ReplicatedKVColwise",
    "SequenceParallelDropout",
    "SequenceParallelNorm",
    "distribute_params",
    "make_style",
    "param_split_dim",
    "shard_given_embeddings",
    "to_local_partial_grad",
]
