"""SMP's example-script checkpoint types, saved and resumed the way the scripts do it (4 ranks).

Every rank runs the scripts' sequence (``tests/distributed/smp_script_steps.py``):
``tsm.init()`` from ``SM_HP_MP_PARAMETERS``, delayed init, FSDP1 with ``use_orig_params=True``,
bf16 mixed precision, activation checkpointing and offloading. An uninterrupted run of
STEPS steps saves the checkpoint types (``sharded``, ``async_sharded``, ``async_local``,
SMP 2.5.0's ``use_pg_with_util``, and ``local``: PyTorch's ``LOCAL_STATE_DICT``, one file per
rank) after RESUME_AT steps; each type is
then loaded into a fresh model, and the resumed steps must give exactly the uninterrupted
run's losses. Layouts: tensor parallelism
2 x hybrid_shard_degree 2, hybrid_shard_degree 2 with two replicas (no TP), and SMP's Mixtral
notebook layout scaled down (MoEConfig, expert parallelism 2 x hybrid_shard_degree 2).

The same launch checks the two other checkpoint paths of the scripts under TP and EP: the
full export (``--save_final_model``) loads with ``from_pretrained`` and gives the trained
model's logits, and our own ``TrainingState`` resumes the FSDP1 model exactly. The tensor
parallel run also saves the ``sharded`` type to an ``s3://`` checkpoint_dir on moto's local
S3 server, as SMP 2.5+'s scripts do, and resumes from it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.launcher import run_distributed

STEPS, RESUME_AT = 4, 2
TYPES = ("sharded", "async_sharded", "async_local", "use_pg_with_util", "local")


def _fresh(smp, moe):
    model, initer = smp.build_model(delayed=True, moe=moe)
    model = smp.wrap_fsdp1(model, initer)
    optimizer, scheduler = smp.optimizer_and_scheduler(model)
    return model, optimizer, scheduler


def _logits(model, ids):
    from torch.distributed.tensor import DTensor

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids)["logits"]
    model.train()
    return (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()


def _gathered(model) -> dict:
    """Every parameter at full size under its Hugging Face name (FSDP1 unsharded, TP gathered)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    root = next(m for m in model.modules() if isinstance(m, FSDP))
    with FSDP.summon_full_params(root):
        return {
            n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): (
                p.full_tensor() if isinstance(p, DTensor) else p
            )
            .detach()
            .clone()
            for n, p in root.named_parameters()
        }


def _resume_all_types(root: str, moe: bool, config: dict, s3: tuple | None = None) -> dict:
    """One layout's job; SMP's scripts get their config from ``SM_HP_MP_PARAMETERS``, which
    is set here, before ``tsm.init()``, as SageMaker sets it before the script starts.

    ``s3``: ``(s3://... checkpoint_dir, AWS variables)`` to also save the ``sharded`` type
    there, as SMP 2.5+'s scripts do for an ``s3://`` checkpoint_dir, and resume from it.
    """
    import contextlib
    import os

    from tests.s3_server import environment

    os.environ["SM_HP_MP_PARAMETERS"] = json.dumps(config)
    try:
        with environment(s3[1]) if s3 else contextlib.nullcontext():
            return _resume_all_types_in_layout(root, moe, s3[0] if s3 else None)
    finally:
        del os.environ["SM_HP_MP_PARAMETERS"]


