"""Rank side: one family under TP 2 x hybrid shard 2 against the same model in one process.

Every rank builds the tiny model from one seed, keeps an untransformed copy as the
reference, and transforms the other as a training script does: ``tsm.transform``,
activation checkpointing on the transformer layers, FSDP2 over ``tsm.state.fsdp_mesh``.
Both see the same data: this rank's data-parallel batch for the TP model; every
data-parallel rank's batch, averaged, for the reference (what FSDP's gradient averaging
amounts to). Compared: logits and loss of this rank's batch, every gradient, the loss at
each of ``STEPS`` AdamW steps, and every parameter after them.
"""

from __future__ import annotations

import copy
import traceback
from typing import Any

TP, HYBRID_SHARD = 2, 2
STEPS = 3
# SGD with momentum, not AdamW: Adam divides each update by the root of its squared
# gradients, so an element whose gradient is near zero moves by about +-LR whatever its
# size, and rounding-level differences of such gradients (TP sums in another order) become
# LR-sized parameter differences (seen on Gemma 4's 512-wide heads). With SGD a parameter
# differs by LR times the gradient difference, so a tight bound catches a wrong gradient
# and nothing else. (AdamW on plan-driven models: tests/distributed/test_tp_plan_features.py.)
LR, MOMENTUM = 0.02, 0.9
BATCH, SEQ = 2, 16

#: Tolerances: |difference| <= ATOL + RTOL * (largest reference magnitude of that tensor).
#: fp32 on CPU; TP sums the split matmuls in another order, so differences are rounding.
ATOL, RTOL = 2e-5, 2e-5
#: Parameters after STEPS steps: a wrong gradient moves a weight by ~LR x the gradient
#: (1e-4 .. 1e-2 here); rounding, by ~LR x 1e-7.
PARAM_ATOL = 1e-5
#: Size of the perturbation that measures a tiny model's own sensitivity (Note [Sensitivity
#: of the tiny model]).
PERTURBATION = 1e-7

# Note [Sensitivity of the tiny model]: some tiny models amplify rounding-level differences
# through the steps by themselves (Gemma 4's: parameters perturbed by 1e-7 give embedding
# gradients 8e-4 apart at once and 0.8 apart after three steps, in one process, without
# TP). When the parameters after the steps differ by more than PARAM_ATOL, the reference is
# trained again from parameters perturbed by PERTURBATION; a parameter passes if TP moved it
# by no more than ten times that twin did. The first step's gradients are still compared
# at the fixed tolerance, and the table shows the sensitivity wherever it was used.


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


def _batch(dp_rank: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def checkpoint_and_shard(model) -> None:
    """Activation checkpointing per transformer layer, then FSDP2, as training scripts do.

    The layer classes come from the policy ``tsm.transform`` recorded on the model; FSDP2
    shards over ``tsm.state.fsdp_mesh``, each checkpointed layer and then the root.
    """
    from functools import partial

    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.policies import transformer_layer_classes

    classes = transformer_layer_classes(model)
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, classes),
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )
    for module in model.modules():
        if isinstance(module, CheckpointWrapper):
            fully_shard(module, mesh=tsm.state.fsdp_mesh)
    fully_shard(model, mesh=tsm.state.fsdp_mesh)


def shard_fsdp1(model):
    """FSDP1 as SMP's example scripts wrap a model: the wrapped model.

    Each transformer layer an FSDP1 unit, HYBRID_SHARD, ``use_orig_params=True``, and
    activation checkpointing applied to the wrapped model's layers.
    """
    from functools import partial

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from torch_sagemaker.policies import transformer_layer_classes

    classes = transformer_layer_classes(model)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls=set(classes)),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        wrapped,
        check_fn=lambda m: isinstance(m, classes),
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )
    return wrapped


def _whole(model, fsdp: int, grads: bool = False):
    """A context in which FSDP1's parameters (and gradients) are whole; none for FSDP2."""
    import contextlib

    if fsdp != 1:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(model, with_grads=grads)


