"""Expert parallel checkpoints: DCP reshards between ep 2 and ep 1 (losses equal), HF export.

One 2-rank job trains a tiny Mixtral (FSDP2, ``MoEConfig(moe_load_balancing="none")``) for 4
steps at ep 2, saving after step 1. A job at ep 1 (experts whole on both ranks, FSDP over
both) loads that checkpoint, trains step 2 and saves; a job at ep 2 loads that one and
trains step 3. Their losses must equal the uninterrupted run's. The ep-2 model is then
exported to a Hugging Face directory: HF keys, the fused expert tensors (E, 2I, H) and
(E, H, I), and ``from_pretrained`` gives the same logits.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import moe_models as mm
from tests.distributed.launcher import run_distributed


def _build(ep: int, hsd: int = 0):
    import copy

    import torch
    import torch.sagemaker as tsm

    from torch_sagemaker.moe.moe_config import MoEConfig
    from torch_sagemaker.sharding import shard_model

    tsm.state.reset()
    tsm.init({"expert_parallel_degree": ep, "hybrid_shard_degree": hsd})
    model = tsm.transform(
        copy.deepcopy(mm.tiny_moe("mixtral")), config=MoEConfig(moe_load_balancing="none")
    )
    shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optim, steps) -> list[float]:
    import torch.distributed as dist
    import torch.sagemaker as tsm

    losses = []
    for step in steps:
        ids = mm.batch(tsm.state.dp_rank + 10 * step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def _job(root: str) -> dict:
    import torch
    import torch.distributed as dist

    from torch_sagemaker.checkpoint.hf_export import save_hf_checkpoint
    from torch_sagemaker.checkpoint.training_state import TrainingState

    out = {}
    model, optim = _build(ep=2)
    out["uninterrupted"] = _train(model, optim, [0, 1])
    TrainingState(model, optim, step=2).save(os.path.join(root, "ep2_step2"))
    out["uninterrupted"] += _train(model, optim, [2, 3])
    save_hf_checkpoint(model, os.path.join(root, "hf"))
    ids = mm.batch(0)
    out["logits"] = model(input_ids=ids).logits.detach()
    out["experts"] = {
        n: mm.full(p).detach().clone() for n, p in model.named_parameters() if "experts" in n
    }

    model, optim = _build(ep=1)  # ep 2 -> ep 1
    state = TrainingState(model, optim)
    state.load(os.path.join(root, "ep2_step2"))
    out["ep1_step"] = state.step
    out["ep1"] = _train(model, optim, [2])
    TrainingState(model, optim, step=3).save(os.path.join(root, "ep1_step3"))
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    out["ep1_experts_mesh"] = dict(
        zip(experts.device_mesh.mesh_dim_names, experts.device_mesh.shape)
    )

    model, optim = _build(ep=2)  # and back
    TrainingState(model, optim).load(os.path.join(root, "ep1_step3"))
    out["ep2_again"] = _train(model, optim, [3])
    dist.barrier()
    if dist.get_rank() == 0:
        import safetensors.torch
        from transformers import AutoModelForCausalLM

        tensors = safetensors.torch.load_file(os.path.join(root, "hf", "model.safetensors"))
        out["hf_shapes"] = {k: tuple(v.shape) for k, v in tensors.items() if "experts" in k}
        out["hf_equal"] = all(torch.equal(tensors[k], v) for k, v in out["experts"].items())
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf"))
        out["hf_logits_diff"] = float((loaded(input_ids=ids).logits - out["logits"]).abs().max())
        out["hf_keys"] = sorted(tensors) == sorted(
            n for n, _ in mm.tiny_moe("mixtral").named_parameters()
        )
    del out["experts"], out["logits"]
    return out


@pytest.mark.distributed
def test_reshard_between_ep2_and_ep1_and_export(tmp_path):
    out = run_distributed(_job, str(tmp_path), world_size=2, timeout=600)
    first = out[0]
    assert first["ep1_step"] == 2
    # At ep 1 the experts are whole per EP rank and FSDP-sharded over both ranks.
    assert first["ep1_experts_mesh"] == {"dp_shard_cp": 2, "ep": 1}, first["ep1_experts_mesh"]
    assert abs(first["ep1"][0] - first["uninterrupted"][2]) < 1e-5, (
        first["ep1"],
        first["uninterrupted"],
    )
    assert abs(first["ep2_again"][0] - first["uninterrupted"][3]) < 1e-5, (
        first["ep2_again"],
        first["uninterrupted"],
    )
    assert first["hf_keys"] and first["hf_equal"], first
    assert first["hf_shapes"] == {
        f"model.layers.{i}.mlp.experts.{n}": s
        for i in range(2)
        for n, s in (("gate_up_proj", (4, 96, 32)), ("down_proj", (4, 32, 48)))
    }
    assert first["hf_logits_diff"] < 1e-5, first["hf_logits_diff"]


def _fsdp1_job(root: str) -> dict:
    """FSDP1 as SMP calls it, ep 2 x hybrid_shard_degree 2 (experts in FSDP1 units of their own)."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.checkpoint.training_state import TrainingState
    from torch_sagemaker.moe.moe_config import MoEConfig

    out = {}
    for run in ("first", "resumed"):
        tsm.state.reset()
        tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2})
        model = mm.wrap(
            tsm.transform(
                copy.deepcopy(mm.tiny_moe("mixtral")), config=MoEConfig(moe_load_balancing="none")
            ),
            "fsdp1",
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if run == "first":
            out["first"] = _train(model, optim, [0, 1])
            TrainingState(model, optim, step=2).save(os.path.join(root, "sharded"))
            dist.barrier()
            TrainingState(model, optim, step=2).save(os.path.join(root, "local"), kind="local")
            out["first"] += _train(model, optim, [2])
        else:
            optim_copy = torch.optim.AdamW(model.parameters(), lr=1e-2)
            TrainingState(model, optim).load(os.path.join(root, "local"), kind="local")
            out["resumed"] = _train(model, optim, [2])
            # The per-EP-rank sharded checkpoint (FSDP1), into the model as it is now.
            TrainingState(model, optim_copy).load(os.path.join(root, "sharded"))
            out["resumed_sharded"] = _train(model, optim_copy, [2])
    return out


@pytest.mark.distributed
def test_fsdp1_sm_local_and_per_ep_rank_sharded_round_trips(tmp_path):
    out = run_distributed(_fsdp1_job, str(tmp_path), world_size=4, timeout=600)[0]
    assert out["resumed"][0] == out["first"][2], out
    assert out["resumed_sharded"][0] == out["first"][2], out
    assert sorted(os.listdir(os.path.join(tmp_path, "sharded"))) == ["ep2-0", "ep2-1"]
