"""Randomness under tensor parallelism on 4 ranks (tp=2 x 2 data-parallel groups).

Inside TP regions (attention) draws differ per TP rank and repeat across data-parallel
groups and runs; outside them (residual dropout on sequence shards) a TP model drops
exactly what the untransformed model drops; activation checkpointing replays TP-region
draws when given the tracker's context function, and raises without it.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import ATOL, batch, build, full, gradient_diffs


def _draws_inside_attention(model, ids) -> list[float]:
    """torch.rand(3) drawn inside the first attention module during a forward."""
    import torch

    seen: list[float] = []
    attention = model.gpt_neox.layers[0].attention
    handle = attention.query_key_value.register_forward_pre_hook(
        lambda *_: seen.extend(torch.rand(3).tolist())
    )
    model(input_ids=ids, use_cache=False)
    handle.remove()
    return seen


def _reseed(tracker) -> None:
    """Puts the tracker back to its state right after ``tsm.init`` (seed 77 + tp_rank)."""
    import torch.sagemaker as tsm

    tracker.reset()
    tracker.add("model-parallel-rng", 77 + tsm.state.tp_rank)


def _train_grads(model, ids, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model.zero_grad()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def _checkpointed(model, context_fn):
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from torch_sagemaker.policies import transformer_layer_classes

    (layer_cls,) = transformer_layer_classes(model)
    kwargs = {"context_fn": context_fn} if context_fn else {}
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, layer_cls),
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs
        ),
    )
    return model


def _random_cases() -> dict:
    import torch
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "random_seed": 77})
    tracker = tsm.state.get_rng_state_tracker()
    out: dict = {"tp_rank": tsm.state.tp_rank}
    # Tracker: forked draws per TP rank; the default stream does not notice the fork.
    torch.manual_seed(5)
    with tracker.fork():
        out["forked"] = torch.rand(4).tolist()
    out["after_fork"] = torch.rand(2).tolist()
    torch.manual_seed(5)
    out["plain"] = torch.rand(2).tolist()
    # Outside TP regions: residual dropout on sequence shards equals the reference's.
    ids = batch(0)
    ref = build("gpt_neox", hidden_dropout=0.2).train()
    model = tsm.transform(copy.deepcopy(ref)).train()
    torch.manual_seed(11)
    got = model(input_ids=ids, use_cache=False).logits
    torch.manual_seed(11)
    want = ref(input_ids=ids, use_cache=False).logits
    torch.manual_seed(11)
    no_dropout = ref.eval()(input_ids=ids, use_cache=False).logits
    out["outside"] = (float((full(got) - want).abs().max()), float((want - no_dropout).abs().max()))
    # Inside TP regions: draws differ per TP rank, repeat with the same seeds.
    att = tsm.transform(build("gpt_neox", attention_dropout=0.3)).train()
    _reseed(tracker)
    torch.manual_seed(3)
    first = _draws_inside_attention(att, ids)
    _reseed(tracker)
    torch.manual_seed(3)
    again = _draws_inside_attention(att, ids)
    torch.manual_seed(3)
    out["inside"] = (first, first == again, torch.rand(1).item())
    # Activation checkpointing replays TP-region dropout only with the tracker's context_fn.
    base = build("gpt_neox", attention_dropout=0.3)
    plain = tsm.transform(copy.deepcopy(base)).train()
    replay = _checkpointed(
        tsm.transform(copy.deepcopy(base)).train(), tracker.checkpoint_context_fn
    )
    naive = _checkpointed(tsm.transform(copy.deepcopy(base)).train(), None)
    diffs = {}
    for name, m in (("plain", plain), ("replay", replay)):
        _reseed(tracker)
        _train_grads(m, ids, seed=21)
        diffs[name] = m
    out["ac_replay"] = max(gradient_diffs(diffs["replay"], diffs["plain"]).values())
    _reseed(tracker)
    try:  # the recompute would draw anew: Note [Unreplayed TP-region draws]
        _train_grads(naive, ids, seed=21)
        out["ac_naive"] = max(gradient_diffs(naive, diffs["plain"]).values())
    except RuntimeError as error:
        out["ac_naive"] = str(error)
    return out


@pytest.fixture(scope="module")
def random_results():
    return run_distributed(_random_cases, world_size=4, timeout=300)


@pytest.mark.distributed
def test_tracker_streams_per_tp_rank(random_results):
    r0, r1, r2, r3 = random_results
    assert [r["tp_rank"] for r in random_results] == [0, 1, 0, 1]
    assert r0["forked"] != r1["forked"]  # different heads get different draws
    assert r0["forked"] == r2["forked"] and r1["forked"] == r3["forked"]  # seeded 77 + tp_rank
    for r in random_results:
        assert r["after_fork"] == r["plain"]  # the fork left the shared stream alone


@pytest.mark.distributed
def test_dropout_outside_tp_regions_matches_reference(random_results):
    for r in random_results:
        tp_vs_ref, dropout_effect = r["outside"]
        assert dropout_effect > 1e-2  # dropout really was active
        assert tp_vs_ref < ATOL


@pytest.mark.distributed
def test_dropout_inside_tp_regions_differs_per_rank_deterministically(random_results):
    r0, r1, r2, r3 = (r["inside"] for r in random_results)
    assert r0[0] != r1[0] and r0[0] == r2[0] and r1[0] == r3[0]
    assert all(r[1] for r in (r0, r1, r2, r3))  # reproducible
    assert r0[2] == r1[2]  # the shared stream is the same on every TP rank afterwards


@pytest.mark.distributed
def test_activation_checkpointing_replays_tp_region_dropout(random_results):
    for r in random_results:
        assert r["ac_replay"] < ATOL
        # Without the context function the recompute would draw anew: it raises instead of
        # returning wrong gradients.
        assert "without replaying the stream" in str(r["ac_naive"]), r["ac_naive"]
