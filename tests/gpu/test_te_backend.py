"""Transformer Engine backend: tp=2 parity with the untransformed model on two GPUs.

Skipped unless transformer_engine imports and two CUDA devices exist; this has NOT been run
where the package is developed (CPU-only machines).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import batch, build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None,
        reason="transformer_engine is not installed",
    ),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _gathered(t, dim, group):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _te_parity() -> dict:
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.tensor_parallel import select_backend

    torch.cuda.set_device(dist.get_rank())
    tsm.init({"tensor_parallel_degree": 2})
    assert select_backend().name == "transformer_engine"
    ref = build("llama").cuda()
    model = tsm.transform(copy.deepcopy(ref))
    ids = batch(0).cuda()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    expected = ref(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()
    group = tsm.state.tp_process_group
    q = model.model.layers[0].self_attn.q_proj.weight.grad
    o = model.model.layers[0].self_attn.o_proj.weight.grad
    ref_layer = ref.model.layers[0].self_attn
    return dict(
        logits=float((out.logits - expected.logits).abs().max()),
        loss=float((out.loss - expected.loss).abs()),
        q_grad=float((_gathered(q, 0, group) - ref_layer.q_proj.weight.grad).abs().max()),
        o_grad=float((_gathered(o, 1, group) - ref_layer.o_proj.weight.grad).abs().max()),
        module=type(model.model.layers[0].self_attn.q_proj).__module__,
    )


def test_te_tp2_matches_reference():
    for r in run_distributed(_te_parity, world_size=2, backend="nccl", timeout=300):
        assert r["module"].startswith("transformer_engine"), r["module"]
        assert r["logits"] < 1e-3 and r["loss"] < 1e-4, r
        assert r["q_grad"] < 1e-4 and r["o_grad"] < 1e-4, r
