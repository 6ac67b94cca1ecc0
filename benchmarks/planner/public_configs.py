"""Configurations AWS publishes for Llama-class models, through the planner.

Each entry is a configuration as its source states it: the model's shape, the instances, the
SMP degrees, checkpointing and offloading, the per-rank batch and the sequence length. The
planner must find each valid (the library's own checks) and within device memory;
``python -m benchmarks planner public`` prints the table of docs/planner_validation.md and
tests/unit/test_planner.py checks the verdicts.

Sources (reference/smp_api.md has the keys):

- [BP] AWS, "SageMaker distributed model parallelism best practices" (SMP v2): Llama 2 with
  ``tsm.transform`` on ml.p4d.24xlarge, sequence 4096, bf16. Its 175B row names no
  architecture; the planner runs it on a GPT-3 175B-shaped Llama (hidden 12288, 96 layers,
  96 heads, the GPT-2 vocabulary), our stand-in.
- [HPR] aws/sagemaker-hyperpod-recipes, ``recipes_collection/recipes/training/llama/``:
  ``hf_llama3_8b_seq8k_gpu_p5x16_pretrain.yaml``, ``hf_llama3_70b_seq8k_gpu_p5x32_pretrain``,
  ``hf_llama3_70b_seq16k_gpu_p5x32_pretrain``, ``p4_hf_llama3_70b_seq8k_gpu`` (``model:``
  block: ``shard_degree``, ``tensor_model_parallel_degree``, ``context_parallel_degree``,
  ``activation_checkpointing``, ``offload_activations``, ``activation_loading_horizon``,
  ``train_batch_size``; ``trainer.num_nodes``). The p5 recipes train in FP8 (Transformer
  Engine), which the planner does not model: their rows are predicted in bf16.

Neither source publishes a step time or memory figure for these configurations (the SMP
blog posts' figures were not retrievable; reference/smp_api.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_sagemaker.planner.candidates import Candidate, Rejected, check
from torch_sagemaker.planner.inputs import Cluster, Workload
from torch_sagemaker.planner.presets import accelerator, instance
from torch_sagemaker.planner.search import DEFAULT_EFFICIENCY, accelerator_machine, evaluate

_LLAMA2_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)
_LLAMA2_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=32000,
)
_GPT3_175B = dict(
    hidden_size=12288,
    intermediate_size=4 * 12288,
    num_hidden_layers=96,
    num_attention_heads=96,
    num_key_value_heads=96,
    vocab_size=50257,
)
_LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
_LLAMA3_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
)


@dataclass(frozen=True)
class PublicConfig:
    """A published configuration.

    Attributes:
        name: Short name.
        source: Where it is published.
        model: Llama config attributes.
        instance: The instance type.
        nodes: Instances.
        seq_len: Sequence length.
        batch: Sequences per data-parallel rank (``train_batch_size``).
        smp: The SMP degrees and offloading settings.
        checkpointing: Activation checkpointing.
        published: The figures the source gives, or ``""``.
    """

    name: str
    source: str
    model: dict[str, int]
    instance: str
    nodes: int
    seq_len: int
    batch: int
    smp: dict[str, Any]
    checkpointing: bool
    published: str = ""


CONFIGS: tuple[PublicConfig, ...] = (
    PublicConfig(
        "Llama 2 7B",
        "[BP]",
        _LLAMA2_7B,
        "p4d.24xlarge",
        1,
        4096,
        4,
        {"hybrid_shard_degree": 8},
        True,
    ),
    PublicConfig(
        "Llama 2 70B",
        "[BP]",
        _LLAMA2_70B,
        "p4d.24xlarge",
        32,
        4096,
        2,
        {"hybrid_shard_degree": 256},
        True,
    ),
    PublicConfig(
        "175B (GPT-3-shaped stand-in)",
        "[BP]",
        _GPT3_175B,
        "p4d.24xlarge",
        64,
        4096,
        6,
        {"hybrid_shard_degree": 128, "tensor_parallel_degree": 4, "sm_activation_offloading": True},
        True,
    ),
    PublicConfig(
        "Llama 3 8B seq 8k",
        "[HPR] hf_llama3_8b_seq8k_gpu_p5x16",
        _LLAMA3_8B,
        "p5.48xlarge",
        16,
        8192,
        2,
        {"hybrid_shard_degree": 64, "tensor_parallel_degree": 2, "activation_loading_horizon": 1},
        False,
    ),
    PublicConfig(
        "Llama 3 70B seq 8k",
        "[HPR] hf_llama3_70b_seq8k_gpu_p5x32",
        _LLAMA3_70B,
        "p5.48xlarge",
        32,
        8192,
        2,
        {"hybrid_shard_degree": 256},
        True,
    ),
    PublicConfig(
        "Llama 3 70B seq 16k",
        "[HPR] hf_llama3_70b_seq16k_gpu_p5x32",
        _LLAMA3_70B,
        "p5.48xlarge",
        32,
        16384,
        1,
        {"hybrid_shard_degree": 256, "context_parallel_degree": 2},
        True,
    ),
    PublicConfig(
        "Llama 3 70B seq 8k on p4d",
        "[HPR] p4_hf_llama3_70b_seq8k_gpu",
        _LLAMA3_70B,
        "p4d.24xlarge",
        32,
        8192,
        1,
        {
            "hybrid_shard_degree": 256,
            "sm_activation_offloading": True,
            "activation_loading_horizon": 2,
        },
        True,
    ),
)


@dataclass(frozen=True)
class PublicResult:
    """A published configuration's verdict and predictions."""

    config: PublicConfig
    valid: bool
    reason: str
    fits: bool
    peak: int
    budget: float
    step: float
    tokens_per_second: float


