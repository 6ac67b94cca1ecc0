"""Context parallel parity cases, run on every rank by tests/distributed/test_context_parallel.py.

Each case builds a tiny model of one family from a seed, keeps an untransformed copy as
the single-process reference, transforms the other with ``context_parallel_degree > 1``,
wraps it as SMP's scripts do (FSDP1, ``use_orig_params=True``, transformer auto-wrap) or
with ``shard_model`` (FSDP2), and feeds it each sequence split the way SMP's
``get_batch_for_cp_rank`` splits it (written out independently here). Compared with the
reference on the whole sequences, over a few AdamW steps:

- the loss (mean over the context parallel group, as SMP's script logs it);
- the logits, gathered back into sequence order;
- every parameter gradient after FSDP's averaging (and after ``clip_grad_norm_``);
- the loss curve and the final parameters.

The reference trains on every data-parallel rank's sequences and averages their losses,
which is what FSDP's gradient averaging over the data-parallel ranks amounts to.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

SEQ = 16  # 2 * cp chunks of 4 (cp 2) or 2 (cp 4) tokens
BATCH = 2
STEPS = 3
LR = 1e-2
MAX_NORM = 1.0


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny fp32 model of ``family`` (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128)."""
    from tests.distributed.test_tp_parity import build

    if family in ("mistral", "mixtral", "qwen2"):
        overrides.setdefault("sliding_window", None)
    return build(family, seed, **overrides)


