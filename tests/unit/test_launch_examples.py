"""examples/launch/: the SageMaker estimator's arguments are the SDK's documented ones and a
valid SMP config, its hyperparameters are options of examples/train.py, and the shell
launchers are valid bash."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from torch_sagemaker import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "examples", "launch")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sagemaker_estimator_arguments():
    estimator = _load(os.path.join(LAUNCH, "sagemaker_estimator.py"), "sagemaker_estimator")
    args = estimator.estimator_arguments(
        "arn:aws:iam::123456789012:role/r", instance_count=4, checkpoint_s3_uri="s3://b/c"
    )
    # The arguments of sagemaker.pytorch.PyTorch (and its Framework/EstimatorBase bases).
    assert set(args) == {
        "entry_point", "source_dir", "role", "instance_type", "instance_count",
        "framework_version", "py_version", "distribution", "hyperparameters", "max_run",
        "checkpoint_s3_uri", "checkpoint_local_path",
    }  # fmt: skip
    assert os.path.isfile(os.path.join(args["source_dir"], args["entry_point"]))
    distribution = args["distribution"]
    assert distribution["torch_distributed"] == {"enabled": True}
    mp = distribution["smdistributed"]["modelparallel"]
    assert mp["enabled"] is True
    # SageMaker hands `parameters` to tsm.init as SM_HP_MP_PARAMETERS: it must validate for
    # the job's world size (4 instances x 8 GPUs).
    world = args["instance_count"] * estimator.GPUS_PER_INSTANCE[args["instance_type"]]
    cfg = config_lib.load(
        None, environ={config_lib.ENV_VAR: json.dumps(mp["parameters"])}, world_size=world
    )
    assert cfg.hybrid_shard_degree == 8
    # Each hyperparameter reaches train.py as `--key value`; every key is one of its options.
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from train_lib.arguments import parse_args
    finally:
        sys.path.pop(0)
    argv = [part for k, v in args["hyperparameters"].items() for part in (f"--{k}", str(v))]
    parsed = vars(parse_args(argv))
    for key, value in args["hyperparameters"].items():
        dest = {"resume": "resume_from_checkpoint"}.get(key, key.replace("-", "_"))
        assert str(parsed[dest]).lower() in (str(value).lower(), "true"), (key, parsed[dest])
    assert parsed["resume_from_checkpoint"] == "auto"


@pytest.mark.parametrize("name", ["torchrun_multinode.sh", "mpirun.sh", "slurm.sbatch"])
def test_shell_launchers_are_valid_bash(name):
    path = os.path.join(LAUNCH, name)
    assert os.access(path, os.X_OK)
    done = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_launchers_refuse_a_missing_address():
    done = subprocess.run(
        ["bash", os.path.join(LAUNCH, "torchrun_multinode.sh")],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode != 0 and "MASTER_ADDR" in done.stderr
