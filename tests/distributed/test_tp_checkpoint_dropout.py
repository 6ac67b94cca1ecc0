"""Attention dropout inside tensor-parallel regions under activation checkpointing (2 ranks).

Each TP rank draws its heads' dropout masks from its own stream (tensor_parallel/random.py).
A recompute must draw the forward's masks again: ``checkpoint_transformer_layers`` (non
reentrant, with the tracker's ``context_fn``) gives exactly the gradients of the run without
checkpointing; reentrant checkpointing cannot replay the stream and raises instead of
returning wrong gradients (Note [Unreplayed TP-region draws]). A second backward through a
retained graph recomputes and replays again. With dropout 0 reentrant checkpointing runs as
before.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.distributed.hf_models import tiny_llama
from tests.distributed.launcher import run_distributed


def _gradients(model, tracker, states, ids):
    tracker.set_states(states)
    torch.manual_seed(5)
    model(input_ids=ids, labels=ids).loss.backward()
    return {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
        if hasattr(p.grad, "full_tensor")
        else p.grad
        for n, p in model.named_parameters()
    }


def _checkpointed_dropout() -> dict:
    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    from torch_sagemaker.sharding.activation_checkpointing import checkpoint_transformer_layers

    tsm.init({"tensor_parallel_degree": 2})
    tracker = tsm.state.get_rng_state_tracker()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    out = {}
    for dropout in (0.3, 0.0):
        plain = tsm.transform(tiny_llama(attention_dropout=dropout, use_cache=False)).train()
        ours, reentrant = copy.deepcopy(plain), copy.deepcopy(plain)
        checkpoint_transformer_layers(ours)
        apply_activation_checkpointing(
            reentrant,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT
            ),
            check_fn=lambda m: isinstance(m, TransformerLayer),
        )
        states = tracker.get_states()
        want = _gradients(plain, tracker, states, ids)
        got = _gradients(ours, tracker, states, ids)
        out[("ours", dropout)] = max((want[n] - g).abs().max().item() for n, g in got.items())
        # Recomputed twice (a retained graph's second backward): the replay context is
        # entered once per recompute, and both replay the forward's masks. (The loss refuses
        # a second backward itself; a plain function of the logits does not.)
        grads = []
        for passes in (1, 2):
            ours.zero_grad()
            tracker.set_states(states)
            torch.manual_seed(5)
            objective = ours(input_ids=ids).logits.to_local().square().mean()
            for i in range(passes):
                objective.backward(retain_graph=i + 1 < passes)
            grads.append({n: p.grad.to_local().clone() for n, p in ours.named_parameters()})
        once, twice = grads
        out[("twice", dropout)] = max(
            (2 * once[n] - g).abs().max().item() for n, g in twice.items()
        )
        try:
            got = _gradients(reentrant, tracker, states, ids)
            out[("reentrant", dropout)] = max(
                (want[n] - g).abs().max().item() for n, g in got.items()
            )
        except RuntimeError as error:
            out[("reentrant", dropout)] = str(error)
    return out


@pytest.mark.distributed
def test_checkpointed_tp_dropout_replays_or_raises():
    for rank, out in enumerate(run_distributed(_checkpointed_dropout, world_size=2)):
        assert out[("ours", 0.3)] == 0.0, (rank, out)
        assert "without replaying the stream" in str(out[("reentrant", 0.3)]), (rank, out)
        assert out[("ours", 0.0)] == 0.0 and out[("reentrant", 0.0)] == 0.0, (rank, out)
        assert out[("twice", 0.3)] < 1e-6 and out[("twice", 0.0)] < 1e-6, (rank, out)
