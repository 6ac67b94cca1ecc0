"""``torch.sagemaker.moe.moe_layer.MoELayer``: the sparse MoE block ``tsm.transform`` installs.

With ``MoEConfig(smp_moe=True)`` every sparse MoE block of the model (the policy's
``MoESpec.block_class``) is replaced by a ``MoELayer`` that adopts the block's children
under their own names (``gate``, ``experts``, and e.g. ``shared_expert``), so parameter
names and checkpoint keys stay Hugging Face's. Its forward:

1. optional multiplicative router jitter (Mixtral's ``router_jitter_noise``), as the model;
2. router logits in fp32 of the rank's own tokens: the router is called on fp32 input and
   its weight is kept in fp32 under mixed precision by the FSDP integration
   (``torch_sagemaker.sharding.experts``); its output is what ``output_router_logits=True``
   returns;
3. ``global_token_shuffle``: the EP group's tokens, with their router logits, dealt out
   randomly (``token_shuffle``; Note [Router logits and the token shuffle]);
4. routing with the configured load balancing (``routing.route``);
5. the experts (split over the EP ranks by ``experts.split_experts``, tokens dispatched);
6. shared experts (Qwen2-MoE: ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``);
7. the auxiliary losses (Switch aux loss for ``"aux_loss"``, z-loss when its coefficient is
   positive), attached to the output so that ``loss.backward()`` includes their gradients
   (Note [Auxiliary losses in backward]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torch_sagemaker.moe import routing
from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.moe.token_shuffle import TokenShuffle

# Note [Auxiliary losses in backward]: the model's forward returns its own loss; the
# auxiliary terms of each MoE layer are not added to it. Instead ``_AttachAuxLoss`` returns
# the layer output unchanged and, in backward, hands the aux term a gradient of
# ``aux_loss_scale()`` (1 by default): ``loss.backward()`` then computes the gradient of
# ``loss + sum of the aux terms``, per rank, and data-parallel averaging makes it the mean
# over ranks. The value of each layer's term is kept in ``MoELayer.aux_loss`` for logging
# (``torch_sagemaker.moe.aux_losses(model)``). Scripts that divide the loss before backward
# (gradient accumulation) set ``set_aux_loss_scale`` to the same factor.
_AUX_LOSS_SCALE = [1.0]

# Note [Router logits and the token shuffle]: Hugging Face's models record the router's output
# for ``output_router_logits=True`` with a forward hook on the router module (an
# ``OutputRecorder``) and compute their load-balancing loss from it, row by row against the
# attention mask of the rank's batch. So the router runs on the rank's own tokens, in their
# order, before the shuffle, and the logits then travel with the token rows
# (``TokenShuffle.move``: same permutation and counts). Running the router on the received
# rows instead recorded other ranks' tokens in shuffled order and count: with a padding mask
# the model's loss crashed on the shapes or, with equal counts, weighed the wrong tokens. The
# router is replicated over the EP group and works row by row, so routing on the received
# logits equals routing computed on the received rows, and the gradients of the logits return
# to their tokens' rank by the reverse all-to-all. The cost is one more all-to-all per layer,
# of ``num_experts`` fp32 values per token.

# Note [MoELayer under tensor parallelism]: with tensor_parallel_degree > 1 (and expert
# parallel degree 1) the TP plan has already split the experts whole over the TP ranks
# (style ``experts``: each rank runs its experts for every token and returns a ``Partial``
# sum) and replicated the router (style ``router``: plain logits, computed alike on every
# rank). The layer's input is then a ``Replicate`` DTensor, and the layer routes, as in one
# process, on every TP rank alike. The gating weights it passes to the experts are plain
# tensors whose gradient on a rank covers only that rank's experts; the ``experts`` style
# takes a plain input as replicated and sums its gradient over the TP ranks, so the router's
# replicated parameters get the whole gradient on every rank. The auxiliary terms are
# computed alike on every rank from the plain logits, so their gradient is whole already.
# tests/distributed/test_expert_parallel.py checks this against one process.


def set_aux_loss_scale(scale: float) -> None:
    """Scale of the auxiliary losses' gradient (Note [Auxiliary losses in backward])."""
    _AUX_LOSS_SCALE[0] = float(scale)


