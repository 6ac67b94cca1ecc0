"""FSDP1 (SMP's scripts' wrapper) around models with locally computed replicated modules.

Qwen3 has no policy: ``tsm.transform`` shards it by its own plan, whose norms are
``ReplicatedLocal`` modules; Mixtral's policy computes its router locally
(``ReplicateParallel``). Under FSDP1 with ``use_orig_params=True`` both first forwards used to
fail ("mixed torch.Tensor and DTensor", Note [Replicated parameters under FSDP1]). GPT-2's
shipped plan splits its packed ``c_attn`` block by block (``_StridedShard``) under FSDP1's
flat parameters; Falcon-7B's computes its query rows of a replicated fused projection
(Note [Fused projections computed by rows]); DBRX's, its grouped-query [q | k | v], and its
experts run on this rank's choices only (Note [Experts that run every index]); Llama 4's
experts, each rank's experts on their block of rows (``experts_batched``), used to fail their
first forward as Qwen3's norms did. Marian's frozen sinusoidal positions were trained under
FSDP1 x TP, and RoFormer's refused by the replicated-module check (Note [Frozen DTensor
parameters under FSDP1]). Activation
checkpointing is applied after FSDP1, as SMP's scripts apply it: in the forward it
recomputes during backward, FSDP1 registers none of a unit's parameters, and the modules
that computed with parameters they named at each call (Qwen3-Next's convolution, Granite
SWA's sinks, Llama 4's and DBRX's experts) got DTensor weights (Note [Replicated parameters
under FSDP1]). Here tp 2 x hybrid_shard_degree 2, HYBRID_SHARD, trains 3 SGD steps against
one process on the global batch (4 ranks): losses and every parameter.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import ATOL, batch, build

STEPS = 3


def _reference(family: str) -> tuple[list[float], dict]:
    ref = build(family)
    optim = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        optim.zero_grad()
        step = []
        for dp_rank in range(2):  # the global batch: both data-parallel ranks' batches
            ids = batch(dp_rank)
            loss = ref(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
            step.append(loss.item())
        optim.step()
        losses.append(sum(step) / 2)
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _fsdp1_on_plan(family: str) -> tuple[list[float], dict]:
    """One family under FSDP1 HYBRID_SHARD, in the ``tsm.init`` in place; (losses, params)."""
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    model = FSDP(
        tsm.transform(copy.deepcopy(build(family))),
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}
        ),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, TransformerLayer),
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )
    assert any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ids = batch(tsm.state.dp_rank)
    losses = []
    for _ in range(STEPS):
        optim.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # (checkpointing)
        loss.backward()
        optim.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    with FSDP.summon_full_params(model):
        params = {
            n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): (
                p.full_tensor() if hasattr(p, "full_tensor") else p
            )
            .detach()
            .clone()
            for n, p in model.named_parameters()
        }
    return losses, params


FAMILIES = (
    *("qwen3", "mixtral", "gpt2", "falcon", "dbrx", "llama4_text"),
    *("qwen3_next", "granite_swa", "marian", "roformer"),
)


def _fsdp1_on_plan_each(families: tuple[str, ...]) -> dict:
    """``_fsdp1_on_plan`` for each family in turn, under one ``tsm.init`` (as a job that
    builds models one after another).

    A family that raises ends the call at once, naming the family: its ranks may have
    stopped at different collectives, so the families after it could not run in step.
    """
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
    out: dict = {}
    for family in families:
        try:
            out[family] = _fsdp1_on_plan(family)
        except Exception as e:
            raise RuntimeError(f"FSDP1 over the TP plan of {family!r} failed") from e
    return out


@pytest.fixture(scope="module")
def fsdp1_runs() -> list[dict]:
    return run_distributed(_fsdp1_on_plan_each, FAMILIES, world_size=4, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp1_trains_a_tensor_parallel_model_like_one_process(family, fsdp1_runs):
    ref_losses, ref_params = _reference(family)
    for rank, per_family in enumerate(fsdp1_runs):
        losses, params = per_family[family]
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=ATOL, msg=f"rank {rank}")
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=name)


def _reference_accumulating(family: str) -> dict:
    ref = build(family)
    optim = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(STEPS):
        optim.zero_grad()
        for micro in range(2):
            for dp_rank in range(2):
                ids = batch(2 * dp_rank + micro)
                (ref(input_ids=ids, labels=ids).loss / 4).backward()
        optim.step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _fsdp1_accumulating(family: str, strategy: str) -> dict:
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.distributed.tensor import DTensor
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
    model = FSDP(
        tsm.transform(copy.deepcopy(build(family))),
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}
        ),
        sharding_strategy=ShardingStrategy[strategy],
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(STEPS):
        optim.zero_grad()
        ids = batch(2 * tsm.state.dp_rank)
        with model.no_sync():  # the first micro-batch accumulates locally
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        # What a user's gradient clipping or logging reads between micro-batches.
        for name, param in model.named_parameters():
            grad = param.grad
            assert grad is not None and not isinstance(grad, DTensor), name
            assert bool(torch.isfinite(grad).all()), name
        ids = batch(2 * tsm.state.dp_rank + 1)
        (model(input_ids=ids, labels=ids).loss / 2).backward()
        optim.step()
    with FSDP.summon_full_params(model):
        return {
            n.replace("_fsdp_wrapped_module.", ""): (
                p.full_tensor() if hasattr(p, "full_tensor") else p
            )
            .detach()
            .clone()
            for n, p in model.named_parameters()
        }


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "FULL_SHARD"])
def test_fsdp1_tensor_parallel_accumulates_gradients_under_no_sync(strategy):
    """Gradient accumulation with ``no_sync`` under a sharded strategy, as FSDP1 users write it.

    After a backward inside ``no_sync`` FSDP1 exposes each parameter's unsharded gradient; for
    a TP parameter PyTorch put the DTensor view there with ``.data``, and reading the gradient
    crashed the process (SIGSEGV). Here the gradients are read between micro-batches, and the
    parameters after 3 steps of 2 micro-batches match one process on the global batch.
    """
    ref_params = _reference_accumulating("llama")
    for rank, params in enumerate(
        run_distributed(_fsdp1_accumulating, "llama", strategy, world_size=4, timeout=300)
    ):
        assert params.keys() == ref_params.keys(), f"rank {rank}"
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=name)