def _resume_all_types_in_layout(root: str, moe: bool, s3_root: str | None = None) -> dict:
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue

    from tests.distributed import smp_script_steps as smp
    from torch_sagemaker.checkpoint import TrainingState

    tsm.init()  # the config comes from SM_HP_MP_PARAMETERS, as on SageMaker
    rep = smp.replication_group()
    queue = AsyncCallsQueue()
    model, optimizer, scheduler = _fresh(smp, moe)
    meta = smp.pg_metadata(model)
    out: dict = {"reference": []}
    for step in range(STEPS):
        out["reference"].append(smp.train_step(model, optimizer, scheduler, step))
        if step + 1 == RESUME_AT:
            user = {"total_steps": step + 1}
            smp.save_sharded(model, optimizer, scheduler, f"{root}/sharded", meta, user)
            smp.save_async_sharded(
                model, optimizer, scheduler, f"{root}/async_sharded", meta, user, queue
            )
            smp.save_async_local(
                model, optimizer, scheduler, f"{root}/async_local", user, queue, rep
            )
            smp.save_with_util(model, optimizer, scheduler, f"{root}/use_pg_with_util", meta, user)
            smp.save_local(model, optimizer, scheduler, f"{root}/local", user)
            TrainingState(model, optimizer, scheduler, step=step + 1).save(f"{root}/training_state")
            if s3_root is not None:
                smp.save_sharded_s3(model, optimizer, scheduler, f"{s3_root}/sharded", meta, user)
    queue.maybe_finalize_async_calls(blocking=True, process_group=None)
    ids = smp.batch_for(0)
    out["logits"] = _logits(model, ids)
    sharded_model = tsm.state.tensor_parallel_degree > 1 or tsm.state.expert_parallel_degree > 1
    if sharded_model:
        out["params"] = _gathered(model)
        smp.save_full(model, f"{root}/final", smp.mixtral_config() if moe else None)
    loaders = {
        "sharded": lambda m, o, s: smp.load_sharded(m, o, s, f"{root}/sharded", smp.pg_metadata(m)),
        "async_sharded": lambda m, o, s: smp.load_async_sharded(
            m, o, s, f"{root}/async_sharded", smp.pg_metadata(m)
        ),
        "async_local": lambda m, o, s: smp.load_async_local(m, o, s, f"{root}/async_local", rep),
        "use_pg_with_util": lambda m, o, s: smp.load_with_util(
            m, o, s, f"{root}/use_pg_with_util", smp.pg_metadata(m)
        ),
        "local": lambda m, o, s: smp.load_local(m, o, s, f"{root}/local"),
    }

    def load_training_state(m, o, s):
        ts = TrainingState(m, o, s)
        ts.load(f"{root}/training_state")
        return ts.step

    loaders["training_state"] = load_training_state
    if s3_root is not None:
        # SMP 2.5+: the loader is handed the s3:// directory; the optimizer state is read
        # through the same DistributedFileSystemReader.
        loaders["sharded_s3"] = lambda m, o, s: smp.load_async_sharded(
            m, o, s, f"{s3_root}/sharded", smp.pg_metadata(m)
        )
    for kind, load in loaders.items():
        model, optimizer, scheduler = _fresh(smp, moe)
        start = load(model, optimizer, scheduler)
        out[kind] = (
            start,
            [smp.train_step(model, optimizer, scheduler, step) for step in range(start, STEPS)],
        )
    if sharded_model and dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(f"{root}/final")
        out["loaded"] = {n: p.detach().clone() for n, p in exported.named_parameters()}
        for p in exported.parameters():  # FSDP's bf16 compute; buffers (RoPE) stay fp32
            p.data = p.data.to(torch.bfloat16)
        out["exported"] = _logits(exported, ids)
        out["saved"] = torch.load(f"{root}/final/pytorch_model.bin")
    return out


S3_LAYOUT = "tp2_hsd2"  # the layout whose run also saves the sharded type to S3
LAYOUTS = {  # name: (SMP config, Mixtral with MoEConfig)
    "tp2_hsd2": ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, False),
    "hsd2_two_replicas": ({"hybrid_shard_degree": 2}, False),
    "mixtral_ep2_hsd2": ({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, True),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_types_resume_like_the_uninterrupted_run(layout, tmp_path, request):
    config, moe = LAYOUTS[layout]
    s3 = None
    if layout == S3_LAYOUT:  # the sharded type at an s3:// checkpoint_dir too (moto's server)
        try:
            server = request.getfixturevalue("s3_server")
        except pytest.skip.Exception:  # moto missing: the file-system types still run
            server = None
        if server is not None:
            from tests.s3_server import environment

            with environment(server.env):
                bucket = server.new_bucket()
            s3 = (f"s3://{bucket}/smp", server.env)
    # The layouts share one launch of 4 ranks (the launcher clears DTensor's mesh caches
    # between calls); each call sets SM_HP_MP_PARAMETERS on its ranks before tsm.init().
    results = run_distributed(
        _resume_all_types,
        str(tmp_path),
        moe,
        config,
        s3,
        world_size=4,
        backend="smddp",
        timeout=900,
    )
    kinds = (*TYPES, "training_state", *(("sharded_s3",) if s3 else ()))
    for rank, out in enumerate(results):
        expected = out["reference"][RESUME_AT:]
        for kind in kinds:
            start, losses = out[kind]
            assert start == RESUME_AT, (layout, kind, rank)
            assert losses == expected, f"{layout} {kind} rank {rank}: {losses} != {expected}"
    if "exported" in results[0]:
        first = results[0]
        # Full plain tensors with Hugging Face keys, exactly the model's (fp32 master) weights.
        assert first["saved"].keys() == first["params"].keys() == first["loaded"].keys()
        for name, value in first["saved"].items():
            assert type(value) is torch.Tensor, name
            assert torch.equal(value, first["params"][name]), name
            assert torch.equal(first["loaded"][name], value), name
        # Same logits, up to bf16 rounding (TP sums the projections in another order).
        torch.testing.assert_close(first["exported"], first["logits"], atol=3e-2, rtol=3e-2)

    if s3:
        keys = {o["Key"] for o in server.boto3().list_objects_v2(Bucket=bucket)["Contents"]}
        for tp_rank in range(2):  # one committed checkpoint per TP rank's directory
            assert f"smp/sharded/tp2-{tp_rank}/.sm_checkpoint_complete.json" in keys
