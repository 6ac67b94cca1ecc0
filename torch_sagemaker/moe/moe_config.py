"""``torch.sagemaker.moe.moe_config.MoEConfig``: how ``tsm.transform`` treats a mixture of experts.

SMP's scripts build it from their arguments and pass it as ``tsm.transform(model,
config=moe_config)``:

    MoEConfig(smp_moe=True, moe_load_balancing="sinkhorn", global_token_shuffle=False,
              moe_all_to_all_dispatcher=True, use_cpu_initialization=False)

The dataclass is frozen and checks every field on construction; an error names the field,
the value, the rule and a fix. The meaning of each load-balancing option is in
``torch_sagemaker.moe.routing`` and docs/expert_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

#: Load-balancing options, as SMP spells them.
LOAD_BALANCING = ("sinkhorn", "aux_loss", "balanced", "none")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings for ``tsm.transform`` (SMP's defaults).

    Attributes:
        smp_moe: Replace each sparse MoE block of the model by ``MoELayer`` (routing with
            the load balancing below, expert parallel dispatch). ``False`` keeps the
            Hugging Face block and its router and only splits the experts over the
            ``expert_parallel_degree`` ranks.
        random_seed: Seed of the token shuffle; each rank's permutations come from
            ``random_seed + ep_rank`` and a number drawn from torch's global CPU generator
            (Note [Token shuffle under recomputation]).
        moe_load_balancing: ``"sinkhorn"`` (experts chosen on Sinkhorn-balanced scores while
            training), ``"aux_loss"`` (Switch Transformer auxiliary loss, coefficient
            ``moe_aux_loss_coeff``), ``"balanced"`` (balanced assignment: every expert gets
            the same number of tokens while training) or ``"none"`` (the model's own top-k).
        global_token_shuffle: Shuffle the tokens of the expert parallel group randomly
            across its ranks before routing (and back after), so each rank routes a random
            sample of the group's tokens.
        moe_all_to_all_dispatcher: Send tokens to their experts' ranks and back by
            all-to-all (``True``) or all-gather every rank's tokens and reduce-scatter the
            outputs (``False``).
        moe_aux_loss_coeff: Coefficient of the auxiliary load-balancing loss (``"aux_loss"``).
        moe_z_loss_coeff: Coefficient of the router z-loss (ST-MoE); applied with every
            balancing option when positive, 0 disables it.
        use_cpu_initialization: Accepted for SMP's scripts (they set it on rank 0 when
            fine-tuning); parameters are created where the model's are, so it has no effect.
    """

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                problems.append(f"{f.name}={value!r}: must be True or False.")
        seed = self.random_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            problems.append(f"random_seed={seed!r}: must be an int in [0, 2**63).")
        if self.moe_load_balancing not in LOAD_BALANCING:
            problems.append(
                f"moe_load_balancing={self.moe_load_balancing!r}: unknown option; use one "
                f"of {', '.join(map(repr, LOAD_BALANCING))}."
            )
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                problems.append(f"{name}={value!r}: must be a finite number >= 0 (0 disables it).")
        if problems:
            raise ValueError("invalid MoEConfig:\n  " + "\n  ".join(problems))


__all__ = ["LOAD_BALANCING", "MoEConfig"]
