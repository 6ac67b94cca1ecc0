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
LR = 1e-2
BATCH, SEQ = 2, 16

#: Tolerances: |difference| <= ATOL + RTOL * (largest reference magnitude of that tensor).
#: fp32 on CPU; TP sums the split matmuls in another order, so differences are rounding.
ATOL, RTOL = 2e-5, 2e-5
#: Parameters after STEPS AdamW steps at LR: a wrong gradient moves a weight by ~LR, while
#: Adam's normalisation turns rounding-level gradient differences into up to ~1e-4 where a
#: gradient is tiny.
PARAM_ATOL = 1e-3


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _batch(dp_rank: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _checkpoint_and_shard(model) -> None:
    """Activation checkpointing per transformer layer, then FSDP2, as training scripts do."""
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


def _diff(a: Any, b: Any) -> tuple[float, float]:
    a, b = _full(a).detach().float(), _full(b).detach().float()
    return float((a - b).abs().max()), float(b.abs().max())


def family_parity(model_type: str) -> dict:
    """Runs the comparison for ``model_type`` on this rank; returns the measured differences."""
    import torch
    import torch.sagemaker as tsm

    from tools.model_coverage.tiny import build
    from torch_sagemaker.policies import get_policy

    dp_rank, dp_size = tsm.state.dp_rank, tsm.state.dp_size
    ref = build(model_type)
    vocab = ref.get_input_embeddings().num_embeddings
    batches = [_batch(d, min(vocab, 128)) for d in range(dp_size)]
    mine = batches[dp_rank]
    try:  # a family whose own model fails on the tiny config says so, not TP
        expected = ref(input_ids=mine, labels=mine, use_cache=False)
    except Exception as e:
        raise ReferenceModelError(f"the untransformed model fails: {error_summary(e)}") from e
    model = tsm.transform(copy.deepcopy(ref))
    policy = get_policy(model)
    share = _split_share(model)
    _checkpoint_and_shard(model)

    out = model(input_ids=mine, labels=mine, use_cache=False)
    out.loss.backward()
    forward = {"logits": _diff(out.logits, expected.logits), "loss": _diff(out.loss, expected.loss)}
    ref.zero_grad()
    for ids in batches:
        (ref(input_ids=ids, labels=ids, use_cache=False).loss / dp_size).backward()
    ref_params = dict(ref.named_parameters())
    grads = {}
    for n, p in model.named_parameters():
        want = ref_params[_clean(n)].grad
        if p.grad is None or want is None:
            grads[_clean(n)] = (float("inf") if (p.grad is None) != (want is None) else 0.0, 0.0)
        else:
            grads[_clean(n)] = _diff(p.grad, want)

    losses: dict[str, list[float]] = {"tp": [], "reference": []}
    for target, data, key in ((model, [mine], "tp"), (ref, batches, "reference")):
        target.zero_grad()
        opt = torch.optim.AdamW(target.parameters(), lr=LR)
        for _ in range(STEPS):
            opt.zero_grad()
            for i, ids in enumerate(data):
                loss = target(input_ids=ids, labels=ids, use_cache=False).loss
                (loss / len(data)).backward()
                if key == "tp" or i == dp_rank:
                    losses[key].append(float(_full(loss)))
            opt.step()
    params = {_clean(n): _diff(p, ref_params[_clean(n)]) for n, p in model.named_parameters()}
    curve = max(abs(a - b) for a, b in zip(losses["tp"], losses["reference"]))
    grad_scale = max((s for _, s in grads.values()), default=0.0)
    return {
        "policy": policy.name if policy else "",
        "split_share": share,
        "forward": {k: _worst({k: v}, ATOL, RTOL) for k, v in forward.items()},
        "grads": _worst(grads, ATOL, RTOL * 10),
        "grad_scale": grad_scale,
        "curve": curve,
        "losses": losses,
        "params": _worst(params, PARAM_ATOL, 0.0),
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