def _split_share(model) -> float:
    """Share of parameter elements split over the TP ranks (not replicated)."""
    from torch.distributed.tensor import DTensor, Replicate

    total = split = 0
    for p in model.parameters():
        total += p.numel()
        if isinstance(p, DTensor) and any(pl != Replicate() for pl in p.placements):
            split += p.numel()
    return split / max(total, 1)


def _worst(diffs: dict[str, tuple[float, float]], atol: float, rtol: float) -> dict:
    """The largest difference, and every name over its tolerance."""
    over = {n: d for n, (d, scale) in diffs.items() if d > atol + rtol * scale}
    name = max(diffs, key=lambda n: diffs[n][0]) if diffs else ""
    return {"max": diffs[name][0] if diffs else 0.0, "at": name, "over": over}


def _forward(model, ids, step: int, data_rank: int):
    """``model`` on ``ids``, its random draws seeded by (step, data_rank).

    A family that draws at random while training (PhiMoE's router) then draws the same
    numbers in the TP model (all TP ranks share the default generator) and the reference.
    """
    import torch

    from tools.model_coverage.tiny import extra_inputs

    torch.manual_seed(7 + 1000 * step + data_rank)
    return model(input_ids=ids, labels=ids, use_cache=False, **extra_inputs(model, len(ids)))


def _train(model, data: dict, losses: list, dp_rank: int) -> None:
    """STEPS optimizer steps of ``model`` on the batches of ``data``, averaged.

    ``data`` maps a data-parallel rank to its ids; the loss of ``dp_rank``'s batch at each
    step is appended to ``losses``.
    """
    import torch

    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        for i, ids in data.items():
            loss = _forward(model, ids, step, i).loss
            (loss / len(data)).backward()
            if i == dp_rank:
                losses.append(float(_full(loss)))
        opt.step()


def _diff(a: Any, b: Any) -> tuple[float, float]:
    a, b = _full(a).detach().float(), _full(b).detach().float()
    return float((a - b).abs().max()), float(b.abs().max())


