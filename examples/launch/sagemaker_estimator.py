"""Start examples/train.py as a SageMaker training job with the SageMaker Python SDK (v2).

    pip install "sagemaker>=2.200,<3"
    python examples/launch/sagemaker_estimator.py --role arn:aws:iam::...:role/... \
        --instance-count 2 --checkpoint-s3-uri s3://bucket/checkpoints

The PyTorch estimator with ``torch_distributed`` and ``smdistributed.modelparallel`` enabled
is how SMP v2 jobs start (docs/launch.md): SageMaker runs ``torchrun --nnodes N
--nproc_per_node G --master_addr algo-1 --master_port 7777 --node_rank i`` on every
instance, and hands the ``parameters`` dict to the script as ``SM_HP_MP_PARAMETERS``, which
``tsm.init`` reads (it wins over the script's own config). This file cannot run without AWS
credentials and the SDK; ``estimator_arguments`` builds the arguments without either, and a
test checks them.
"""

from __future__ import annotations

import argparse
import os

#: GPUs per instance of the instance types this example offers.
GPUS_PER_INSTANCE = {"ml.p4d.24xlarge": 8, "ml.p4de.24xlarge": 8, "ml.p5.48xlarge": 8}


def smp_parameters(instance_count: int, instance_type: str) -> dict:
    """The SMP v2 parameters: shard within an instance, replicate across instances."""
    return {
        "hybrid_shard_degree": GPUS_PER_INSTANCE[instance_type],
        "tensor_parallel_degree": 1,
        "sm_activation_offloading": True,
        "activation_loading_horizon": 2,
    }


def estimator_arguments(
    role: str,
    instance_count: int = 2,
    instance_type: str = "ml.p4d.24xlarge",
    checkpoint_s3_uri: str | None = None,
) -> dict:
    """Keyword arguments of ``sagemaker.pytorch.PyTorch`` for this job.

    Args:
        role: The IAM role ARN the job runs as.
        instance_count: Number of instances (hosts).
        instance_type: A GPU instance type of ``GPUS_PER_INSTANCE``.
        checkpoint_s3_uri: Where SageMaker syncs ``/opt/ml/checkpoints`` (optional).

    Returns:
        The arguments, as the SDK documents them for an SMP v2 job.
    """
    examples = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arguments = {
        "entry_point": "train.py",
        "source_dir": examples,
        "role": role,
        "instance_type": instance_type,
        "instance_count": instance_count,
        # The SDK maps PyTorch 2.4.1 to the SMP v2.7.0 image.
        "framework_version": "2.4.1",
        "py_version": "py311",
        "distribution": {
            "torch_distributed": {"enabled": True},
            "smdistributed": {
                "modelparallel": {
                    "enabled": True,
                    "parameters": smp_parameters(instance_count, instance_type),
                }
            },
        },
        # Each hyperparameter reaches train.py as `--key value`.
        "hyperparameters": {
            "model-type": "llama_v3",
            "max-steps": 1000,
            "bf16": 1,
            "fsdp": "fsdp1",
            "activation-checkpointing": 1,
            "offload-activations": 1,
            "checkpoint-dir": "/opt/ml/checkpoints",
            "checkpoint-freq": 100,
            "resume": "auto",
        },
        "max_run": 24 * 3600,
    }
    if checkpoint_s3_uri:
        arguments["checkpoint_s3_uri"] = checkpoint_s3_uri
        arguments["checkpoint_local_path"] = "/opt/ml/checkpoints"
    return arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", required=True)
    parser.add_argument("--instance-count", type=int, default=2)
    parser.add_argument("--instance-type", default="ml.p4d.24xlarge", choices=GPUS_PER_INSTANCE)
    parser.add_argument("--checkpoint-s3-uri", default=None)
    args = parser.parse_args()
    from sagemaker.pytorch import PyTorch  # the SageMaker Python SDK, only needed to submit

    estimator = PyTorch(
        **estimator_arguments(
            args.role, args.instance_count, args.instance_type, args.checkpoint_s3_uri
        )
    )
    estimator.fit(wait=False)
    print(f"submitted {estimator.latest_training_job.name}")


if __name__ == "__main__":
    main()
