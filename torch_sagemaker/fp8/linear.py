"""``Fp8Linear``: an ``nn.Linear`` whose three matrix products run in FP8 inside ``fp8_autocast``.

Outside an enabled region its forward is ``nn.Linear.forward`` itself (bit for bit what it
was). Inside one, with ``y = x W^T + b``:

    forward    y  = (q(x) @ q(W)^T) in the activation dtype, + b     q: forward format (e4m3)
    backward   dx = q(dy) @ q(W)                                     q(dy): backward format
               dW = q(dy)^T @ q(x)                                   (e5m2 with HYBRID)

with per-tensor scales from the recipe (Note [FP8 numerics] in ``numerics.py``). The
parameters stay what they are (fp32 masters, or FSDP's bf16 compute copies): the optimizer
never sees FP8. The FP8 copies of ``x`` and ``W`` are what the backward keeps.

Tensor parallel layers (DTensor parameters on a 1-D mesh, from ``ColwiseParallel`` /
``RowwiseParallel``) compute on their local shards: column-parallel takes the replicated
input and returns this rank's output columns, row-parallel takes the input's last-dimension
shard and returns a partial sum; DTensor does the communication around it as before.
Shards of one tensor get one scale (the amax of the whole tensor: Note [Which ranks reduce
amaxes] in ``scaling.py``), so a split layer quantizes exactly as the unsplit one.

Note [FP8 under recomputation]: activation checkpointing runs a layer's forward a second
time during the backward, after ``fp8_autocast`` has exited. A forward that runs while the
autograd engine executes a backward in this thread is such a recomputation (torch's
checkpointing, reentrant or not, is the only thing that runs module forwards there). It
reuses the settings and the scales of the layer's last forward outside the backward and
records no amax (Note [When scales update] in ``scaling.py``), so it rebuilds the FP8
tensors the first forward saved, bit for bit, and each step's amax history gets one entry
per tensor. The output gradient is recorded by the backward that runs, once. The last
forward is the one being recomputed in every schedule where each micro-batch's backward
follows its forward before the next forward; a schedule that runs several forwards first
(pipelining) must keep them in one ``fp8_autocast`` region.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torch_sagemaker._torch_compat import autograd as autograd_compat
from torch_sagemaker.fp8 import te_bridge
from torch_sagemaker.fp8.autocast import OFF, Fp8Settings, active, entered
from torch_sagemaker.fp8.numerics import amax, current_scale, quantize, scaled_matmul
from torch_sagemaker.fp8.recipe import DelayedScaling, Float8CurrentScaling, resolve_recipe
from torch_sagemaker.fp8.scaling import G, LinearScaling, W, X, reduce_max
from torch_sagemaker.logger import warn_once

_TE_REGION_WARNING = (
    "Transformer Engine's fp8_autocast is active around torch_sagemaker's Fp8Linear layers, "
    "which only torch_sagemaker's region switches to FP8: they compute in their own "
    "precision. Enter torch.sagemaker.fp8.fp8_autocast instead (same arguments), or call "
    "torch_sagemaker.tensor_parallel.use_backend('te') before tsm.transform to build "
    "Transformer Engine's layers."
)


def _warn_if_te_region() -> None:
    """Warns once when Transformer Engine's region, not ours, surrounds an FP8 layer."""
    if not torch.compiler.is_compiling() and te_bridge.te_fp8_enabled():
        warn_once(_TE_REGION_WARNING)


def _with_native_recipe(settings: Fp8Settings) -> Fp8Settings:
    """``settings``, refusing a Transformer Engine recipe passed through for its own layers.

    Raises:
        ValueError: From ``resolve_recipe``, naming the recipe or option.
    """
    if isinstance(settings.recipe, (DelayedScaling, Float8CurrentScaling)):
        return settings
    recipe = resolve_recipe(settings.recipe)
    return Fp8Settings(settings.enabled, settings.calibrating, recipe, settings.group)


