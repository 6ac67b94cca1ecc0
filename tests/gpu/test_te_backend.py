"""Transformer Engine backend: tp=2 parity with the untransformed model on two GPUs, and FP8
through Transformer Engine's fp8_autocast on the layers tsm.transform built (one GPU).

Skipped unless transformer_engine imports and CUDA exists (two devices for tp=2, sm_89+ for
FP8); this has NOT been run where the package is developed (CPU-only machines).
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
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
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
    assert select_backend().name == "te"
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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_te_tp2_matches_reference():
    for r in run_distributed(_te_parity, world_size=2, backend="nccl", timeout=300):
        assert r["module"].startswith("transformer_engine"), r["module"]
        assert r["logits"] < 1e-3 and r["loss"] < 1e-4, r
        assert r["q_grad"] < 1e-4 and r["o_grad"] < 1e-4, r


def _te_fp8() -> dict:
    """tensor_parallel_degree 1 with use_backend("te"): the plan's layers are te.Linear, and
    Transformer Engine's fp8_autocast (SMP's call) and torch.sagemaker.fp8's run them in FP8;
    without use_backend they stay torch_sagemaker's Fp8Linear."""
    import torch.distributed as dist
    import torch.sagemaker as tsm
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    from torch_sagemaker import fp8
    from torch_sagemaker.tensor_parallel import use_backend

    torch.cuda.set_device(dist.get_rank())
    tsm.init({})
    ref = build("llama").cuda()
    automatic = tsm.transform(copy.deepcopy(ref))
    native = type(automatic.model.layers[0].self_attn.q_proj).__name__
    use_backend("te")
    try:
        model = tsm.transform(copy.deepcopy(ref))
    finally:
        use_backend(None)
    ids = batch(0).cuda()
    kinds = {type(model.model.layers[0].self_attn.q_proj).__module__.split(".")[0]}
    losses = {"fp32": float(ref(input_ids=ids, labels=ids, use_cache=False).loss)}
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=32, amax_compute_algo="max")
    for name, region in (
        (
            "te",
            te.fp8_autocast(
                enabled=True, fp8_recipe=recipe, fp8_group=tsm.state.world_process_group
            ),
        ),
        ("ours", fp8.fp8_autocast(enabled=True, fp8_recipe=recipe)),
    ):
        with region:
            losses[name] = float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    return dict(kinds=kinds, losses=losses, native=native)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 needs an sm_89+ CUDA GPU",
)
def test_te_fp8_autocast_runs_transformed_layers():
    (r,) = run_distributed(_te_fp8, world_size=1, backend="nccl", timeout=300)
    assert r["kinds"] == {"transformer_engine"} and r["native"] == "Fp8Linear", r
    fp32 = r["losses"]["fp32"]
    assert abs(r["losses"]["te"] - fp32) < 0.05 * fp32, r  # FP8 forward, same model
    assert abs(r["losses"]["ours"] - r["losses"]["te"]) < 0.01 * fp32, r
