"""Note [Experts without a token on this rank] (``moe/unused_experts.py``): the tie
and which of transformers' expert implementations need it. The multi-rank runs are
tests/distributed/test_tp_experts_without_tokens.py (tensor parallelism) and the ``idle``
cases of tests/distributed/test_expert_parallel.py (expert parallelism)."""

from __future__ import annotations

import pytest
import torch

from torch_sagemaker.moe.unused_experts import may_leave_weights_unused, tie_to


def test_the_tie_passes_the_output_through_and_gives_exact_zero_gradients():
    module = torch.nn.Linear(4, 3).half()
    with torch.no_grad():
        module.weight[0, 0] = float("inf")  # a tied value is never computed with
    hidden = torch.randn(5, 4, dtype=torch.float16, requires_grad=True)
    out = torch.zeros(5, 4, dtype=torch.float16)  # nothing computed on this rank
    tied = tie_to(out, module, module, hidden)
    assert torch.equal(tied, out)
    # An fp16 gradient whose sum overflows (a ``x * 0`` added to the output turned it into NaN).
    tied.backward(torch.full((5, 4), 30000.0, dtype=torch.float16))
    for t in (module.weight, module.bias, hidden):
        assert t.grad is not None and t.grad.dtype == t.dtype and not t.grad.any(), t.grad


def _mixtral_experts(implementation: str):
    import transformers as tf

    config = tf.MixtralConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2
    )
    config._experts_implementation = implementation
    experts = tf.models.mixtral.modeling_mixtral.MixtralExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    experts._is_expert_parallel = True  # the sentinel may appear (as under ExpertsParallel)
    return experts


def test_an_empty_input_is_tied_whole():
    """Expert parallelism's all-to-all may bring a rank no row: the empty rows still get a
    gradient, so the all-to-all that made them runs its backward."""
    module = torch.nn.Linear(4, 3)
    rows = torch.empty(0, 4, requires_grad=True)
    tie_to(torch.zeros(0, 4), module, module, rows).sum().backward()
    assert rows.grad is not None and rows.grad.shape == (0, 4)
    assert module.weight.grad is not None and not module.weight.grad.any()


@pytest.mark.parametrize("rows", [6, 0])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_which_implementations_reach_their_weights_when_no_choice_is_local(implementation, rows):
    """Every choice another rank's expert (the sentinel, as tensor parallelism and EP's
    all-gather pass them), or no row at all (EP's all-to-all)."""
    experts = _mixtral_experts(implementation)
    hidden = torch.randn(rows, 16, requires_grad=True)
    weights = torch.rand(rows, 2, requires_grad=True)
    sentinel = torch.full((rows, 2), 4)
    out = experts(hidden, sentinel, weights)
    assert not out.any()
    if out.requires_grad:
        out.sum().backward()
    reached = all(t.grad is not None for t in (*experts.parameters(), hidden, weights))
    # The implementations left untied are exactly those that reach everything anyway.
    assert reached != may_leave_weights_unused(experts), (implementation, reached)
    assert implementation != "eager" or not reached


def test_an_experts_class_transformers_does_not_dispatch_is_tied():
    assert may_leave_weights_unused(torch.nn.Linear(2, 2))