class _Call:
    """One FP8 forward of a layer and its backward: which scales, which recording."""

    def __init__(
        self,
        state: LinearScaling,
        settings: Fp8Settings,
        recomputing: bool,
        tp_group: Any,
        sharded: tuple[bool, bool, bool],
        out_dtype: torch.dtype,
    ) -> None:
        self.state = state
        self.recipe = settings.recipe
        self.recomputing = recomputing
        self.tp_group = tp_group
        self.sharded = sharded  # per role: is this rank's tensor a shard of a larger one
        self.out_dtype = out_dtype

    def dtype(self, role: int) -> torch.dtype:
        fmt = self.recipe.fp8_format
        return fmt.backward_dtype if role == G else fmt.forward_dtype

    def scale(self, role: int, t: torch.Tensor, record: bool) -> torch.Tensor:
        """The scale ``t`` is quantized with; records its amax for delayed scaling."""
        if isinstance(self.recipe, Float8CurrentScaling):
            value = amax(t)
            if self.sharded[role] and self.tp_group is not None:
                reduce_max(value, self.tp_group)  # the whole tensor's amax
            return current_scale(value, self.dtype(role), self.recipe.use_power_2_scales)
        if record:
            self.state.record(role, amax(t))
        if role == G:
            return self.state.scale_of(G)
        return self.state.forward_scale_of(role, self.recomputing)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ weight^T`` with all three products in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, call: _Call) -> torch.Tensor:
        record = not call.recomputing  # Note [FP8 under recomputation]
        x2 = x.reshape(-1, x.shape[-1])
        scale_x = call.scale(X, x2, record)
        scale_w = call.scale(W, weight, record)
        xq = quantize(x2, scale_x, call.dtype(X))
        wq = quantize(weight, scale_w, call.dtype(W))
        inv_x, inv_w = scale_x.reciprocal(), scale_w.reciprocal()
        y = scaled_matmul(xq, wq.t(), inv_x, inv_w, call.out_dtype)
        ctx.save_for_backward(xq, wq, inv_x, inv_w)
        ctx.call, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = call, x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, wq, inv_x, inv_w = ctx.saved_tensors
        call: _Call = ctx.call
        g2 = grad.reshape(-1, grad.shape[-1])
        scale_g = call.scale(G, g2, record=True)  # this backward runs once per forward graph
        gq = quantize(g2, scale_g, call.dtype(G))
        inv_g = scale_g.reciprocal()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_matmul(gq, wq, inv_g, inv_w, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = scaled_matmul(gq.t(), xq, inv_g, inv_x, ctx.w_dtype)
        return dx, dw, None


def _is_shard(p: Placement, dim: int, ndim: int) -> bool:
    return isinstance(p, Shard) and p.dim % ndim == dim


def _local_operands(
    x: torch.Tensor, weight: DTensor
) -> tuple[torch.Tensor, list[Placement], tuple[bool, bool, bool]]:
    """This rank's input, the output's placements and which roles are shards.

    For a DTensor weight on a 1-D mesh: column-parallel, row-parallel or replicated.
    """
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"FP8 linear: weight is a DTensor on a {mesh.ndim}-D mesh ({weight.placements}); "
            "FP8 layers compute on a 1-D tensor parallel mesh (FSDP2 unshards the others "
            "before the forward)."
        )
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    (wp,), (xp,) = weight.placements, x.placements
    last = x.ndim - 1
    if _is_shard(wp, 0, 2) and isinstance(xp, Replicate):  # column-parallel
        # Each rank's input gradient covers its columns only: a partial sum.
        return x.to_local(grad_placements=[Partial()]), [Shard(last)], (False, True, True)
    if _is_shard(wp, 1, 2) and _is_shard(xp, last, x.ndim):  # row-parallel
        return x.to_local(), [Partial()], (True, True, False)
    if isinstance(wp, Replicate) and not _is_shard(xp, last, x.ndim) and not xp.is_partial():
        return x.to_local(), [xp], (False, False, False)
    raise ValueError(
        f"FP8 linear: weight placement {wp} with input placement {xp} is not a layout it "
        "computes (column-parallel Shard(0) with a replicated input, row-parallel Shard(1) "
        "with a last-dimension shard, or a replicated weight)."
    )


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` that computes in FP8 inside an enabled ``fp8_autocast`` region.

    Made by ``torch_sagemaker.fp8.to_fp8_linear`` (in place, from an ``nn.Linear``);
    ``tsm.transform`` makes the policy's linear layers so. Parameters, state dict and
    behaviour outside the region are ``nn.Linear``'s.

    Attributes:
        fp8_scaling: The layer's delayed-scaling state (``scaling.LinearScaling``).
    """

    fp8_scaling: LinearScaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``nn.Linear.forward``, in FP8 inside an enabled region (module docstring)."""
        if not entered():  # Note [FP8 layers under torch.compile] in autocast.py
            _warn_if_te_region()
            return super().forward(x)
        state = self.fp8_scaling
        recomputing = autograd_compat.current_graph_task_id() != -1
        if recomputing:  # Note [FP8 under recomputation]
            settings = state.last_settings or OFF
        else:
            settings = active()
            if settings is OFF:
                _warn_if_te_region()
            else:
                settings = _with_native_recipe(settings)
            state.last_settings = settings
        if settings.enabled:
            return self._fp8_forward(x, settings, recomputing)
        if settings.calibrating and not recomputing and isinstance(settings.recipe, DelayedScaling):
            self._prepare(x, settings, tp_group=self._tp_group())
            state.record(X, amax(x.to_local() if isinstance(x, DTensor) else x))
            w = self.weight
            state.record(W, amax(w.to_local() if isinstance(w, DTensor) else w))
        return super().forward(x)

    def _tp_group(self) -> Any:
        w = self.weight
        if (
            isinstance(w, DTensor)
            and w.device_mesh.size() > 1
            and not isinstance(w.placements[0], Replicate)
        ):
            return w.device_mesh.get_group()
        return None

    def _prepare(self, x: torch.Tensor, settings: Fp8Settings, tp_group: Any) -> None:
        if isinstance(settings.recipe, DelayedScaling):
            self.fp8_scaling.prepare(x.device, settings.recipe, settings.group, tp_group)

    def _fp8_forward(
        self, x: torch.Tensor, settings: Fp8Settings, recomputing: bool
    ) -> torch.Tensor:
        weight = self.weight
        tp_group = self._tp_group()
        mesh, placements = None, None
        if isinstance(weight, DTensor):
            mesh = weight.device_mesh
            x_local, placements, sharded = _local_operands(x, weight)
            w_local = weight.to_local()
        elif isinstance(x, DTensor):
            raise ValueError(
                "FP8 linear: the input is a DTensor but the weight is not; parallelize the "
                "layer's weight with it (tensor parallel styles do)."
            )
        else:
            x_local, w_local, sharded = x, weight, (False, False, False)
        if not recomputing:
            self._prepare(x_local, settings, tp_group)
        call = _Call(
            self.fp8_scaling, settings, recomputing, tp_group, sharded, _out_dtype(x_local)
        )
        y = _Fp8Matmul.apply(x_local, w_local, call)
        if mesh is not None:
            y = DTensor.from_local(y, mesh, placements, run_check=False)
        if self.bias is not None:
            bias = self.bias
            # (under torch.autocast the product is in the autocast dtype; nn.Linear's would be)
            y = y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))
        return y


def to_fp8_linear(module: nn.Linear) -> Fp8Linear:
    """Makes ``module`` an ``Fp8Linear`` in place (its class changes; parameters stay).

    Raises:
        TypeError: If ``module`` is not exactly an ``nn.Linear`` (a subclass may compute
            differently; it is left to its own forward).
    """
    if type(module) is Fp8Linear:
        return module
    if type(module) is not nn.Linear:
        raise TypeError(
            f"to_fp8_linear takes an nn.Linear, got {type(module).__name__}; subclasses and "
            "modules with their own forward keep their precision."
        )
    module.__class__ = Fp8Linear
    te_bridge.note_native_layers()
    fp8 = cast(Fp8Linear, module)
    fp8.fp8_scaling = LinearScaling()
    return fp8


__all__ = ["Fp8Linear", "to_fp8_linear"]
