"""A first-use check that a replicated module really sees whole activations on every TP rank.

Note [Replicated module check]: a module that a transformers plan leaves out is replicated
(``replicate_local``), which is right when its input is the same on every TP rank and the
gradient of its output is too (then its parameter gradients are equal everywhere). It is
wrong when the module computes on this rank's part of a split activation (a per-head norm
after a column-parallel projection: its parameter gradient would cover this rank's heads
only), or when its output is consumed per rank (the gradient coming back is partial). The
plan does not say which, and module names do not either; the data does. On its first call
with gradients the module compares a fingerprint of its input over the TP group, and on
the first backward a fingerprint of its output's gradient. Replicated activations are
bit-identical across TP ranks (all-reduces and all-gathers give every rank the same bytes),
split ones differ; a difference raises on every rank of the group at once (they compare
the same gathered values), naming the module and the fix. The check costs one tiny
all-gather per module, once per direction. The output's gradient is compared only where it
reaches something: a parameter of the module that requires a gradient, or an input that
does. A frozen module on positions (RoFormer's sinusoidal embedding) has neither; under
FSDP1 its output still requires a gradient (its weight is a view of the unit's flat
parameter), whose differing values train nothing. Whether the module's parameters require
a gradient is read at its first call with gradients, not when the check is installed: a
user may freeze a module after ``tsm.transform`` (or FSDP2 may have replaced its
parameters by then). Where the module shows no ``nn.Parameter`` at that call (during its
forward FSDP1 registers plain-tensor views of its flat parameter, which require a gradient
whenever anything in the flat parameter trains), those it had when the check was
installed decide.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Size and three sums of ``x`` (float64), equal on ranks that hold the same tensor."""
    flat = x.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    size = torch.tensor([flat.numel(), x.dim()], dtype=torch.float64, device=flat.device)
    return torch.cat([size, torch.stack([flat.sum(), flat.abs().sum(), (flat * weights).sum()])])


def _differs(x: torch.Tensor, mesh: DeviceMesh) -> bool:
    mine = _fingerprint(x)
    gathered = [torch.empty_like(mine) for _ in range(mesh.size())]
    dist.all_gather(gathered, mine, group=mesh.get_group())
    first = gathered[0]
    return any(not torch.equal(first, other) for other in gathered[1:])


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class ReplicationCheck:
    """Checks once that ``module``'s input and output gradient are equal on every TP rank.

    Args:
        name: The module's name in the model (for the message).
        mesh: The TP mesh.
        params: The module's parameters when the check is installed; None checks the
            output's gradient wherever it needs one.
    """

    def __init__(
        self, name: str, mesh: DeviceMesh, params: list[nn.Parameter] | None = None
    ) -> None:
        self.name, self.mesh = name, mesh
        self.input_checked = self.grad_hooked = False
        # the module's parameters when the check was installed (module docstring)
        self.installed_params = params
        # whether a gradient of the output reaches a parameter or an input (module docstring)
        self.reaches = params is None

    def _trainable(self, module: nn.Module | None) -> bool:
        params: list[torch.Tensor] = []
        if module is not None:
            # FSDP1 registers plain-tensor views of its flat parameter during the forward
            params = [p for p in module.parameters() if isinstance(p, nn.Parameter)]
        if not params:
            params = list(self.installed_params or [])
        return any(p.requires_grad for p in params)

    def error(self, what: str) -> ValueError:
        """The error for ``what`` (input, output gradient) differing between the ranks."""
        return ValueError(
            f"tsm.transform: {self.name} is replicated over the tensor parallel ranks because "
            f"the model's TP plan (transformers', the user's or the one shipped for its family) "
            f"leaves it out, but {what} differs between those "
            "ranks: it computes on split activations (Note [Replicated module check]), so "
            "replicating it would give wrong gradients. Give it a style in the plan (e.g. "
            "'replicated_with_grad_allreduce' for a module applied to this rank's heads) by "
            "setting model.tp_plan before tsm.transform, or register a "
            "torch_sagemaker.policies.ModelPolicy for the model (docs/tensor_parallel.md)."
        )

    def on_input(self, args: tuple, kwargs: dict, module: nn.Module | None = None) -> None:
        """Compares the first floating input over the TP group (first call with gradients).

        Args:
            args: The module's positional inputs.
            kwargs: Its keyword inputs.
            module: The module, whose parameters' ``requires_grad`` are read now.
        """
        if self.input_checked or not torch.is_grad_enabled():
            return
        x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
        self.input_checked = True
        self.reaches = (
            self.reaches
            or self._trainable(module)
            or any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values())
            )
        )
        if x is not None and _differs(x, self.mesh):
            raise self.error("its input")

    def on_output(self, output: Any) -> None:
        """Hooks the first floating output that needs a gradient, to compare that gradient."""
        if self.grad_hooked or not self.reaches:
            return
        y = _first_tensor(output)
        if y is None or not y.requires_grad:
            return
        self.grad_hooked = True

        def check(grad: torch.Tensor) -> None:
            if _differs(grad, self.mesh):
                raise self.error("the gradient of its output")

        y.register_hook(check)


def install(module: nn.Module, name: str, mesh: DeviceMesh) -> None:
    """Adds the check to ``module``'s forward (hooks; removed by nothing, they run once)."""
    check = ReplicationCheck(name, mesh, list(module.parameters()))
    module.register_forward_pre_hook(
        lambda m, args, kwargs: check.on_input(args, kwargs, m), with_kwargs=True
    )
    module.register_forward_hook(lambda _m, _a, out: check.on_output(out))


__all__ = ["ReplicationCheck", "install"]
