"""Load-balancing formulas of ``torch_sagemaker.moe.routing`` against direct computations."""

import dataclasses
import itertools
import math

import pytest
import torch

from torch_sagemaker.moe import routing
from torch_sagemaker.moe.moe_config import MoEConfig


def _logits(n, e, seed=0, scale=2.0):
    return torch.randn(n, e, generator=torch.Generator().manual_seed(seed)) * scale


def test_switch_aux_loss_matches_a_loop():
    logits = _logits(12, 4)
    probs = torch.softmax(logits, -1)
    idx = torch.topk(probs, 2, -1).indices
    expected = 0.0
    for e in range(4):
        f = sum(1 for n in range(12) for j in range(2) if idx[n, j] == e) / 24
        p = sum(float(probs[n, e]) for n in range(12)) / 12
        expected += f * p
    assert math.isclose(float(routing.switch_aux_loss(probs, idx, 4)), 4 * expected, rel_tol=1e-6)
    uniform = torch.full((8, 4), 0.25)
    spread = torch.tensor([[0, 1], [2, 3]] * 4)
    assert math.isclose(float(routing.switch_aux_loss(uniform, spread, 4)), 1.0, rel_tol=1e-6)


def test_switch_aux_loss_gradient_flows_through_probabilities_only():
    logits = _logits(6, 3).requires_grad_()
    probs = torch.softmax(logits, -1)
    idx = torch.topk(probs, 1, -1).indices
    routing.switch_aux_loss(probs, idx, 3).backward()
    # The assignment fractions are constants: the same loss with them frozen has the same gradient.
    fractions = torch.bincount(idx.flatten(), minlength=3).float() / 6
    ref_logits = logits.detach().clone().requires_grad_()
    (3 * (fractions * torch.softmax(ref_logits, -1).mean(0)).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_z_loss_matches_a_loop():
    logits = _logits(5, 4, scale=5.0)
    expected = sum(math.log(sum(math.exp(float(v)) for v in row)) ** 2 for row in logits) / 5
    assert math.isclose(float(routing.z_loss(logits)), expected, rel_tol=1e-6)


def _naive_sinkhorn(logits, iters=2000):
    """Plain Sinkhorn-Knopp on exp(logits) in float64 (rows to 1, columns to N/E)."""
    k = logits.double().exp()
    n, e = k.shape
    r, c = torch.ones(n, dtype=torch.float64), torch.ones(e, dtype=torch.float64)
    for _ in range(iters):
        r = 1.0 / (k @ c)
        c = (n / e) / (k.T @ r)
    return r[:, None] * k * c[None, :]


def test_sinkhorn_matches_the_plain_iteration_and_balances():
    logits = _logits(16, 4, scale=3.0)
    log_p = routing.sinkhorn(logits, tol=1e-9, max_iters=5000)
    p = log_p.double().exp()
    torch.testing.assert_close(p, _naive_sinkhorn(logits), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.sum(1), torch.ones(16, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        p.sum(0), torch.full((4,), 4.0, dtype=torch.float64), rtol=0, atol=1e-4
    )
    # Large logits do not overflow in the log domain.
    assert torch.isfinite(routing.sinkhorn(logits * 1000)).all()


def test_sinkhorn_routing_balances_skewed_logits():
    logits = _logits(64, 4) + torch.tensor([4.0, 0.0, 0.0, 0.0])  # expert 0 preferred
    plain = torch.bincount(torch.topk(logits, 1).indices.flatten(), minlength=4)
    balanced = routing.route(logits, 1, normalize=False, method="sinkhorn", training=True)
    counts = torch.bincount(balanced.indices.flatten(), minlength=4)
    assert plain.max() > 40 and counts.max() - counts.min() <= plain.max() - plain.min() - 20
    expected = torch.topk(_naive_sinkhorn(logits), 1).indices
    assert torch.equal(balanced.indices, expected)
    # Weights are the model's probabilities at the chosen experts.
    torch.testing.assert_close(balanced.weights, torch.softmax(logits, -1).gather(1, expected))


def _brute_force_k1(scores, cap):
    n, e = scores.shape
    best, best_val = None, -math.inf
    for choice in itertools.product(range(e), repeat=n):
        if any(choice.count(x) != int(cap[x]) for x in range(e)):
            continue
        val = sum(float(scores[i, c]) for i, c in enumerate(choice))
        if val > best_val:
            best, best_val = choice, val
    return best, best_val


@pytest.mark.parametrize("n,e,seed", [(4, 2, 0), (6, 3, 1), (8, 4, 2), (7, 3, 3), (8, 2, 4)])
def test_balanced_assignment_is_optimal_for_one_expert(n, e, seed):
    scores = _logits(n, e, seed=seed)
    chosen = routing.balanced_assignment(scores, 1, eps=1e-6)[:, 0]
    cap = routing._capacities(n, e, 0, scores.device)
    assert torch.equal(torch.bincount(chosen, minlength=e), cap)
    _, optimum = _brute_force_k1(scores, cap)
    total = float(scores.gather(1, chosen[:, None]).sum())
    assert total >= optimum - n * 1e-6 - 1e-9, (total, optimum)


def test_balanced_assignment_top_k_is_balanced_and_distinct():
    scores = _logits(30, 6, seed=5) + torch.tensor([3.0, 2.0, 0, 0, 0, 0])
    chosen = routing.balanced_assignment(scores, 2)
    assert torch.equal(torch.bincount(chosen.flatten(), minlength=6), torch.full((6,), 10))
    assert (chosen[:, 0] != chosen[:, 1]).all()
    # Uneven: 7 tokens x 2 over 3 experts -> counts differ by at most one.
    counts = torch.bincount(routing.balanced_assignment(_logits(7, 3), 2).flatten(), minlength=3)
    assert counts.sum() == 14 and counts.max() - counts.min() <= 1


def test_balanced_assignment_terminates_with_a_tiny_round_budget():
    scores = _logits(40, 4, seed=7)
    chosen = routing.balanced_assignment(scores, 2, max_rounds=1)  # fallback path
    assert torch.equal(torch.bincount(chosen.flatten(), minlength=4), torch.full((4,), 20))
    assert (chosen[:, 0] != chosen[:, 1]).all()


def test_route_none_is_the_models_top_k_and_eval_ignores_balancing():
    logits = _logits(10, 4)
    probs = torch.softmax(logits, -1)
    top_v, top_i = torch.topk(probs, 2, -1)
    for method in ("none", "aux_loss", "sinkhorn", "balanced"):
        r = routing.route(
            logits, 2, normalize=True, method=method, training=method in ("none", "aux_loss")
        )
        assert torch.equal(r.indices, top_i)
        torch.testing.assert_close(r.weights, top_v / top_v.sum(-1, keepdim=True))
    r = routing.route(logits, 2, normalize=False, method="none", training=True)
    torch.testing.assert_close(r.weights, top_v)


def test_moe_config_defaults_and_errors():
    cfg = MoEConfig()
    assert (
        cfg.smp_moe,
        cfg.random_seed,
        cfg.moe_load_balancing,
        cfg.global_token_shuffle,
        cfg.moe_all_to_all_dispatcher,
        cfg.moe_aux_loss_coeff,
        cfg.moe_z_loss_coeff,
    ) == (True, 12345, "sinkhorn", False, True, 0.001, 0.001)
    with pytest.raises(ValueError, match=r"moe_load_balancing='switch'.*'sinkhorn'"):
        MoEConfig(moe_load_balancing="switch")
    with pytest.raises(ValueError, match=r"moe_aux_loss_coeff=-1.*>= 0"):
        MoEConfig(moe_aux_loss_coeff=-1)
    with pytest.raises(ValueError, match=r"smp_moe=1: must be True or False"):
        MoEConfig(smp_moe=1)
    with pytest.raises(ValueError, match=r"random_seed='x'"):
        MoEConfig(random_seed="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.smp_moe = False


def test_aux_losses_keep_the_last_training_forwards_values():
    """An eval forward (a validation pass between steps) used to empty ``aux_losses``."""
    from tests.distributed.moe_models import batch, moe_reference, tiny_moe
    from torch_sagemaker.moe import aux_losses

    cfg = MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = moe_reference(tiny_moe("mixtral"), cfg).train()
    ids = batch(0)
    model(input_ids=ids, labels=ids)
    trained = aux_losses(model)
    assert len(trained) == 2 and all(float(v) > 0 for v in trained.values()), trained
    model.eval()
    with torch.no_grad():
        model(input_ids=batch(1))
    assert aux_losses(model) == trained
