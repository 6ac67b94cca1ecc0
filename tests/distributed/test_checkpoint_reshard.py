"""Sharded checkpoints on 2-4 CPU ranks: resume under other layouts, async save, HF export.

One 4-rank job (hybrid_shard_degree 2: two replicas of two shards, FSDP2) trains 4 steps of a
tiny Llama, saving after step 2 synchronously, asynchronously (its writer held back until
step 4 is done) and as SM-local. Other jobs then load the step-2 checkpoint under other
(world size, hybrid_shard_degree, tp, FSDP1/FSDP2) layouts and train steps 3-4: their losses
must equal the uninterrupted run's. Batches are fixed per step and split evenly over the
data-parallel ranks, so every layout computes the same global mean loss.
"""

from __future__ import annotations

import threading

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
)
GLOBAL_BATCH, SEQ, STEPS, SAVE_AT = 8, 16, 4, 2
INIT_SEED = 1234


# ----------------------------------------------------------------- rank-side helpers
def build(hsd: int, tp: int = 1, fsdp: str = "fsdp2", seed: int = INIT_SEED):
    """tsm.init + meta model + (TP) + FSDP + delayed init + AdamW + LambdaLR."""
    import torch
    import torch.sagemaker as tsm
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.distributed.test_delayed_param import fresh_layout
    from torch_sagemaker.delayed_param import DelayedParamIniter

    fresh_layout({"hybrid_shard_degree": hsd, "tensor_parallel_degree": tp})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG))
    if tp > 1:
        model = tsm.transform(model)
    initer = DelayedParamIniter(model, seed=seed, device="cpu")
    if fsdp == "fsdp2":
        from torch_sagemaker.sharding import shard_model

        shard_model(model)
        initer.init_model()
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            param_init_fn=initer.get_param_init_fn(),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    return model, optim, sched


