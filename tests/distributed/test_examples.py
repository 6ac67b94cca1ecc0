"""The example script: every shipped config runs a few steps; a stopped run resumes exactly."""

import json
import math
import os
import subprocess
import sys

import pytest

from torch_sagemaker.smddp.backend import is_available as smddp_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TINY = [
    "--hidden-width",
    "64",
    "--num-layers",
    "2",
    "--num-heads",
    "4",
    "--num-key-value-heads",
    "2",
    "--intermediate-size",
    "128",
    "--max-context-width",
    "32",
    "--train-batch-size",
    "4",
    "--corpus-mb",
    "0.2",
    "--logging-freq",
    "2",
    "--validation-freq",
    "4",
    "--validation-batches",
    "1",
    "--progress",
    "0",
]
BACKEND = "smddp" if smddp_available() else "gloo"

FP8 = ["--fp8", "1", "--bf16", "1"]

# config -> (ranks, extra flags), as listed in examples/README.md
CONFIGS = {
    "full_shard.json": (2, []),
    "hybrid.json": (4, []),
    "tp2.json": (2, []),
    "tp2_hybrid.json": (4, ["--fsdp", "fsdp2"]),
    # With FP8 as SMP's scripts enable it (docs/fp8.md): replicas, checkpointing, offload.
    "offload.json": (4, ["--activation-checkpointing", "1", "--offload-activations", "1", *FP8]),
    "delayed_init.json": (2, ["--delayed-param", "1"]),
    "mixtral_ep2.json": (2, ["--model-type", "mixtral", "--moe", "1", "--fsdp", "fsdp1"]),
    "cp2.json": (2, ["--cp-comm-type", "all_gather"]),
    "cp2_tp2.json": (4, ["--fsdp", "fsdp1"]),
}


def _train(tmp_path, ranks, *flags, name="run"):
    out = tmp_path / name
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        os.path.join(ROOT, "examples", "train.py"),
        "--distributed-backend",
        BACKEND,
        "--output-dir",
        str(out),
        *TINY,
        *flags,
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    with open(out / "metrics.json") as f:
        return json.load(f)["summary"], result.stdout