def sequences(dp_rank: int, step: int = 0, vocab: int = 128) -> torch.Tensor:
    """Whole sequences ``(BATCH, SEQ)`` of data-parallel rank ``dp_rank`` at ``step``."""
    g = torch.Generator().manual_seed(7919 * step + 1000 + dp_rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def smp_split(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """SMP's layout: the sequence dim cut into 2*cp chunks, chunks r and 2cp-1-r kept."""
    chunks = x.view(x.shape[0], 2 * cp, x.shape[1] // (2 * cp), *x.shape[2:])
    index = torch.tensor([cp_rank, 2 * cp - 1 - cp_rank])
    return chunks.index_select(1, index).reshape(x.shape[0], -1, *x.shape[2:])


def wrap(model, api: str, checkpointing: bool = False, mixed: bool = False):
    """FSDP1 as SMP's scripts call it, or FSDP2 through ``shard_model``; optional checkpointing."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from torch_sagemaker.policies import transformer_layer_classes
    from torch_sagemaker.sharding import shard_model

    (layer_cls,) = transformer_layer_classes(model)
    if api == "fsdp2":
        if checkpointing:
            _checkpoint(model, layer_cls)
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed
            else None
        )
        return shard_model(model, mp_policy=mp)
    mp = (
        MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
        )
        if mixed
        else None
    )
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}
        ),
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        backward_prefetch=None,
        forward_prefetch=False,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    if checkpointing:
        apply_activation_checkpointing(
            model,
            check_fn=lambda m: isinstance(m, layer_cls),
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
        )
    return model


def _checkpoint(model, layer_cls) -> None:
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, layer_cls),
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )


def clean(name: str) -> str:
    """A parameter name without FSDP1 / checkpoint wrapper prefixes."""
    for prefix in (
        "_fsdp_wrapped_module.",
        "_checkpoint_wrapped_module.",
        "_offload_wrapped_module.",
    ):
        name = name.replace(prefix, "")
    return name


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, keyed by Hugging Face name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    def value(g):
        return (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, with_grads=True):
            return {clean(n): value(p.grad) for n, p in model.named_parameters()}
    return {clean(n): value(p.grad) for n, p in model.named_parameters()}


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter's full value, keyed by Hugging Face name (FSDP1 + TP included)."""
    from torch.distributed.tensor import DTensor

    from tests.distributed.hf_models import full_params as gather

    return {
        clean(n): v.full_tensor() if isinstance(v, DTensor) else v for n, v in gather(model).items()
    }


def cp_mean(loss: torch.Tensor) -> float:
    """The loss averaged over the context parallel group (what SMP's script logs)."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    t = loss.detach().float().clone()
    dist.all_reduce(t, group=tsm.state.cp_process_group)
    return float(t) / tsm.state.cp_size


def max_diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-name max abs difference."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {n: float((got[n].float() - want[n].float()).abs().max()) for n in want}


def rel_diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-name ``||got - want|| / ||want||`` (for bf16, where absolute bounds mean little)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {
        n: float(
            (got[n].float() - want[n].float()).norm() / want[n].float().norm().clamp_min(1e-12)
        )
        for n in want
    }


def run_case(
    family: str,
    comm: str,
    api: str,
    *,
    checkpointing: bool = False,
    mixed: bool = False,
    offload: bool = False,
    autocast: bool = False,
    steps: int = STEPS,
) -> dict[str, Any]:
    """One parity case under the current ``tsm.init``; returns the differences to the reference.

    Returns:
        ``loss``/``logits``: max abs differences at the first step; ``grads``: per-parameter
        max abs differences over all steps (after clipping); ``curve``: (got, reference)
        losses per step; ``params``: per-parameter differences after ``steps`` steps;
        with ``mixed`` (bf16) or ``autocast`` (both forwards under CPU bf16 autocast, fp32
        parameters), logits, gradients (first step only) and parameters are relative
        differences;
        ``grad_scale``: the largest reference gradient (to show gradients are not trivial).
    """
    import contextlib

    import torch.sagemaker as tsm

    from torch_sagemaker.context_parallel import gather_sequence
    from torch_sagemaker.grad_norm import clip_grad_norm_

    def region():
        if autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    low_precision = mixed or autocast
    ref = tiny_model(family)
    model = tsm.transform(copy.deepcopy(ref), cp_comm_type=comm)
    model = wrap(model, api, checkpointing=checkpointing, mixed=mixed)
    if offload:
        model = tsm.offload_wrapper(model)
    if mixed:
        ref_compute = copy.deepcopy(ref).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    dp_rank, dp_size = tsm.state.dp_rank, tsm.state.dp_size
    cp_rank, cp = tsm.state.cp_rank, tsm.state.cp_size
    out: dict[str, Any] = {"curve": []}
    for step in range(steps):
        ids = sequences(dp_rank)
        local = smp_split(ids, cp_rank, cp)
        with region():
            res = model(input_ids=local, attention_mask=None, labels=local)
        res["loss"].backward()
        norm = float(clip_grad_norm_(model, MAX_NORM))
        # Reference: the mean over every data-parallel rank's sequences.
        ref_losses = []
        compute = ref
        if mixed:
            with torch.no_grad():
                for c, m in zip(ref_compute.parameters(), ref.parameters()):
                    c.copy_(m)
            compute = ref_compute
        for d in range(dp_size):
            with region():
                r = compute(input_ids=sequences(d), labels=sequences(d), use_cache=False)
            (r.loss / dp_size).backward()
            ref_losses.append(r.loss.detach())
            if d == dp_rank:
                ref_logits = r.logits.detach()
        if mixed:
            for c, m in zip(ref_compute.parameters(), ref.parameters()):
                m.grad = c.grad.float()
                c.grad = None
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        got_loss = cp_mean(res["loss"])
        diffs = rel_diffs if low_precision else max_diffs
        if step == 0 or not low_precision:  # bf16: AdamW amplifies rounding after the first step
            grads = diffs(full_grads(model), {n: p.grad for n, p in ref.named_parameters()})
            out["grads"] = {n: max(d, out.get("grads", {}).get(n, 0.0)) for n, d in grads.items()}
        if step == 0:
            out["loss"] = abs(got_loss - float(ref_losses[dp_rank]))
            logits = gather_sequence(res["logits"]).float()
            out["logits"] = float((logits - ref_logits.float()).abs().max())
            if low_precision:
                out["logits"] /= float(ref_logits.float().abs().max())
            out["norm"] = (norm, ref_norm)
            out["grad_scale"] = max(float(p.grad.abs().max()) for p in ref.parameters())
        out["curve"].append((got_loss, float(ref_losses[dp_rank])))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    out["params"] = diffs(full_params(model), {n: p.detach() for n, p in ref.named_parameters()})
    return out


def check_bf16(result: dict[str, Any], what: str = "") -> None:
    """Asserts a bf16 ``run_case`` result matches the bf16 reference to bf16 accuracy.

    The single-process bf16 reference itself differs from fp32 by about 1% (relative
    gradient norm) on these models; context parallelism must stay within 3%.
    """
    assert result["grad_scale"] > 1e-3, what
    assert result["loss"] < 1e-2, (what, result["loss"])
    assert result["logits"] < 2e-2, (what, result["logits"])
    bad = {n: d for n, d in result["grads"].items() if d > 3e-2}
    assert not bad, (what, bad)
    for got, want in result["curve"]:
        assert abs(got - want) < 5e-2, (what, result["curve"])
    assert result["curve"][-1][0] < result["curve"][0][0], (what, result["curve"])


def check(
    result: dict[str, Any], tol: float = 2e-5, param_tol: float = 1e-3, what: str = ""
) -> None:
    """Asserts a ``run_case`` result is within ``tol`` of the reference (fp32 by default).

    Parameters get a looser bound: AdamW divides by ``sqrt(v) + 1e-8``, so gradient entries
    near 1e-8 turn fp32 rounding differences into visible update differences (gradients
    themselves are checked at every step against ``tol``).
    """
    assert result["grad_scale"] > 1e-3, what
    assert result["loss"] < tol, (what, result["loss"])
    assert result["logits"] < tol * 10, (what, result["logits"])
    got, want = result["norm"]
    assert abs(got - want) < tol * max(1.0, want), (what, result["norm"])
    bad = {n: d for n, d in result["grads"].items() if d > tol}
    assert not bad, (what, bad)
    for got, want in result["curve"]:
        assert abs(got - want) < tol * 10, (what, result["curve"])
    assert result["curve"][-1][0] < result["curve"][0][0], (what, result["curve"])
    bad = {n: d for n, d in result["params"].items() if d > param_tol}
    assert not bad, (what, bad)


def delayed_build(cp: int, seed: int = 4321):
    """``tsm.init`` (hybrid_shard_degree 2), a meta Llama, transform, FSDP2, delayed init, AdamW."""
    import torch.sagemaker as tsm
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_delayed_param import fresh_layout
    from tests.distributed.test_tp_parity import tiny_config
    from torch_sagemaker.delayed_param import DelayedParamIniter
    from torch_sagemaker.sharding import shard_model

    fresh_layout({"context_parallel_degree": cp, "hybrid_shard_degree": 2})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model = tsm.transform(model)
    initer = DelayedParamIniter(model, seed=seed, device="cpu")
    shard_model(model)
    initer.init_model()
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_step(model, optim, step: int) -> float:
    """One step on the global batch of ``step`` (rows over data-parallel ranks, sequences
    split over context parallel ranks); returns the global mean loss."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from tests.distributed.hf_models import rank_slice
    from torch_sagemaker.context_parallel import split_sequence
    from torch_sagemaker.grad_norm import clip_grad_norm_

    g = torch.Generator().manual_seed(31 + step)
    rows = torch.randint(0, 128, (2 * BATCH, SEQ), generator=g)
    ids = split_sequence(rank_slice(rows, tsm.state.dp_rank, tsm.state.dp_size))
    loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
    loss.backward()
    clip_grad_norm_(model, MAX_NORM)
    optim.step()
    optim.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)  # mean over cp ranks is each sequence's loss; rows have equal weight
    return float(total) / dist.get_world_size()
