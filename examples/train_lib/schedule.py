"""Learning-rate schedule: linear warm-up then cosine decay to ``min_lr`` (checkpointable)."""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    max_steps: int,
    warmup_fraction: float,
    lr: float,
    min_lr: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` whose state_dict round-trips through checkpoints."""
    warmup = max(1, int(max_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return (min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: no weight decay for biases and norm weights (1-D tensors), decay for the rest."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.dim() < 2 else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
