"""A TP rank whose experts no token chose, under FSDP2 hybrid sharding, against one process.

Note [Experts without a token on this rank] (``moe/unused_experts.py``): with
transformers' eager expert loop, such a rank used to compute nothing that backward could
reach, and its collectives no longer matched its TP and data-parallel peers' (gloo aborted
the job). Tiny Mixtral (4 experts, 2 per TP rank) at tp 2 x hybrid shard 2: data-parallel
rank 0's choices all go to expert 0 (TP rank 0's), rank 1's half to expert 3 (TP rank 1's);
the reference routes the same way. Loss and every gradient must match.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

EXPERTS = 4


def _route(experts, dp_rank: int):
    """Overrides the experts' choices (global expert numbers) for ``dp_rank``'s batch."""
    import torch

    def pre(module, args):
        hidden, index, weights = args
        index = index.to_local() if hasattr(index, "to_local") else index
        index = torch.zeros_like(index)
        if dp_rank == 1:
            index[: index.shape[0] // 2] = EXPERTS - 1
        return hidden, index, weights

    return experts.register_forward_pre_hook(pre)


def _unused_experts(implementation: str) -> dict:
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import fully_shard

    from tests.distributed.test_tp_parity import batch, build, gradient_diffs

    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
    dp, dp_size = tsm.state.dp_rank, tsm.state.dp_size
    ref = build("mixtral")
    ref.config._experts_implementation = implementation
    model = tsm.transform(copy.deepcopy(ref))
    for layer in model.model.layers:
        _route(layer.mlp.experts, dp)
        fully_shard(layer, mesh=tsm.state.fsdp_mesh)
    fully_shard(model, mesh=tsm.state.fsdp_mesh)
    ids = batch(dp)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    ref_loss = None
    for d in range(dp_size):
        hooks = [_route(layer.mlp.experts, d) for layer in ref.model.layers]
        rows = batch(d)
        out = ref(input_ids=rows, labels=rows, use_cache=False).loss
        (out / dp_size).backward()
        ref_loss = float(out) if d == dp else ref_loss
        for h in hooks:
            h.remove()
    return {"loss": float(loss), "ref_loss": ref_loss, "grads": gradient_diffs(model, ref)}


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_a_tp_rank_without_tokens_for_its_experts_matches_one_process(implementation):
    for rank, r in enumerate(
        run_distributed(_unused_experts, implementation, world_size=4, timeout=120)
    ):
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5, (rank, r["loss"], r["ref_loss"])
        assert r["grads"] and max(r["grads"].values()) < 2e-5, (rank, r["grads"])
