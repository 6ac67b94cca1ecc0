"""Note [Token shuffle under recomputation]: a draw made inside backward reuses the last one."""

import torch

from torch_sagemaker.moe.token_shuffle import TokenShuffle


def _shuffle():
    shuffle = object.__new__(TokenShuffle)  # no process group needed for the permutation logic
    shuffle.generator = torch.Generator().manual_seed(0)
    shuffle._last_perm = None
    return shuffle


class _DrawInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shuffle, seen):
        ctx.shuffle, ctx.seen = shuffle, seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(ctx.shuffle._permutation(10))
        return grad, None, None


def test_recomputation_reuses_the_forward_permutation():
    shuffle = _shuffle()
    first = shuffle._permutation(10)
    seen = []
    x = torch.ones(3, requires_grad=True)
    _DrawInBackward.apply(x, shuffle, seen).sum().backward()
    assert torch.equal(seen[0], first)  # same tokens as the forward pass
    second = shuffle._permutation(10)  # a new forward draws anew
    assert not torch.equal(second, first) and sorted(second.tolist()) == list(range(10))
