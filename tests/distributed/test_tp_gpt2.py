"""GPT-2 through its shipped plan: checkpoints, delayed initialization, residual dropout.

Checkpoints of its packed ``c_attn``, split block by block; dropout inside its attention.

One 4-rank job: GPT-2 at tensor parallel 2 x hybrid shard 2 (FSDP2, AdamW) trains 2 steps,
saves a sharded checkpoint (``TrainingState``; the packed weight and its optimizer state
are ``_StridedShard`` DTensors, Note [Packed shards in checkpoints]) and trains 2 more.
Fresh models of another seed load it under the same layout and without tensor
parallelism (hybrid shard 4): their full model and optimizer state equal the saved one, and
their next 2 steps give the uninterrupted run's losses. The Hugging Face export of the
trained model reloads with ``from_pretrained`` and gives its logits. And a meta-device
GPT-2, transformed, sharded and initialized late, equals an unsharded delayed
initialization of the same seed. With residual and embedding dropout (attention dropout 0),
the TP model draws the masks of one process: its attention drops out the output of the
row-parallel ``c_proj`` after the TP region (Note [Residual dropout inside attention]).
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

SAVE_AT, STEPS = 2, 4


def _build(hsd: int, tp: int, seed: int):
    """GPT-2 (its shipped plan at ``tp`` > 1), FSDP2, AdamW, under a fresh layout."""
    import torch
    import torch.sagemaker as tsm

    from tests.distributed.test_delayed_param import fresh_layout
    from tests.distributed.test_tp_parity import build
    from torch_sagemaker.sharding import shard_model

    fresh_layout({"hybrid_shard_degree": hsd, "tensor_parallel_degree": tp})
    model = build("gpt2", seed=seed)
    if tp > 1:
        model = tsm.transform(model)
    shard_model(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    return model, optim, sched


def _delayed_init_equals_unsharded() -> bool:
    """Transform, FSDP2 and delayed initialization on the meta device, as one unsharded.

    The full values equal an unsharded delayed initialization of the same seed.
    """
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_delayed_param import fresh_layout
    from tests.distributed.test_tp_parity import tiny_config
    from torch_sagemaker.delayed_param import DelayedParamIniter
    from torch_sagemaker.sharding import shard_model

    fresh_layout({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
        ref = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    model = tsm.transform(model)
    initer = DelayedParamIniter(model, seed=3, device="cpu")
    shard_model(model)
    initer.init_model()
    DelayedParamIniter(ref, seed=3, device="cpu").init_model()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return all(torch.equal(full[k], v) for k, v in ref.state_dict().items())


def _residual_dropout() -> dict:
    """Loss and gradient differences to one process, with GPT-2's residual dropout on."""
    import torch
    import torch.sagemaker as tsm

    from tests.distributed.test_delayed_param import fresh_layout
    from tests.distributed.test_tp_parity import build
    from tests.distributed.test_tp_plan_features import _with_the_same_draws

    fresh_layout({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2})
    ref = build("gpt2", seed=0, resid_pdrop=0.2, embd_pdrop=0.1).train()
    model = tsm.transform(copy.deepcopy(ref)).train()
    torch.manual_seed(0)
    return _with_the_same_draws(model, ref)


def _job(root: str) -> dict:
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.tensor import DTensor

    from tests.distributed.test_checkpoint_reshard import SEQ, _full_state, full_logits, train
    from torch_sagemaker._torch_compat.dtensor import StridedShard
    from torch_sagemaker.checkpoint import TrainingState, save_hf_checkpoint

    model, optim, sched = _build(hsd=2, tp=2, seed=0)
    c_attn = model.transformer.h[0].attn.c_attn.weight
    strided = isinstance(c_attn, DTensor) and any(
        isinstance(p, StridedShard) for p in c_attn.placements
    )
    losses = train(model, optim, sched, range(SAVE_AT))
    TrainingState(model, optim, sched, step=SAVE_AT, data_position={}).save(f"{root}/step")
    saved = _full_state(model, optim)
    losses += train(model, optim, sched, range(SAVE_AT, STEPS))
    logits = full_logits(model)
    save_hf_checkpoint(model, f"{root}/hf")
    hf_logits = None
    if tsm.state.rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(f"{root}/hf")
        probe = torch.arange(1, 1 + 2 * SEQ).reshape(2, SEQ) % 128
        with torch.no_grad():
            hf_logits = hf(input_ids=probe).logits
    resumed = {}
    for hsd, tp in ((2, 2), (4, 1)):
        model, optim, sched = _build(hsd=hsd, tp=tp, seed=1)
        TrainingState(model, optim, sched).load(f"{root}/step")
        loaded = _full_state(model, optim)
        resumed[(hsd, tp)] = dict(
            same=sorted(k for k in saved if k in loaded and torch.equal(saved[k], loaded[k])),
            losses=train(model, optim, sched, range(SAVE_AT, STEPS)),
        )
    return dict(
        delayed_equal=_delayed_init_equals_unsharded(),
        dropout=_residual_dropout(),
        strided=strided,
        keys=sorted(saved),
        losses=losses,
        logits=logits,
        hf_logits=hf_logits,
        resumed=resumed,
    )


def test_gpt2_checkpoints_delayed_init_and_residual_dropout(tmp_path):
    import torch

    out = run_distributed(_job, str(tmp_path), world_size=4, timeout=400)
    first = out[0]
    assert all(r["delayed_equal"] for r in out)
    for r in out:
        assert r["dropout"]["loss"] < 2e-5 and r["dropout"]["grads"] < 2e-5, r["dropout"]
    assert first["strided"]  # the packed weight is split block by block
    assert any("c_attn.weight" in k and "exp_avg" in k for k in first["keys"]), first["keys"]
    for rank, r in enumerate(out):
        for layout, got in r["resumed"].items():
            assert got["same"] == r["keys"], (rank, layout, set(r["keys"]) - set(got["same"]))
            torch.testing.assert_close(
                got["losses"], r["losses"][SAVE_AT:], rtol=0, atol=1e-5, msg=str(layout)
            )
    torch.testing.assert_close(first["hf_logits"], first["logits"], rtol=0, atol=1e-5)