def aux_loss_scale() -> float:
    """The current scale of the auxiliary losses' gradient."""
    return _AUX_LOSS_SCALE[0]


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        aux_grad = torch.full(
            ctx.aux_shape, aux_loss_scale(), dtype=ctx.aux_dtype, device=grad.device
        )
        return grad, aux_grad


class MoELayer(nn.Module):
    """A sparse MoE block with SMP's routing options and expert parallel dispatch.

    Args:
        block: The Hugging Face block it replaces (its children are adopted).
        spec: The model's ``MoESpec`` (child names, top-k and normalization settings).
        config: The ``MoEConfig``.
        num_experts: Experts of the layer (all EP ranks together).
        top_k: Experts per token.
        normalize: Renormalize the top-k gating weights.
        shuffle: The token shuffle, or ``None``.
    """

    def __init__(
        self,
        block: nn.Module,
        spec: Any,
        config: MoEConfig,
        *,
        num_experts: int,
        top_k: int,
        normalize: bool,
        shuffle: TokenShuffle | None,
    ) -> None:
        super().__init__()
        own = [n for n, _ in block.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"{type(block).__name__} holds parameters {own} itself; MoELayer adopts "
                "only child modules. Describe the block differently in the policy."
            )
        for name, child in block.named_children():
            self.add_module(name, child)
        self.spec = spec
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.load_balancing = config.moe_load_balancing
        self.aux_loss_coeff = (
            config.moe_aux_loss_coeff if self.load_balancing == "aux_loss" else 0.0
        )
        self.z_loss_coeff = config.moe_z_loss_coeff
        self.jitter_noise = (
            float(getattr(block, spec.jitter_attr, 0.0) or 0.0) if spec.jitter_attr else 0.0
        )
        self.shuffle = shuffle
        self.aux_loss: torch.Tensor | None = None
        self.replaced = type(block).__name__

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        router = getattr(self, self.spec.router)
        out = router(x.to(router.weight.dtype))
        logits = out[0] if isinstance(out, tuple) else out
        return logits.float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden), as the block it replaced."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        # Before the shuffle: the logits Hugging Face records (Note [Router logits and the
        # token shuffle]).
        logits = self._router_logits(x)
        shuffled = None
        if self.shuffle is not None:
            x, shuffled = self.shuffle.shuffle(x)
            logits = self.shuffle.move(logits, shuffled)
        r = routing.route(
            logits,
            self.top_k,
            normalize=self.normalize,
            method=self.load_balancing,
            training=self.training,
        )
        out = getattr(self, self.spec.experts)(x, r.indices, r.weights)
        if self.spec.shared_expert:
            shared = getattr(self, self.spec.shared_expert)(x)
            if self.spec.shared_expert_gate:
                shared = torch.sigmoid(getattr(self, self.spec.shared_expert_gate)(x)) * shared
            out = out + shared
        aux = None
        if self.training and self.aux_loss_coeff > 0:
            aux = self.aux_loss_coeff * routing.switch_aux_loss(
                r.probs, r.indices, self.num_experts
            )
        if self.training and self.z_loss_coeff > 0:
            z = self.z_loss_coeff * routing.z_loss(logits)
            aux = z if aux is None else aux + z
        if aux is not None and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, aux)
        if self.training:  # aux_losses(model): the last training forward's, not an eval's None
            self.aux_loss = None if aux is None else aux.detach()
        if shuffled is not None:
            assert self.shuffle is not None  # it shuffled x above
            out = self.shuffle.unshuffle(out, shuffled)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        """The layer's routing settings, shown by ``repr(model)``."""
        return (
            f"replaces={self.replaced}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"load_balancing={self.load_balancing!r}, shuffle={self.shuffle is not None}"
        )


def aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """The auxiliary loss value of each ``MoELayer`` of ``model`` at its last training forward."""
    return {
        name: m.aux_loss
        for name, m in model.named_modules()
        if isinstance(m, MoELayer) and m.aux_loss is not None
    }


__all__ = ["MoELayer", "aux_loss_scale", "aux_losses", "set_aux_loss_scale"]
