"""A batch that leaves parameters unused on one rank only, under ``shard_model`` (FSDP2).

Tiny Gemma 3 (image + text) on 2 data-parallel ranks: rank 0's batches carry an image, rank
1's are text only, so its vision tower gets no gradient. FSDP2 reduce-scatters only the
parameters with a gradient, and ``ReplicaReduction`` started a unit's all-reduce once all
its gradients had arrived: both made the ranks' collectives differ (gloo aborted on their
sizes). Note [Parameters unused on some ranks] (``sharding/fsdp2.py``) and Note [Deferred
replica reduction]. Sharded over both ranks, and as two replicas of one rank with the
all-reduce during backward; 2 SGD steps against one process on both batches: losses,
gradient norms and every parameter.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

STEPS, LR = 2, 0.1


def _batch(step: int, with_image: bool) -> dict:
    import torch

    g = torch.Generator().manual_seed(55 + step)
    ids = torch.randint(0, 120, (2, 14), generator=g)
    if not with_image:
        return {"input_ids": ids, "labels": ids}
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 125, 127, 126  # begin, 4 image tokens, end
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(2, 3, 32, 32, generator=g),
        "token_type_ids": (ids == 127).long(),
        "labels": ids.masked_fill(ids >= 125, -100),
    }


def _train(case: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from tests.distributed.hf_models import full_params
    from tests.distributed.test_tp_four_ranks import _gemma3_with_image
    from torch_sagemaker.grad_norm import clip_grad_norm_
    from torch_sagemaker.sharding import shard_model

    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": 1} if case == "replicas" else {})
    ref, _ = _gemma3_with_image()
    # tsm.transform records Gemma 3's policy: the decoder layers are the units, and the vision
    # tower (replicated) sits in the root, which runs on every rank.
    model = tsm.transform(copy.deepcopy(ref))
    model = shard_model(model, overlap_replica_reduction=case == "replicas")
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
    rank = dist.get_rank()
    out: dict = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": []}
    for step in range(STEPS):
        batches = [_batch(step, True), _batch(step, False)]
        loss = model(**batches[rank]).loss
        loss.backward()
        out["loss"].append(float(loss))
        out["norm"].append(float(clip_grad_norm_(model, 1e9)))
        optim.step()
        optim.zero_grad(set_to_none=True)
        for b in batches:
            ref_loss = ref(**b).loss
            (ref_loss / 2).backward()
            if b is batches[rank]:
                out["ref_loss"].append(float(ref_loss))
        out["ref_norm"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)))
        ref_optim.step()
        ref_optim.zero_grad(set_to_none=True)
    ref_params = dict(ref.named_parameters())
    out["params"] = {
        n: float((p - ref_params[n]).abs().max()) for n, p in full_params(model).items()
    }
    initial = dict(_gemma3_with_image()[0].named_parameters())
    out["vision_moved"] = max(
        float((p - initial[n]).abs().max())
        for n, p in full_params(model).items()
        if "vision_tower" in n
    )
    return out


def _replicas_skipping_a_middle_unit() -> dict:
    """``ReplicaReduction`` by itself (FSDP2 over one rank per replica, so FSDP2 reduces
    nothing): three equal units, and rank 1's batch skips a parameter of the middle one. Its
    unit completes mid-backward on rank 0 and only at the end on rank 1. Sending only the
    gradients that arrived made the sizes differ (gloo aborted); with whole units but started
    as they completed, rank 0's middle unit met rank 1's first (equal sizes: no error, other
    units' gradients summed, 0.14 off). Gradients against the average of both ranks'; a
    parameter neither rank used keeps ``None``, as in one process."""
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.sharding.replica_reduction import ReplicaReduction

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, skip_b: bool) -> torch.Tensor:
            x = torch.tanh(self.a(x))
            return x if skip_b else torch.tanh(self.b(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.unused = nn.Linear(4, 4)  # in the root unit; no rank's batch reaches it

        def forward(self, x: torch.Tensor, skip: int | None) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = block(x, skip_b=i == skip)
            return x.square().sum()

    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": 1})
    mesh = tsm.state.fsdp_mesh
    torch.manual_seed(0)
    ref = Model()
    model = Model()
    model.load_state_dict(ref.state_dict())
    for block in model.blocks:
        fully_shard(block, mesh=mesh[mesh.mesh_dim_names[1]])
    fully_shard(model, mesh=mesh[mesh.mesh_dim_names[1]])
    reduction = ReplicaReduction(model, mesh.get_group(0))
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    skips = [None, 1]
    rank = dist.get_rank()
    model(inputs[rank], skips[rank]).backward()
    for x, skip in zip(inputs, skips):
        (ref(x, skip) / 2).backward()
    ref_grads = dict(ref.named_parameters())
    return {
        "calls": reduction.calls,
        "grads": {
            n: float((p.grad.full_tensor() - ref_grads[n].grad).abs().max())
            for n, p in model.named_parameters()
            if not n.startswith("unused.")
        },
        # As in one process: no gradient where no replica's batch used the parameter.
        "unused_grads": [p.grad is None for p in model.unused.parameters()],
    }


def _cases() -> dict:
    from torch.distributed.fsdp import FSDPModule

    # Without FSDP2's setter (torch before 2.13: docs/compatibility.md) only the replica cases
    # can hold: there FSDP2 shards over one rank and reduces nothing.
    cases = ["replicas"]
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        cases.insert(0, "sharded")
    out = {case: _train(case) for case in cases}
    out["middle_unit"] = _replicas_skipping_a_middle_unit()
    return out


def test_a_rank_without_images_trains_as_one_process():
    for rank, results in enumerate(run_distributed(_cases, world_size=2, timeout=240)):
        middle = results.pop("middle_unit")
        assert middle["calls"] == 4, (rank, middle)  # every unit
        bad = {n: d for n, d in middle["grads"].items() if d > 1e-6}
        assert len(middle["grads"]) == 12 and not bad, (rank, middle["grads"])
        assert middle["unused_grads"] == [True, True], (rank, middle)
        for case, r in results.items():
            where = (rank, case)
            for got, want in zip(r["loss"], r["ref_loss"], strict=True):
                assert abs(got - want) < 1e-5, (where, r["loss"], r["ref_loss"])
            for got, want in zip(r["norm"], r["ref_norm"], strict=True):
                assert abs(got - want) < 1e-5 * want, (where, r["norm"], r["ref_norm"])
            bad = {n: d for n, d in r["params"].items() if d > 1e-5}
            assert r["params"] and not bad, (where, bad)
            assert r["vision_moved"] > 1e-3, (where, "the image trained the vision tower")
