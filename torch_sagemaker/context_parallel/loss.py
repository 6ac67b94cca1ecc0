"""The causal LM loss of a context parallel rank: labels shifted across chunk boundaries.

Note [Context parallel loss]
Without context parallelism the loss of a sequence of ``S`` tokens is
``sum_{p < S-1} CE(logits_p, labels_{p+1}) / N`` with ``N`` the number of targets that are
not ``ignore_index``. Rank ``r`` holds the logits and labels of chunks ``r`` and
``2cp-1-r``. The target of the last token of chunk ``k`` is the first label of chunk
``k+1``, held by another rank (or by this rank's other chunk, for ``k = cp - 1``), and the
last token of chunk ``2cp-1`` (rank 0's end) predicts nothing. Shifting inside the local
concatenation, as Hugging Face's loss does, would pair chunk ``r``'s last token with chunk
``2cp-1-r``'s first and drop ``cp`` real targets.

So each rank contributes, in one ``all_gather`` over the context parallel group of
``2 * batch + 1`` integers, the first label of each of its chunks and its number of
counted targets (its non-ignored labels, minus global position 0, which is nobody's
target). Every rank then builds its correctly shifted labels and knows the global count
``N``, and returns

    loss_r = cp * (sum of its token losses) / N

so that the **mean over the context parallel group of the per-rank losses is exactly the
single-process loss** (what SMP's script logs) and, since FSDP averages gradients over its
shard group, which contains the context parallel ranks, **the averaged gradients are
exactly the single-process gradients** (the gradients of ``sum_r loss_r / cp``, with the
cross-rank attention terms returned by the attention backward).

``num_items_in_batch``, when the caller passes it (gradient accumulation), is taken to
count the targets of the whole, unsplit sequences, the value one would pass without
context parallelism, and replaces ``N``. ``shift_labels``, when passed, are taken to be
shifted on the whole sequence before splitting (then correct as given) and only the
normalisation is applied.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_sagemaker.context_parallel.comm import all_gather_stacked
from torch_sagemaker.context_parallel.layout import (
    check_local_length,
    chunks_of_rank,
    owner_of_chunk,
)


def shift_labels_across_ranks(
    labels: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's next-token targets and the group's target count (Note [Context parallel loss]).

    Args:
        labels: Local labels ``(b, 2c)`` (chunks ``r`` and ``2cp-1-r``).
        group: The context parallel group (a collective: every rank calls it).
        ignore_index: Label value that is no target.

    Returns:
        ``(shift_labels, count)``: targets ``(b, 2c)`` and the number of counted targets
        over the group (0-dim int64).
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n = labels.shape
    c = check_local_length(n, cp)
    counted = labels != ignore_index
    count = counted.sum()
    if rank == 0:
        count = count - counted[:, 0].sum()  # global position 0 is no token's target
    packet = torch.cat([labels[:, 0], labels[:, c], count.reshape(1)]).to(torch.int64)
    gathered = all_gather_stacked(packet, group)
    firsts = gathered[:, : 2 * b].reshape(cp, 2, b)  # [rank, half, row]
    shifted = torch.empty_like(labels)
    for half, chunk in enumerate(chunks_of_rank(rank, cp)):
        start = half * c
        shifted[:, start : start + c - 1] = labels[:, start + 1 : start + c]
        if chunk + 1 < 2 * cp:
            owner, owner_half = owner_of_chunk(chunk + 1, cp)
            shifted[:, start + c - 1] = firsts[owner, owner_half].to(labels.dtype)
        else:
            shifted[:, start + c - 1] = ignore_index
    return shifted, gathered[:, -1].sum()


def context_parallel_loss(
    inner: Callable[..., torch.Tensor], group: dist.ProcessGroup
) -> Callable[..., torch.Tensor]:
    """Wraps a causal LM loss function (``ForCausalLMLoss`` signature) for context parallelism.

    Args:
        inner: The model's loss function (Hugging Face's, or the vocabulary-parallel one).
        group: The context parallel group.

    Returns:
        A loss function with the same signature returning ``cp * local sum / N``.
    """
    cp = dist.get_world_size(group)

    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            assert labels is not None, "the loss needs labels or shift_labels"
            shift_labels, count = shift_labels_across_ranks(labels, group, ignore_index)
        else:
            count = (shift_labels != ignore_index).sum().to(torch.int64)
            dist.all_reduce(count, group=group)
        total = num_items_in_batch if num_items_in_batch is not None else count
        # inner returns (local sum) / N; times cp is this rank's share of the mean.
        return cp * inner(
            logits,
            labels,
            vocab_size,
            num_items_in_batch=total,
            ignore_index=ignore_index,
            shift_labels=shift_labels,
            **kwargs,
        )

    loss.__wrapped__ = inner  # type: ignore[attr-defined]
    return loss


def _router_sums(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per expert: top-k assignments and routing probabilities summed over every layer's rows.

    The sums of Hugging Face's ``load_balancing_loss_func`` (Mixtral's and its copies), in
    the same dtypes: ``(counts (E,) fp32, probability sums (E,) fp32 with grad, rows)``.
    """
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    rows = 0
    for gate in router_logits:
        weights = torch.nn.functional.softmax(gate.to(counts.device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.bincount(selected.reshape(-1), minlength=num_experts).float()
        probs = probs + weights.float().sum(dim=0)
        rows += weights.shape[0]
    return counts, probs, rows


class RouterAuxLoss:
    """Forward hook of the causal LM: the router auxiliary loss over the whole sequences.

    Note [Context parallel router auxiliary loss]
    With ``output_router_logits`` a mixture-of-experts model adds
    ``coef * aux`` to its loss, ``aux = E * sum_e (T_e / N) * (P_e / N)`` (Switch
    Transformer load balancing: ``T_e`` the top-k assignments to expert ``e``, ``P_e`` its
    summed routing probabilities, ``N`` the routed rows of every layer). Computed by the
    model on a context parallel rank, ``T``, ``P`` and ``N`` cover only the rank's tokens,
    so the CP mean of the losses, and the gradients, are not the single-process ones. The
    hook replaces it, in the convention of Note [Context parallel loss], with

        aux_r = E * sum_e (T_e / N)_group * (P_e / N)_rank

    ``T`` summed over the context parallel group (one all-reduce of ``E + 1`` numbers;
    assignments carry no gradient), ``P`` the rank's own: every rank has as many rows (the
    input check), so the mean of ``aux_r`` over the group is the single-process ``aux`` and,
    after FSDP's averaging, so are its gradients. ``output.loss`` becomes
    ``loss + coef * (aux_r - aux)`` and ``output.aux_loss`` ``aux_r``.

    On its first call the hook recomputes the model's own ``aux`` from the rank's router
    logits (once: the comparison waits for the device). If it does not match (a family
    whose auxiliary loss is another formula), every rank of the group raises (the mismatch
    travels in the all-reduce), instead of training on a wrong auxiliary loss.

    Args:
        group: The context parallel group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.checked = False  # the formula check ran (on the first call only: it syncs)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        """``output`` with the group's ``aux_loss`` and loss, or ``None`` (no auxiliary loss).

        Raises:
            ValueError: On every rank, for an auxiliary loss this hook cannot recompute.
        """
        enabled = kwargs.get("output_router_logits")
        if enabled is None:
            enabled = getattr(getattr(module, "config", None), "output_router_logits", False)
        if not enabled:
            return None
        name = type(module).__name__
        if not isinstance(output, MutableMapping):
            raise ValueError(
                f"{name} with output_router_logits and context parallelism must return its "
                "output as a ModelOutput (return_dict=True): the router auxiliary loss is "
                "recomputed over the whole sequences from output.router_logits."
            )
        aux = output.get("aux_loss")
        if not isinstance(aux, torch.Tensor):
            return None
        router_logits = output.get("router_logits")
        num_experts = getattr(module, "num_experts", None)
        top_k = getattr(module, "num_experts_per_tok", None)
        coef = getattr(module, "router_aux_loss_coef", None)
        if (
            not isinstance(router_logits, tuple)
            or num_experts is None
            or top_k is None
            or coef is None
        ):
            raise ValueError(
                f"{name} computes a router auxiliary loss (output_router_logits=True) that "
                "context parallelism cannot recompute over the whole sequences (it needs "
                "output.router_logits and the model's num_experts, num_experts_per_tok and "
                "router_aux_loss_coef). Set output_router_logits=False (config or call), or "
                "use context_parallel_degree=1."
            )
        counts, probs, rows = _router_sums(router_logits, int(num_experts), int(top_k))
        # The model's formula does not change between steps: it is checked once, since the
        # comparison waits for the device.
        check = not self.checked
        packet = counts
        if check:
            local = num_experts * torch.sum((counts / rows) * (probs / rows))
            same = torch.allclose(local.detach(), aux.detach().float(), rtol=1e-3, atol=1e-6)
            packet = torch.cat([counts, torch.tensor([float(not same)], device=counts.device)])
        dist.all_reduce(packet, group=self.group)
        if check and packet[-1].item() > 0:
            raise ValueError(
                f"{name}'s router auxiliary loss is not the Switch Transformer load-balancing "
                "loss context parallelism recomputes over the whole sequences (on some rank "
                "of the group it differs from that formula), so it would be computed on each "
                "rank's tokens alone. Set output_router_logits=False (config or call), or "
                "use context_parallel_degree=1."
            )
        self.checked = True
        cp = dist.get_world_size(self.group)
        mine = num_experts * torch.sum((packet[:num_experts] / (cp * rows)) * (probs / rows))
        mine = mine.to(aux.dtype)
        loss = output.get("loss")
        if loss is not None:
            output["loss"] = loss + coef * (mine - aux).to(loss.device)
        output["aux_loss"] = mine
        return output


__all__ = ["RouterAuxLoss", "context_parallel_loss", "shift_labels_across_ranks"]
