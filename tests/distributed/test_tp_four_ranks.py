"""Four-rank tensor parallel cases: loading from rank 0 across TP and data-parallel groups
(Falcon's fused projection computed by rows among the families), tp=4 on a GQA model with
two kv heads (each kv head replicated on two ranks), and a multimodal
model (Gemma 3 with an image) under tp 2 x FSDP2 2: ``generate`` with pixel values, before any
forward and after a training step, gives one process's tokens, and its replicated vision
tower called outside the root's forward while FSDP2 holds it sharded refuses, naming the fix
(Note [Parameters still sharded by FSDP]); under FSDP1 (``use_orig_params=True``) too, and
the fix it names (``summon_full_params``) gives one process's image features. DDP around a
TP model (policy path, plan path, tied weights), on the data-parallel group or the world,
refuses with an error naming FSDP (Note [DDP and DTensor parameters])."""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import ATOL, batch, build, compare_forward_backward


def _rank0_load(family: str) -> dict:
    """Rank 0 holds real (perturbed) weights, ranks 1-3 a meta model; compare with loading
    everywhere."""
    import torch
    import torch.sagemaker as tsm

    ref = build(family)
    with torch.no_grad():  # weights that no other rank could produce from the seed
        for p in ref.parameters():
            p.add_(0.01 * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape).sin())
    if tsm.state.rank == 0:
        model = copy.deepcopy(ref)
    else:
        with torch.device("meta"):
            model = build(family)
    tsm.transform(model, load_state_dict_from_rank0=True)
    everywhere = tsm.transform(copy.deepcopy(ref))
    mine, theirs = model.state_dict(), everywhere.state_dict()
    shards_equal = all(
        torch.equal(
            mine[k].to_local() if hasattr(mine[k], "to_local") else mine[k],
            theirs[k].to_local() if hasattr(theirs[k], "to_local") else theirs[k],
        )
        for k in theirs
    )
    ref_buffers = dict(ref.named_buffers())
    buffers_equal = all(
        torch.equal(b.full_tensor() if hasattr(b, "full_tensor") else b, ref_buffers[n])
        for n, b in model.named_buffers()
    )
    r = compare_forward_backward(model, ref, batch(tsm.state.dp_rank))
    return dict(
        shards_equal=shards_equal,
        buffers_equal=buffers_equal,
        keys=list(mine) == list(theirs),
        meta=any(p.is_meta for p in model.parameters()),
        logits=r["logits"],
        grads=max(r["grads"].values()),
    )


def _gqa_tp4() -> dict:
    import torch.sagemaker as tsm

    ref = build("llama", num_key_value_heads=2)
    model = tsm.transform(copy.deepcopy(ref))
    r = compare_forward_backward(model, ref, batch(0))
    k = model.model.layers[0].self_attn.k_proj.weight
    return dict(
        logits=r["logits"],
        loss=r["loss"],
        grads=r["grads"],
        k_placements=[str(p) for p in k.placements],
    )


def _gemma3_with_image():
    """Tiny Gemma3ForConditionalGeneration (a replicated SigLIP vision tower) and its inputs."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    from tools.model_coverage.tiny import tiny_config

    cfg = tiny_config("gemma3")
    cfg.image_token_index, cfg.boi_token_index, cfg.eoi_token_index = 127, 125, 126
    cfg.mm_tokens_per_image = 4
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 32, 8
    cfg.vision_config.vision_use_head = False  # as in Gemma 3's configs
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # zero-initialized weights would hide the image from the tokens
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(55)
    ids = torch.randint(0, 120, (2, 14), generator=g)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 125, 127, 126  # begin, 4 image tokens, end
    inputs = dict(
        input_ids=ids,
        pixel_values=torch.randn(2, 3, 32, 32, generator=g),
        token_type_ids=(ids == 127).long(),
    )
    return model.float(), inputs


def _multimodal_outside_forward() -> dict:
    """Gemma 3 with an image under tp 2 x FSDP2 2 (Note [Generation under FSDP2])."""
    import torch
    import torch.sagemaker as tsm

    from torch_sagemaker.sharding import shard_model

    ref, inputs = _gemma3_with_image()
    ref.eval()
    model = tsm.transform(copy.deepcopy(ref))
    shard_model(model)
    tokens = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = {}
    with torch.no_grad():
        want = ref.generate(**inputs, **tokens)
        out["before_forward"] = torch.equal(model.generate(**inputs, **tokens), want)
    model.train()
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == 127, -100)
    model(**inputs, labels=labels).loss.backward()  # leaves the root's parameters sharded
    model.zero_grad()
    model.eval()
    try:
        with torch.no_grad():
            model.model.get_image_features(inputs["pixel_values"])
        out["refusal"] = "no error"
    except Exception as e:  # before the check: an IndexError inside SigLIP
        out["refusal"] = f"{type(e).__name__}: {e}"
    with torch.no_grad():
        out["after_training"] = torch.equal(model.generate(**inputs, **tokens), want)
    return out


def _multimodal_outside_fsdp1_forward() -> dict:
    """Gemma 3's vision tower called after a training step under tp 2 x FSDP1 2, wrapped as
    SMP's scripts wrap models (``use_orig_params=True``, one unit per decoder layer)."""
    import functools

    import torch
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from torch_sagemaker.policies import transformer_layer_classes

    ref, inputs = _gemma3_with_image()
    model = tsm.transform(copy.deepcopy(ref))
    # The vision encoder's layers too: units nested in the replicated tower, still sharded
    # when the tower's forward starts, which must not be refused.
    vision_layer = type(model.model.vision_tower.encoder.layers[0])
    policy = functools.partial(
        transformer_auto_wrap_policy,
        transformer_layer_cls={*transformer_layer_classes(model), vision_layer},
    )
    fsdp = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == 127, -100)
    fsdp(**inputs, labels=labels).loss.backward()  # leaves the root's parameters sharded
    fsdp.zero_grad()
    out = {}
    try:
        with torch.no_grad():
            model.model.get_image_features(inputs["pixel_values"])
        out["refusal"] = "no error"
    except Exception as e:  # before the check: "weight should have at least three dimensions"
        out["refusal"] = f"{type(e).__name__}: {e}"
    with torch.no_grad(), FSDP.summon_full_params(fsdp, writeback=False):
        features = model.model.get_image_features(inputs["pixel_values"])
    with torch.no_grad():
        want = ref.model.get_image_features(inputs["pixel_values"])
    out["summoned"] = max(  # the vision tower's states and the projected features
        float((a - b).abs().max())
        for a, b in zip(features.to_tuple(), want.to_tuple(), strict=True)
    )
    return out


