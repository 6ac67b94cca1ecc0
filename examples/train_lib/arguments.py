"""Command-line arguments of examples/train.py and the SMP config they carry.

The SMP config (what ``tsm.init`` takes) comes from ``--smp-config FILE.json``, from the
``SM_HP_MP_PARAMETERS`` environment variable (SageMaker sets it; ``tsm.init`` reads it and
lets it win), or from the ``--hybrid-shard-degree`` style flags below, which override the file.
"""

from __future__ import annotations

import argparse
import json

MODEL_TYPES = ("gpt_neox", "llama_v2", "llama_v3", "mistral", "mixtral", "qwen2")
SMP_FLAGS = (
    "hybrid_shard_degree",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "activation_loading_horizon",
    "random_seed",
)


def _interval(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        steps = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of steps or 'auto', got {value!r}"
        ) from None
    if steps < 0:
        raise argparse.ArgumentTypeError(f"expected steps >= 0 or 'auto', got {steps}")
    return steps


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected 0/1/true/false, got {value!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the arguments (unknown ones are ignored, as SageMaker passes extra
    hyperparameters)."""
    p = argparse.ArgumentParser(
        description="Train a Hugging Face causal LM with torch.sagemaker on CPU or GPU."
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=MODEL_TYPES, default="llama_v3")
    g.add_argument("--hidden-width", type=int, default=192)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=6)
    g.add_argument("--num-key-value-heads", type=int, default=2)
    g.add_argument("--intermediate-size", type=int, default=512)
    g.add_argument("--num-local-experts", type=int, default=4)
    g.add_argument("--num-experts-per-tok", type=int, default=2)
    g.add_argument("--initializer-range", type=float, default=0.02)
    g.add_argument(
        "--moe",
        type=_bool,
        default=False,
        help="pass an MoEConfig to tsm.transform (MoELayer, expert parallelism)",
    )
    g.add_argument(
        "--moe-load-balancing",
        choices=("sinkhorn", "aux_loss", "balanced", "none"),
        default="sinkhorn",
    )
    g.add_argument("--global-token-shuffle", type=_bool, default=False)
    g.add_argument("--moe-all-to-all-dispatcher", type=_bool, default=True)
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        choices=("stdlib", "synthetic", "jsonl"),
        default="stdlib",
        help="stdlib: the Python standard library's own sources as a text corpus",
    )
    g.add_argument("--data-path", default=None, help="jsonl file with a 'text' field per line")
    g.add_argument("--corpus-mb", type=float, default=4.0, help="size of the stdlib corpus")
    g.add_argument("--max-context-width", type=int, default=128, help="sequence length")
    g.add_argument("--train-batch-size", type=int, default=8, help="per data-parallel rank")
    g.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches the train batch is split into, a forward and backward each, before "
        "one optimizer step (as the planner plans them: docs/planner.md)",
    )
    g.add_argument("--val-batch-size", type=int, default=8)
    g.add_argument("--validation-freq", type=int, default=50)
    g.add_argument("--validation-batches", type=int, default=4)
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=int, default=300)
    g.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="stop early (as if preempted) while the LR schedule still targets --max-steps",
    )
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=float, default=0.05, help="fraction of max_steps")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=12345)
    g.add_argument("--bf16", type=_bool, default=False, help="bf16 compute, fp32 master weights")
    g.add_argument(
        "--fp8",
        type=_bool,
        default=False,
        help="run the transformed model's linear layers in FP8 (fp8_autocast, docs/fp8.md)",
    )
    g.add_argument("--fp8-amax-history-len", type=int, default=1024)
    g.add_argument("--fp8-amax-compute-algo", choices=("max", "most_recent"), default="max")
    g = p.add_argument_group("memory")
    g.add_argument("--fsdp", choices=("fsdp1", "fsdp2"), default="fsdp2")
    g.add_argument("--activation-checkpointing", type=_bool, default=False)
    g.add_argument(
        "--offload-activations",
        type=_bool,
        default=False,
        help="wrap the root with offload_wrapper (needs activation checkpointing)",
    )
    g.add_argument(
        "--delayed-param", type=_bool, default=False, help="build on meta, init after sharding"
    )
    g = p.add_argument_group("checkpoints")
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        help="a directory, or s3://bucket/prefix (endpoint, region and credentials from the AWS "
        "variables: AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, ...)",
    )
    g.add_argument(
        "--checkpoint-freq",
        "--checkpoint-interval",
        type=_interval,
        default=0,
        help="save every N steps (0: never), or 'auto': measure the step and save times and "
        "save as often as keeps saving under 5%% of training time",
    )
    g.add_argument("--num-kept-checkpoints", type=int, default=2)
    g.add_argument("--checkpoint-type", choices=("sharded", "async_sharded"), default="sharded")
    g.add_argument(
        "--resume-from-checkpoint",
        "--resume",
        default=None,
        help="a checkpoint dir, or 'latest' (alias 'auto': the newest complete checkpoint under "
        "--checkpoint-dir, or a fresh start when there is none, as after torchrun's restarts)",
    )
    g.add_argument(
        "--export-dir", default=None, help="write a Hugging Face model directory at the end"
    )
    g = p.add_argument_group("run")
    g.add_argument("--distributed-backend", choices=("smddp", "gloo", "nccl"), default="smddp")
    g.add_argument("--logging-freq", type=int, default=10)
    g.add_argument(
        "--output-dir", default="outputs", help="metrics.json, the PNG plot, TensorBoard"
    )
    g.add_argument("--progress", type=_bool, default=True, help="progress bar on rank 0")
    g = p.add_argument_group("SMP config")
    g.add_argument("--smp-config", default=None, help="JSON file with SMP parameters")
    for flag in SMP_FLAGS:
        g.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    g.add_argument("--sm-activation-offloading", type=_bool, default=None)
    g.add_argument(
        "--cp-comm-type",
        choices=("p2p", "all_gather"),
        default="p2p",
        help="context parallel attention: ring of K/V blocks (p2p) or all-gather",
    )
    args, _unknown = p.parse_known_args(argv)
    steps = args.gradient_accumulation_steps
    if steps < 1 or args.train_batch_size % steps:
        p.error(
            f"--gradient-accumulation-steps {steps}: must be a positive divisor of "
            f"--train-batch-size {args.train_batch_size} (each micro-batch is "
            "train-batch-size / gradient-accumulation-steps sequences)."
        )
    return args


def smp_config(args: argparse.Namespace) -> dict:
    """The dict handed to ``tsm.init``: the JSON file, then the explicit flags on top."""
    config = {}
    if args.smp_config:
        with open(args.smp_config) as f:
            config = json.load(f)
    for flag in (*SMP_FLAGS, "sm_activation_offloading"):
        value = getattr(args, flag)
        if value is not None:
            config[flag] = value
    return config
