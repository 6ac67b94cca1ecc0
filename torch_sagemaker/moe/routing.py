"""Routing and load balancing for ``MoELayer``: pure tensor functions, no communication.

Every option picks ``k`` distinct experts per token and gating weights for them:

| ``moe_load_balancing`` | experts chosen while training              | extra loss          |
|------------------------|--------------------------------------------|---------------------|
| ``"none"``             | top-k of the router softmax (the model's)  | --                  |
| ``"aux_loss"``         | top-k of the router softmax                | Switch / GShard aux |
| ``"sinkhorn"``         | top-k of the Sinkhorn-balanced scores      | --                  |
| ``"balanced"``         | balanced assignment (equal tokens/expert)  | --                  |

In evaluation mode every option routes like ``"none"``. The gating weights are always the
model's softmax probabilities at the chosen experts (renormalized over the ``k`` chosen ones
when the model does so), so the balancing methods only change *which* experts a token
visits. The router z-loss (ST-MoE) is added whenever its coefficient is positive.

Formulas (N tokens, E experts, logits ``x``, probabilities ``p = softmax(x)``):

- Switch Transformer auxiliary loss (Fedus et al. 2021, eq. 4; GShard's for top-k):
  ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``N * k`` assignments that went to
  expert ``e`` and ``P_e = mean_n p[n, e]``. It is 1 for perfectly uniform routing; its
  gradient flows through ``P`` only.
- Router z-loss (Zoph et al. 2022, eq. 5): ``mean_n logsumexp_e(x[n])^2``.
- Sinkhorn (Cuturi 2013; the routing of Clark et al. 2022): scale ``exp(x)`` by row and
  column factors until every token carries mass 1 and every expert ``N / E``; computed in
  the log domain.
- Balanced assignment (Lewis et al. 2021, BASE layers): choose assignments maximizing the
  total logit subject to every expert receiving ``N * k / E`` tokens (``floor``/``ceil``
  when not divisible), solved per round of one expert per token with Bertsekas' auction
  algorithm (epsilon-optimal; see ``balanced_assignment``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SINKHORN_TOL = 1e-4
SINKHORN_MAX_ITERS = 100


class Routing(NamedTuple):
    """The routing of N tokens.

    Attributes:
        weights: (N, k) gating weights (fp32).
        indices: (N, k) chosen experts (int64), distinct per row.
        probs: (N, E) router softmax (fp32), with gradient.
    """

    weights: torch.Tensor
    indices: torch.Tensor
    probs: torch.Tensor


def switch_aux_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer load-balancing loss ``E * sum_e f_e * P_e`` (see module doc).

    Args:
        probs: (N, E) router probabilities.
        indices: (N, k) chosen experts.
        num_experts: E.

    Returns:
        A 0-d fp32 tensor (0 for N == 0).
    """
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / indices.numel()
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss ``mean_n logsumexp(logits[n])^2`` (0 for no tokens)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def sinkhorn(
    logits: torch.Tensor, tol: float = SINKHORN_TOL, max_iters: int = SINKHORN_MAX_ITERS
) -> torch.Tensor:
    """Log of the Sinkhorn-balanced matrix of ``exp(logits)``: rows sum to 1, columns to N/E.

    Alternates row and column normalizations in the log domain (no overflow for large
    logits) until the largest row-sum error is below ``tol`` or ``max_iters`` passes ran
    (so it always terminates). No gradient.

    Args:
        logits: (N, E) router logits.
        tol: Stop once the largest row-sum error is below this.
        max_iters: Stop after this many row-and-column passes at the latest.

    Returns:
        (N, E) fp32 log-scores ``x + u[:, None] + v[None, :]``; their row-wise order is the
        balanced preference.
    """
    with torch.no_grad():
        x = logits.float()
        n, e = x.shape
        if n == 0:
            return x.clone()
        u = torch.zeros(n, dtype=x.dtype, device=x.device)
        v = torch.zeros(e, dtype=x.dtype, device=x.device)
        log_col = torch.log(torch.tensor(n / e, dtype=x.dtype))
        for _ in range(max_iters):
            u = -torch.logsumexp(x + v, dim=1)
            v = log_col - torch.logsumexp(x + u[:, None], dim=0)
            row_error = (torch.logsumexp(x + u[:, None] + v, dim=1).exp() - 1).abs().max()
            if row_error < tol:
                break
        return x + u[:, None] + v


