"""Note [Token shuffle under recomputation]: the permutation follows the global CPU generator,
which activation checkpointing restores before each recompute."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torch_sagemaker.moe.token_shuffle import permutation


def _dealt(x):
    """Rows of ``x`` in a shuffled order, weighted by position: the gradient of ``x`` tells
    which permutation the backward used."""
    perm = permutation(x.shape[0], seed=12345)
    weights = torch.arange(1.0, x.shape[0] + 1).unsqueeze(1)
    return (x[perm] * weights).sum()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_of_each_forward_deals_its_own_permutation(use_reentrant):
    # Two forwards of different sizes, then one backward, as micro-batches summed in one loss.
    inputs = [torch.randn(6, 3), torch.randn(9, 3)]

    def grads(checkpointed):
        xs = [x.clone().requires_grad_() for x in inputs]
        torch.manual_seed(0)
        if checkpointed:
            loss = sum(checkpoint(_dealt, x, use_reentrant=use_reentrant) for x in xs)
        else:
            loss = sum(_dealt(x) for x in xs)
        loss.backward()
        return [x.grad for x in xs]

    for plain, recomputed in zip(grads(False), grads(True), strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_permutation_is_a_function_of_the_global_generator_and_the_seed():
    state = torch.get_rng_state()
    first = permutation(64, seed=7)
    assert sorted(first.tolist()) == list(range(64))
    assert not torch.equal(permutation(64, seed=7), first)  # each draw advances the generator
    torch.set_rng_state(state)
    assert torch.equal(permutation(64, seed=7), first)  # same state, same seed: same deal
    torch.set_rng_state(state)
    assert not torch.equal(permutation(64, seed=8), first)  # another EP rank deals differently