def batch(step: int):
    """This rank's rows of the fixed global batch of ``step``."""
    import torch
    import torch.sagemaker as tsm

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(1, CFG["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
    per = GLOBAL_BATCH // tsm.state.dp_size
    return tokens[tsm.state.dp_rank * per : (tsm.state.dp_rank + 1) * per]


def train(model, optim, sched, steps) -> list[float]:
    """Trains on the given step indices; returns the global mean loss of each step."""
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.tensor import DTensor

    losses = []
    for step in steps:
        x = batch(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if isinstance(total, DTensor):
            total = total.full_tensor()
        dist.all_reduce(total, group=tsm.state.dp_process_group)
        losses.append(total.item() / tsm.state.dp_size)
    return losses


def full_logits(model):
    """Logits of a fixed probe batch (every rank the same input, gathered output)."""
    import torch
    from torch.distributed.tensor import DTensor

    probe = torch.arange(1, 1 + 2 * SEQ).reshape(2, SEQ) % CFG["vocab_size"]
    with torch.no_grad():
        out = model(input_ids=probe).logits
    return (out.full_tensor() if isinstance(out, DTensor) else out).clone()


def local_snapshot(state_dict) -> dict:
    """Flat {key: local tensor copy} of a (nested) state dict, for equality checks."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(state_dict)
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).clone()
        for k, v in flat.items()
        if isinstance(v, torch.Tensor)
    }


class GatedWriter:
    """Factory of a DCP FileSystemWriter whose writes wait for ``gate`` (max 120 s)."""

    @staticmethod
    def make(gate: threading.Event):
        from torch.distributed.checkpoint import FileSystemWriter

        class _Writer(FileSystemWriter):
            def write_data(self, plan, planner):
                if not gate.wait(120):
                    raise RuntimeError("the test never released the checkpoint writer")
                return super().write_data(plan, planner)

        return _Writer("unused-until-reset")


# ----------------------------------------------------------------- rank-side jobs
def _uninterrupted_run(root: str) -> dict:
    """Layout hsd=2 on 4 ranks: STEPS steps, checkpoints after SAVE_AT, HF export at the end."""
    import torch
    import torch.sagemaker as tsm

    from torch_sagemaker.checkpoint import (
        AsyncCallsQueue,
        TrainingState,
        async_save,
        load,
        save_hf_checkpoint,
    )

    model, optim, sched = build(hsd=2)
    losses = train(model, optim, sched, range(SAVE_AT))
    ts = TrainingState(model, optim, sched, step=SAVE_AT, data_position={"next_step": SAVE_AT})
    ts.save(f"{root}/sync/step{SAVE_AT}", num_kept=1)
    ts.save(f"{root}/local/step{SAVE_AT}", kind="local")
    gate, queue = threading.Event(), AsyncCallsQueue()
    async_save(
        ts.state_dict(),
        checkpoint_id=f"{root}/async/step{SAVE_AT}",
        queue=queue,
        storage_writer=GatedWriter.make(gate),
    )
    losses += train(model, optim, sched, range(SAVE_AT, STEPS))
    # The later steps ran while the async save was still writing (its writer was held back).
    pending_while_training = queue.get_num_unfinalized_calls()
    gate.set()
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    logits = full_logits(model)
    save_hf_checkpoint(model, f"{root}/hf")
    # The async checkpoint must hold the state of step SAVE_AT, exactly as the sync one.
    template = TrainingState(model, optim, sched).state_dict()
    load(template, checkpoint_id=f"{root}/sync/step{SAVE_AT}", check_keys_matched=False)
    sync_values = local_snapshot(template)
    load(template, checkpoint_id=f"{root}/async/step{SAVE_AT}", check_keys_matched=False)
    async_values = local_snapshot(template)
    same = sorted(k for k in sync_values if torch.equal(sync_values[k], async_values[k]))
    hf_logits = None
    if tsm.state.rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(f"{root}/hf")
        probe = torch.arange(1, 1 + 2 * SEQ).reshape(2, SEQ) % CFG["vocab_size"]
        with torch.no_grad():
            hf_logits = hf(input_ids=probe).logits
    return dict(
        losses=losses,
        pending=pending_while_training,
        finalized=finalized,
        keys=sorted(sync_values),
        same=same,
        logits=logits,
        hf_logits=hf_logits,
    )


def _resume(root: str, layouts: list[tuple[int, int, str]], kind: str = "sharded") -> dict:
    """Loads the SAVE_AT checkpoint under each (hsd, tp, fsdp) layout and trains to STEPS."""
    from torch_sagemaker.checkpoint import TrainingState

    out = {}
    for hsd, tp, fsdp in layouts:
        model, optim, sched = build(hsd=hsd, tp=tp, fsdp=fsdp, seed=INIT_SEED + 1)
        ts = TrainingState(model, optim, sched)
        ts.load(f"{root}/{'local' if kind == 'local' else 'sync'}/step{SAVE_AT}", kind=kind)
        start = ts.data_position["next_step"]
        out[(hsd, tp, fsdp)] = dict(
            step=ts.step, losses=train(model, optim, sched, range(start, STEPS))
        )
    return out


def _full_state(model, optim) -> dict:
    """Full (gathered) model and optimizer state, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, [optim], options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat.update({f"optim.{p}.{k}": v for p, s in osd["state"].items() for k, v in s.items()})
    return {k: v.clone() for k, v in flat.items()}


def _fsdp1_round_trip(root: str) -> dict:
    """FSDP1 (2 replicas) resumes the FSDP2 checkpoint, trains, saves; FSDP2 loads that save."""
    import torch

    from torch_sagemaker.checkpoint import TrainingState

    model, optim, sched = build(hsd=1, fsdp="fsdp1", seed=INIT_SEED + 1)
    ts = TrainingState(model, optim, sched)
    ts.load(f"{root}/sync/step{SAVE_AT}")
    losses = train(model, optim, sched, range(SAVE_AT, STEPS))
    TrainingState(model, optim, sched, step=STEPS, data_position={"next_step": STEPS}).save(
        f"{root}/fsdp1/step{STEPS}"
    )
    saved = _full_state(model, optim)
    model, optim, sched = build(hsd=2, fsdp="fsdp2", seed=INIT_SEED + 2)
    ts = TrainingState(model, optim, sched)
    ts.load(f"{root}/fsdp1/step{STEPS}")
    loaded = _full_state(model, optim)
    same = sorted(k for k in saved if k in loaded and torch.equal(saved[k], loaded[k]))
    return dict(losses=losses, keys=sorted(saved), same=same, step=ts.step, lr=sched.get_last_lr())


def _local_under_other_layout(root: str) -> str:
    """Loading the SM-local checkpoint with another hybrid_shard_degree must fail clearly."""
    from torch_sagemaker.checkpoint import CheckpointError, TrainingState

    model, optim, sched = build(hsd=4)
    try:
        TrainingState(model, optim, sched).load(f"{root}/local/step{SAVE_AT}", kind="local")
    except CheckpointError as e:
        return str(e)
    return "no error"


def _tensor_parallel_job(root: str) -> dict:
    """tp=2 x hybrid_shard_degree=2 on 4 ranks: delayed init, resume, save; reload without TP.

    The TP checks share one job and one model. The pool's ranks may have run other TP
    layouts before: the launcher clears PyTorch's DTensor caches, which would otherwise hand
    a new mesh equal to a destroyed one the destroyed one's groups.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM, LlamaConfig

    from torch_sagemaker.checkpoint import TrainingState
    from torch_sagemaker.delayed_param import DelayedParamIniter

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(LlamaConfig(**CFG))
    DelayedParamIniter(ref, seed=INIT_SEED + 1, device="cpu").init_model()
    model, optim, sched = build(hsd=2, tp=2, seed=INIT_SEED + 1)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    delayed_equal = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    ts = TrainingState(model, optim, sched)
    ts.load(f"{root}/sync/step{SAVE_AT}")
    losses = train(model, optim, sched, range(ts.data_position["next_step"], STEPS))
    # And back: save under TP, load without TP (hsd 4), compare full model and optimizer state.
    TrainingState(model, optim, sched, step=STEPS, data_position={}).save(f"{root}/tp/step{STEPS}")
    saved = _full_state(model, optim)
    model, optim, sched = build(hsd=4, tp=1, seed=INIT_SEED + 2)
    TrainingState(model, optim, sched).load(f"{root}/tp/step{STEPS}")
    loaded = _full_state(model, optim)
    same = sorted(k for k in saved if k in loaded and torch.equal(saved[k], loaded[k]))
    return dict(
        delayed_equal=delayed_equal, step=ts.step, losses=losses, keys=sorted(saved), same=same
    )


# ----------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    results = run_distributed(_uninterrupted_run, root, world_size=4, timeout=300)
    return root, results


def test_async_save_overlaps_training_and_equals_sync(run4):
    _, results = run4
    for r in results:
        assert r["pending"] == 1, "the async save finished before training went on"
        assert r["finalized"] == [0]
        assert any(k.startswith("optimizer.state.") for k in r["keys"])
        assert r["same"] == r["keys"], "async checkpoint differs from the sync one"


def test_hf_export_loads_with_from_pretrained(run4):
    import torch

    _, results = run4
    trained, exported = results[0]["logits"], results[0]["hf_logits"]
    torch.testing.assert_close(exported, trained, rtol=1e-5, atol=1e-5)
    assert trained.abs().max() > 0


def test_resume_under_other_layouts_matches_uninterrupted_run(run4):
    import torch

    root, results = run4
    expected = results[0]["losses"]
    assert len(set(expected)) == STEPS  # distinct losses at every step
    four = run_distributed(
        _resume, root, [(4, 1, "fsdp2"), (1, 1, "fsdp2")], world_size=4, timeout=300
    )[0]
    two = run_distributed(
        _resume,
        root,
        [(2, 1, "fsdp2"), (1, 1, "fsdp2"), (2, 1, "fsdp1")],
        world_size=2,
        timeout=300,
    )[0]
    for layout, got in {**four, **two}.items():
        assert got["step"] == SAVE_AT, layout
        torch.testing.assert_close(
            got["losses"],
            expected[SAVE_AT:],
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, layout=layout: f"layout {layout}: {m}",
        )


@pytest.mark.slow  # about a minute here
def test_tensor_parallel_delayed_init_and_resume(run4):
    import torch

    root, results = run4
    expected = results[0]["losses"]
    out = run_distributed(_tensor_parallel_job, root, world_size=4, timeout=300)
    for rank, r in enumerate(out):
        assert r["delayed_equal"], f"rank {rank}: TP delayed init differs from unsharded init"
        assert r["step"] == SAVE_AT
        torch.testing.assert_close(r["losses"], expected[SAVE_AT:], rtol=1e-5, atol=1e-5)
        assert any(k.startswith("optim.") for k in r["keys"])
        assert r["same"] == r["keys"], sorted(set(r["keys"]) - set(r["same"]))[:5]


def test_fsdp1_hybrid_saves_and_fsdp2_loads(run4):
    import torch

    root, results = run4
    out = run_distributed(_fsdp1_round_trip, root, world_size=2, timeout=300)
    for r in out:
        torch.testing.assert_close(
            r["losses"], results[0]["losses"][SAVE_AT:], rtol=1e-5, atol=1e-5
        )
        assert any(k.startswith("optim.") for k in r["keys"])
        assert r["same"] == r["keys"], sorted(set(r["keys"]) - set(r["same"]))[:5]
        assert r["step"] == STEPS and r["lr"] == [1e-2 / (1 + STEPS)]


def test_sm_local_resumes_only_under_the_same_shard_layout(run4):
    import torch

    root, results = run4
    expected = results[0]["losses"]
    # Same hybrid_shard_degree (2), fewer replicas: loads and continues exactly.
    two = run_distributed(_resume, root, [(2, 1, "fsdp2")], "local", world_size=2, timeout=300)[0]
    torch.testing.assert_close(
        two[(2, 1, "fsdp2")]["losses"], expected[SAVE_AT:], rtol=1e-5, atol=1e-5
    )
    message = run_distributed(_local_under_other_layout, root, world_size=4, timeout=300)[0]
    assert "SM-local checkpoint" in message and "hybrid_shard_degree=2/4" in message, message