def _example_main(argv):
    """examples/train.py's ``main(argv)`` on this rank; returns what the rank printed."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location(
        "example_train", os.path.join(ROOT, "examples", "train.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main(argv)
    return printed.getvalue()


# Note [Example runs in forked ranks]: most jobs here run examples/train.py's main() in fresh
# ranks forked from the test launcher's warm server (which has imported torch and
# transformers) instead of under torchrun, whose agent and ranks each import torch and
# transformers anew: several seconds of CPU per process, most of a 4-step job's time on 2
# cores. What each job checks is the same: its own fresh processes and process group (a
# resumed run reads the checkpoint in other processes than the ones that wrote it), the same
# arguments, metrics.json and rank 0's output. Starting examples/train.py under torchrun
# stays covered by the S3 test below (full_shard, 2 ranks, its first run), by the accelerate example
# (accelerate launch) and by tests/distributed/test_launchers.py (full_shard.json on two
# hosts of one rank, killed and resumed).
def _forked_train(tmp_path, ranks, *flags, name="run", env=None):
    """``_train``'s job in ranks forked from the launcher's server; (summary, rank 0's output).

    ``env``: variables the ranks get besides the launcher's (the S3 server's endpoint).
    """
    from tests.distributed.launcher import run_distributed

    out = tmp_path / name
    argv = ["--distributed-backend", BACKEND, "--output-dir", str(out), *TINY, *flags]
    printed = run_distributed(
        _example_main, argv, world_size=ranks, init_process_group=False, timeout=600, env=env
    )
    with open(out / "metrics.json") as f:
        return json.load(f)["summary"], printed[0]


def test_every_config_is_listed_in_the_readme():
    shipped = sorted(os.listdir(os.path.join(ROOT, "examples", "configs")))
    assert shipped == sorted(CONFIGS)
    with open(os.path.join(ROOT, "examples", "README.md")) as f:
        readme = f.read()
    assert all(name in readme for name in shipped)


# full_shard.json is smoke-tested by the uninterrupted run of the resume test (same checks),
# in FP8.
RESUME_CONFIG = "full_shard.json"


# Byte-level tokens (examples/README.md): a freshly initialised model predicts them about
# uniformly, so the first loss is near ln(256) = 5.545 (5.576 for full_shard on 2 ranks).
UNIFORM_LOSS = math.log(256)


def _check_smoke(summary, stdout, flags):
    assert summary["steps"] == 4 and len(summary["losses"]) == 4
    losses = summary["losses"]
    assert abs(losses[0] - UNIFORM_LOSS) < 0.25, losses  # the model starts untrained
    assert losses[-1] < losses[0] - 0.1, losses  # and 4 steps train it
    assert "validation loss" in stdout and "model TFLOPs/rank" in stdout
    if "--offload-activations" in flags:
        assert "offload:" in stdout
    if "--gradient-accumulation-steps" in flags:
        assert "[train] gradient accumulation: 4 micro-batches of 1 sequences a step" in stdout
    if "--fp8" in flags:
        # q k v o gate up down in each of the 2 layers, under SMP's recipe.
        assert "[train] FP8: 14 linear layers per rank under DelayedScaling(" in stdout, stdout


# hybrid.json is smoke-tested by the accumulation test, with and without micro-batches.
ACCUMULATION_CONFIG = "hybrid.json"


@pytest.mark.distributed
@pytest.mark.parametrize("config", sorted(set(CONFIGS) - {RESUME_CONFIG, ACCUMULATION_CONFIG}))
def test_config_smoke(tmp_path, config):
    ranks, flags = CONFIGS[config]
    summary, stdout = _forked_train(
        tmp_path,
        ranks,
        "--smp-config",
        os.path.join(ROOT, "examples", "configs", config),
        "--max-steps",
        "4",
        *flags,
    )
    _check_smoke(summary, stdout, flags)


@pytest.mark.distributed
def test_gradient_accumulation_trains_as_one_batch(tmp_path):
    # --gradient-accumulation-steps 4: a forward and backward per sequence, FSDP2's all-reduce
    # over the 2 replicas after the last (docs/planner.md, "Gradient accumulation"); in
    # float32 the losses are the whole batch's to rounding (5e-7 measured over 4 steps).
    ranks, flags = CONFIGS[ACCUMULATION_CONFIG]
    config = ["--smp-config", os.path.join(ROOT, "examples", "configs", ACCUMULATION_CONFIG)]
    runs = {}
    for steps in ("1", "4"):
        more = [*flags, "--gradient-accumulation-steps", steps]
        summary, stdout = _forked_train(
            tmp_path, ranks, *config, "--max-steps", "4", *more, name=f"ga{steps}"
        )
        _check_smoke(summary, stdout, more if steps != "1" else flags)
        runs[steps] = summary["losses"]
    assert runs["4"] == pytest.approx(runs["1"], rel=1e-5, abs=0), runs


@pytest.mark.distributed
def test_resume_continues_with_the_same_losses(tmp_path):
    # Stopped after step 2 and resumed: step 3's loss needs the saved parameters and data
    # position, step 4's also the optimizer and scheduler state (step 3's update). In FP8,
    # step 3's loss also needs the saved amax histories and scales (from scale 1 it differs).
    ckpt = tmp_path / "ckpt"
    ranks, flags = CONFIGS[RESUME_CONFIG]
    flags = [*flags, "--fp8", "1"]
    common = [
        "--smp-config",
        os.path.join(ROOT, "examples", "configs", RESUME_CONFIG),
        "--max-steps",
        "4",
        "--checkpoint-freq",
        "2",
        "--num-kept-checkpoints",
        "1",
        *flags,
    ]
    full, stdout = _forked_train(
        tmp_path, ranks, *common, "--checkpoint-dir", str(tmp_path / "other"), name="full"
    )
    _check_smoke(full, stdout, flags)
    common += ["--checkpoint-dir", str(ckpt)]
    first, _ = _forked_train(tmp_path, ranks, *common, "--stop-at-step", "2", name="first")
    second, stdout = _forked_train(
        tmp_path, ranks, *common, "--resume-from-checkpoint", "latest", name="second"
    )
    assert "resumed from" in stdout
    assert first["losses"] == pytest.approx(full["losses"][:2], abs=1e-6)
    assert second["losses"] == pytest.approx(full["losses"][2:], abs=1e-6)
    assert len(second["losses"]) == 2
    assert len(os.listdir(ckpt)) == 1  # retention kept only the newest


@pytest.mark.distributed
@pytest.mark.skipif(
    not smddp_available(), reason="the accelerate example runs on the smddp backend"
)
def test_accelerate_example(tmp_path):
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [
        accelerate,
        "launch",
        "--config_file",
        os.path.join(ROOT, "examples", "accelerate_fsdp.yaml"),
        os.path.join(ROOT, "examples", "accelerate_fsdp.py"),
        *TINY[:12],
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "STEPS": "10"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "model prepared as FSDPLlamaForCausalLM" in result.stdout
    assert "step 10: loss" in result.stdout and "on backend smddp" in result.stdout


@pytest.mark.distributed
def test_s3_checkpoint_dir_with_auto_interval_saves_and_resumes(tmp_path, s3_server):
    # --checkpoint-interval auto: steps 2-4 are timed, step 5 saves once to time the save,
    # then the interval is decided. The second run resumes from S3 ('latest' lists the bucket).
    from tests.s3_server import environment

    with environment(s3_server.env):
        bucket = s3_server.new_bucket()
    ranks, flags = CONFIGS[RESUME_CONFIG]
    common = [
        "--smp-config",
        os.path.join(ROOT, "examples", "configs", RESUME_CONFIG),
        "--checkpoint-dir",
        f"s3://{bucket}/run",
        "--checkpoint-interval",
        "auto",
        "--checkpoint-type",
        "async_sharded",
        *flags,
    ]
    with environment(s3_server.env):  # torchrun's ranks inherit the endpoint and credentials
        _, stdout = _train(tmp_path, ranks, *common, "--max-steps", "5", name="first")
    # The resumed run in forked ranks (Note [Example runs in forked ranks]): other processes
    # than the ones that saved, given the endpoint and credentials as their environment.
    second, resumed = _forked_train(
        tmp_path, ranks, *common, "--max-steps", "6", "--resume", "latest", name="second",
        env=s3_server.env,
    )  # fmt: skip
    assert "auto checkpoint interval:" in stdout, stdout[-2000:]
    keys = [o["Key"] for o in s3_server.boto3().list_objects_v2(Bucket=bucket)["Contents"]]
    markers = sorted(k for k in keys if k.endswith(".sm_checkpoint_complete.json"))
    assert [m.split("/")[1] for m in markers] == ["llama_v3-5steps"], markers
    assert f"resumed from s3://{bucket}/run/llama_v3-5steps at step 5" in resumed, resumed[-2000:]
    assert len(second["losses"]) == 1