def evaluate_one(pc: PublicConfig) -> PublicResult:
    """Checks ``pc`` with the library's checks and predicts its memory and step time."""
    kwargs: dict[str, Any] = {**pc.model, "tie_word_embeddings": False}
    spec = _spec(tuple(sorted(kwargs.items())))
    host = instance(pc.instance)
    acc = accelerator(host.accelerator)
    cluster = Cluster(
        hosts=pc.nodes,
        per_host=host.per_host,
        accelerator=acc,
        nics=host.nics,
        nic_bits=host.nic_bits,
    )
    smp = pc.smp
    candidate = Candidate(
        hybrid_shard_degree=smp.get("hybrid_shard_degree", 0),
        tensor_parallel_degree=smp.get("tensor_parallel_degree", 1),
        context_parallel_degree=smp.get("context_parallel_degree", 1),
        fsdp=1,  # SMP's scripts and the recipes wrap with FSDP1
        checkpointing=pc.checkpointing,
        offload=smp.get("sm_activation_offloading", False),
        horizon=smp.get("activation_loading_horizon", 2),
    )
    tp, cp = candidate.tensor_parallel_degree, candidate.context_parallel_degree
    dp = cluster.world_size // (tp * cp)
    workload = Workload(pc.seq_len, pc.seq_len * pc.batch * dp, "bfloat16")
    checked = check(candidate, spec, cluster, workload)
    if isinstance(checked, Rejected):
        return PublicResult(pc, False, checked.reason, False, 0, cluster.memory_budget, 0.0, 0.0)
    machine = accelerator_machine(acc, "bfloat16", DEFAULT_EFFICIENCY)
    e = evaluate(spec, checked, cluster, workload, machine)
    return PublicResult(
        pc,
        True,
        "",
        e.fits,
        e.memory.peak,
        cluster.memory_budget,
        e.time.step,
        e.time.tokens_per_second,
    )


def evaluate_all() -> list[PublicResult]:
    """``evaluate_one`` for every published configuration."""
    return [evaluate_one(pc) for pc in CONFIGS]


def _spec(model: tuple[tuple[str, Any], ...]) -> Any:
    """The meta-device ``ModelSpec`` of a Llama config, built once per shape."""
    from transformers import LlamaConfig

    from benchmarks.planner.validation_time import meta_spec

    if model not in _SPECS:
        _SPECS[model] = meta_spec(LlamaConfig(**dict(model)))
    return _SPECS[model]


_SPECS: dict[tuple[tuple[str, Any], ...], Any] = {}


def table(rows: list[PublicResult]) -> str:
    """The docs table (Markdown)."""
    lines = [
        "| configuration | source | cluster | SMP | seq x batch | valid | peak GiB (usable) | "
        "step s | tokens/s | published |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pc = r.config
        smp = ", ".join(f"{k.replace('_degree', '')}={v}" for k, v in pc.smp.items())
        smp += ", ckpt" if pc.checkpointing else ", no ckpt"
        lines.append(
            f"| {pc.name} | {pc.source} | {pc.nodes} x {pc.instance} | {smp} | "
            f"{pc.seq_len} x {pc.batch} | {'yes' if r.valid else 'NO: ' + r.reason} | "
            f"{r.peak / 2**30:.1f} ({r.budget / 2**30:.0f}) | {r.step:.2f} | "
            f"{r.tokens_per_second:,.0f} | {pc.published or 'none'} |"
        )
    return "\n".join(lines)


__all__ = ["CONFIGS", "PublicConfig", "PublicResult", "evaluate_all", "evaluate_one", "table"]