def _ddp_refused() -> dict:
    """DDP around TP models (policy path, plan path, tied weights): the error it raises."""
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for family in ("llama", "qwen3", "qwen2"):
        model = tsm.transform(build(family))
        for group in ("dp", "world"):
            pg = tsm.state.dp_process_group if group == "dp" else dist.group.WORLD
            try:
                DDP(model, process_group=pg)
                out[family, group] = "no error"
            except Exception as e:  # PyTorch's own error, where the check is missing
                out[family, group] = f"{type(e).__name__}: {e}"
    return out


def _four_rank_cases(families) -> dict:
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
    out = {"ddp": _ddp_refused()}
    out["rank0"] = {family: _rank0_load(family) for family in families}
    out["multimodal"] = _multimodal_outside_forward()
    out["multimodal_fsdp1"] = _multimodal_outside_fsdp1_forward()
    tsm.state.reset()
    tsm.init({"tensor_parallel_degree": 4})
    out["gqa_tp4"] = _gqa_tp4()
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(
        _four_rank_cases,
        ("llama", "mixtral", "gpt_neox", "gemma", "gpt2", "falcon"),
        world_size=4,
        timeout=400,
    )


@pytest.mark.distributed
def test_load_state_dict_from_rank0_equals_loading_everywhere(four_ranks):
    for rank, result in enumerate(four_ranks):
        for family, r in result["rank0"].items():
            assert r["keys"] and not r["meta"], (rank, family)
            assert r["shards_equal"], (rank, family)
            assert r["buffers_equal"], (rank, family)  # RoPE inv_freq reached the meta ranks
            assert r["logits"] < ATOL and r["grads"] < ATOL, (rank, family, r)


@pytest.mark.distributed
def test_ddp_refuses_a_tensor_parallel_model(four_ranks):
    """Note [DDP and DTensor parameters]: a clear error before DDP's own DTensor failure."""
    for rank, result in enumerate(four_ranks):
        assert len(result["ddp"]) == 6, result["ddp"].keys()  # 3 families x (dp group, world)
        for case, error in result["ddp"].items():
            assert error.startswith("ValueError: DistributedDataParallel("), (rank, case, error)
            assert "are DTensors (first: model.embed_tokens.weight" in error, (case, error)
            assert "tensor_parallel_degree > 1" in error, error
            assert "shard_model(model)" in error and "hybrid_shard_degree=1" in error, error


@pytest.mark.distributed
def test_gqa_with_fewer_kv_heads_than_tp_ranks(four_ranks):
    for rank, result in enumerate(four_ranks):
        r = result["gqa_tp4"]
        assert r["k_placements"] == ["R"], rank  # kv heads replicated, not split
        assert r["logits"] < ATOL and r["loss"] < ATOL, (rank, r["logits"])
        bad = {n: d for n, d in r["grads"].items() if d > ATOL}
        assert not bad, (rank, bad)


@pytest.mark.distributed
def test_multimodal_generate_and_replicated_modules_outside_the_fsdp2_forward(four_ranks):
    for rank, result in enumerate(four_ranks):
        r = result["multimodal"]
        assert r["before_forward"] and r["after_training"], (rank, r)
        refusal = r["refusal"]
        assert refusal.startswith("RuntimeError: SiglipVisionModel ran outside the forward"), (
            rank,
            refusal,
        )
        assert "model.unshard()" in refusal and "summon_full_params" in refusal, refusal


@pytest.mark.distributed
def test_replicated_modules_outside_the_fsdp1_forward(four_ranks):
    for rank, result in enumerate(four_ranks):
        r = result["multimodal_fsdp1"]
        refusal = r["refusal"]
        assert refusal.startswith("RuntimeError: SiglipVisionModel ran outside the forward"), (
            rank,
            refusal,
        )
        assert "slice of FSDP1's flat shard" in refusal, refusal
        assert "summon_full_params" in refusal, refusal
        assert r["summoned"] < 1e-5, (rank, r["summoned"])