def _capacities(n: int, e: int, round_index: int, device: torch.device) -> torch.Tensor:
    """Per-expert token counts for one round: ``n`` split as evenly as possible.

    The extra tokens go to different experts in successive rounds (so totals differ by at most
    one).
    """
    base, extra = divmod(n, e)
    cap = torch.full((e,), base, dtype=torch.long, device=device)
    if extra:
        start = (round_index * extra) % e
        cap[(torch.arange(extra, device=device) + start) % e] += 1
    return cap


def _auction_round(
    scores: torch.Tensor, cap: torch.Tensor, eps: float, max_rounds: int
) -> torch.Tensor:
    """One expert per token, expert ``e`` taking exactly ``cap[e]`` tokens, maximizing the sum.

    Bertsekas' auction for similar objects (Jacobi form): every unassigned token bids for its
    best expert at the price of that expert plus the margin over its second choice plus
    ``eps``; an expert keeps its ``cap`` highest bids and its price becomes the lowest kept
    bid once full. Forbidden pairs carry ``-inf``. After ``max_rounds`` bidding rounds the
    remaining tokens go to their best allowed expert with room (so it always terminates;
    the result is then balanced but may be less than epsilon-optimal).

    Returns:
        (N,) expert of each token.
    """
    n, e = scores.shape
    device = scores.device
    assigned = torch.full((n,), -1, dtype=torch.long, device=device)
    held_bid = torch.full((n,), float("-inf"), dtype=scores.dtype, device=device)
    price = torch.zeros(e, dtype=scores.dtype, device=device)
    for _ in range(max_rounds):
        free = (assigned < 0).nonzero().flatten()
        if free.numel() == 0:
            return assigned
        value = scores[free] - price
        if e > 1:
            top = value.topk(2, dim=1)
            best, first, second = top.indices[:, 0], top.values[:, 0], top.values[:, 1]
            second = torch.where(torch.isfinite(second), second, first - 1.0)
        else:
            best, first = torch.zeros_like(free), value[:, 0]
            second = first - 1.0
        bid = price[best] + (first - second) + eps
        # Candidates: current holders and the new bidders; each expert keeps its cap best.
        holders = (assigned >= 0).nonzero().flatten()
        tokens = torch.cat([holders, free])
        experts = torch.cat([assigned[holders], best])
        bids = torch.cat([held_bid[holders], bid])
        order = torch.argsort(bids, descending=True, stable=True)
        order = order[torch.argsort(experts[order], stable=True)]  # by expert, then bid desc
        tokens, experts, bids = tokens[order], experts[order], bids[order]
        counts = torch.bincount(experts, minlength=e)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(tokens.numel(), device=device) - starts[experts]
        keep = rank_in_expert < cap[experts]
        assigned.fill_(-1)
        held_bid.fill_(float("-inf"))
        assigned[tokens[keep]] = experts[keep]
        held_bid[tokens[keep]] = bids[keep]
        kept = torch.bincount(experts[keep], minlength=e)
        lowest = torch.full((e,), float("inf"), dtype=scores.dtype, device=device)
        lowest = lowest.scatter_reduce(0, experts[keep], bids[keep], reduce="amin")
        price = torch.where(kept >= cap, lowest, price)
    return _fill_remaining(scores, cap, assigned)