def family_parity(model_type: str, fsdp: int = 2) -> dict:
    """Runs the comparison for ``model_type`` on this rank; returns the measured differences.

    ``fsdp``: 2 (``fully_shard`` per checkpointed layer) or 1 (``shard_fsdp1``, as SMP's
    example scripts wrap).
    """
    import torch
    import torch.sagemaker as tsm

    from tools.model_coverage.tiny import build
    from torch_sagemaker.policies import get_policy

    dp_rank, dp_size = tsm.state.dp_rank, tsm.state.dp_size
    ref = build(model_type)
    untrained = copy.deepcopy(ref)
    vocab = ref.get_input_embeddings().num_embeddings
    batches = [_batch(d, min(vocab, 128)) for d in range(dp_size)]
    mine = batches[dp_rank]
    try:  # a family whose own model fails on the tiny config says so, not TP
        expected = _forward(ref, mine, 0, dp_rank)
    except Exception as e:
        raise ReferenceModelError(f"the untransformed model fails: {error_summary(e)}") from e
    # (a copy from before the reference's first forward: some models change their own
    # modules there, BigBird's attention, and a user transforms a model that has not run)
    model = tsm.transform(copy.deepcopy(untrained))
    policy = get_policy(model)
    share = _split_share(model)
    if fsdp == 1:
        model = shard_fsdp1(model)
    else:
        checkpoint_and_shard(model)

    out = _forward(model, mine, 0, dp_rank)
    out.loss.backward()
    forward = {"logits": _diff(out.logits, expected.logits), "loss": _diff(out.loss, expected.loss)}
    ref.zero_grad()
    for d, ids in enumerate(batches):
        (_forward(ref, ids, 0, d).loss / dp_size).backward()
    ref_params = dict(ref.named_parameters())
    grads = {}
    with _whole(model, fsdp, grads=True):
        for n, p in model.named_parameters():
            want = ref_params[_clean(n)].grad
            if fsdp == 1 and want is None and p.grad is not None:
                # FSDP1's flat gradient covers every parameter of its unit: one the loss does
                # not reach gets zeros where the reference has none (compared as zeros)
                want = torch.zeros_like(_full(p.grad))
            if p.grad is None or want is None:
                missing = (p.grad is None) != (want is None)
                grads[_clean(n)] = (float("inf") if missing else 0.0, 0.0)
            else:
                grads[_clean(n)] = _diff(p.grad, want)

    losses: dict[str, list[float]] = {"tp": [], "reference": []}
    _train(model, {dp_rank: mine}, losses["tp"], dp_rank)
    _train(ref, dict(enumerate(batches)), losses["reference"], dp_rank)
    with _whole(model, fsdp):
        params = {_clean(n): _diff(p, ref_params[_clean(n)]) for n, p in model.named_parameters()}
    curve = max(abs(a - b) for a, b in zip(losses["tp"], losses["reference"]))
    grad_scale = max((s for _, s in grads.values()), default=0.0)
    worst_params = _worst(params, PARAM_ATOL, 0.0)
    sensitivity = 0.0
    if worst_params["over"]:  # Note [Sensitivity of the tiny model]
        twin = copy.deepcopy(untrained)
        with torch.no_grad():
            noise = torch.Generator().manual_seed(99)
            for p in twin.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * PERTURBATION)
        _train(twin, dict(enumerate(batches)), [], dp_rank)
        floor = {n: _diff(p, ref_params[n])[0] for n, p in twin.named_parameters()}
        sensitivity = max(floor.values())
        worst_params["over"] = {
            n: d for n, d in worst_params["over"].items() if d > PARAM_ATOL + 10 * floor[n]
        }
    return {
        "policy": policy.name if policy else "",
        "sensitivity": sensitivity,
        "split_share": share,
        "forward": {k: _worst({k: v}, ATOL, RTOL) for k, v in forward.items()},
        "grads": _worst(grads, ATOL, RTOL * 10),
        "grad_scale": grad_scale,
        "curve": curve,
        "losses": losses,
        "params": worst_params,
    }


def passed(result: dict) -> tuple[bool, str]:
    """Whether one rank's result is within the tolerances, and what failed if not."""
    problems = []
    for key, worst in result["forward"].items():
        if worst["over"]:
            problems.append(f"{key} differ by {worst['max']:.2e}")
    if result["grads"]["over"]:
        names = sorted(result["grads"]["over"], key=lambda n: -result["grads"]["over"][n])
        problems.append(
            f"gradients differ ({len(names)} tensors; {names[0]} by "
            f"{result['grads']['over'][names[0]]:.2e})"
        )
    if result["grad_scale"] <= 1e-6:
        problems.append("the reference gradients are all zero")
    if result["curve"] > 1e-4 + 1e-5 * max(result["losses"]["reference"], default=0.0):
        problems.append(f"loss curves differ by {result['curve']:.2e}")
    if result["params"]["over"]:
        over = result["params"]["over"]
        name = max(over, key=lambda n: over[n])
        problems.append(f"parameters after {STEPS} steps differ ({name} by {over[name]:.2e})")
    return not problems, "; ".join(problems)


class ReferenceModelError(RuntimeError):
    """The family's own model fails on its tiny config (nothing about TP)."""


def error_summary(exc: BaseException) -> str:
    """The exception's type and message, and where it was raised (innermost frame)."""
    if isinstance(exc, ReferenceModelError):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" ({last.filename.rsplit('/', 2)[-2:][-1]}:{last.lineno})"
    message = " ".join(str(exc).split())
    if len(message) > 400:
        message = message[:400] + " ..."
    return f"{type(exc).__name__}: {message}{where}"