def _fill_remaining(
    scores: torch.Tensor, cap: torch.Tensor, assigned: torch.Tensor
) -> torch.Tensor:
    """Gives every unassigned token an allowed expert with room, moving one holder if needed.

    A token whose allowed experts are all full takes the place of a holder that can move to
    an expert with room (a one-step augmenting path); only if none exists does an expert go
    over its capacity (never observed with the capacities of ``_capacities``).
    """
    e = scores.shape[1]
    room = cap - torch.bincount(assigned[assigned >= 0], minlength=e)
    allowed = torch.isfinite(scores)
    for token in (assigned < 0).nonzero().flatten().tolist():
        options = (allowed[token] & (room > 0)).nonzero().flatten()
        if options.numel():
            expert = int(options[scores[token, options].argmax()])
            assigned[token] = expert
            room[expert] -= 1
            continue
        moved = False
        for expert in allowed[token].nonzero().flatten().tolist():
            for holder in (assigned == expert).nonzero().flatten().tolist():
                targets = (allowed[holder] & (room > 0)).nonzero().flatten()
                if targets.numel():
                    target = int(targets[scores[holder, targets].argmax()])
                    assigned[holder], assigned[token] = target, expert
                    room[target] -= 1
                    moved = True
                    break
            if moved:
                break
        if not moved:
            expert = int(torch.where(allowed[token], scores[token], float("-inf")).argmax())
            assigned[token] = expert
            room[expert] -= 1
    return assigned


def balanced_assignment(
    scores: torch.Tensor, k: int, eps: float | None = None, max_rounds: int | None = None
) -> torch.Tensor:
    """``k`` distinct experts per token with every expert receiving ``N * k / E`` tokens.

    Solved in ``k`` rounds; round ``r`` gives each token one more expert (not one it has)
    with per-expert capacities that split N evenly (see ``_capacities``), maximizing the sum
    of ``scores`` by the auction algorithm. Each round is ``N * eps``-optimal.

    Args:
        scores: (N, E) affinities (router logits).
        k: Experts per token (``k <= E``).
        eps: Bid increment; default ``1e-4`` times the score range.
        max_rounds: Bidding rounds per round before the greedy fallback; default ``20 * N + 100``.

    Returns:
        (N, k) int64 expert indices.
    """
    with torch.no_grad():
        x = scores.detach().double()
        n, e = x.shape
        if n == 0:
            return torch.zeros((0, k), dtype=torch.long, device=scores.device)
        if eps is None:
            spread = float(x.max() - x.min())
            eps = 1e-4 * spread if spread > 0 else 1e-6
        max_rounds = 20 * n + 100 if max_rounds is None else max_rounds
        chosen = torch.zeros((n, k), dtype=torch.long, device=scores.device)
        for r in range(k):
            picked = _auction_round(x, _capacities(n, e, r, x.device), eps, max_rounds)
            chosen[:, r] = picked
            x = x.scatter(1, picked[:, None], float("-inf"))
        return chosen


def route(logits: torch.Tensor, k: int, *, normalize: bool, method: str, training: bool) -> Routing:
    """Chooses ``k`` experts per token and their gating weights (see the module doc).

    Args:
        logits: (N, E) router logits (fp32 recommended).
        k: Experts per token.
        normalize: Renormalize the ``k`` weights to sum to 1 (Mixtral) or keep the softmax
            values (Qwen-MoE with ``norm_topk_prob=False``).
        method: A ``moe_load_balancing`` option.
        training: Balance only while training; evaluation routes by plain top-k.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    if method in ("none", "aux_loss") or not training:
        weights, indices = torch.topk(probs, k, dim=-1)
    else:
        if method == "sinkhorn":
            indices = torch.topk(sinkhorn(logits), k, dim=-1).indices
        elif method == "balanced":
            indices = balanced_assignment(logits, k)
        else:
            raise ValueError(f"moe_load_balancing={method!r} is not a routing method.")
        weights = probs.gather(1, indices)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, indices, probs)


__all__ = ["Routing", "balanced_assignment", "route", "sinkhorn", "switch_aux_loss", "z_loss"]
