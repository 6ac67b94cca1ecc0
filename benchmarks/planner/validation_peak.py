"""The predicted peak against the process's own high-water mark, with gradient accumulation.

``python -m benchmarks planner peak`` trains a Llama (hidden 512, 4 layers, sequence 256, 4
sequences per rank) on 2 CPU ranks for two AdamW steps, each case with 1, 2 and 4
micro-batches a step, and compares what the second step adds to the rank's memory at its
highest with what the planner predicts above the model state (its peak less the parameters
and the optimizer state, which live between steps).

Note [Peaks from the resident set]
    CPU tensors have no allocator statistics, but Linux keeps a process's resident-set
    high-water mark (``VmHWM``), which writing ``5`` to ``/proc/self/clear_refs`` resets. With
    glibc's mmap threshold fixed at 64 KiB (``mallopt``; by default it grows after frees and
    keeps later ones in the heap, which does not shrink), every tensor of 64 KiB or more is
    mapped on allocation and unmapped when freed, so the resident set follows them. Each
    rank resets the mark after the first step's ``zero_grad`` (AdamW's state exists from then
    on) and reads it after the second step's backward: the difference is the step's peak
    above what lived between steps (the model state, the Python heap). FSDP1 (with
    ``use_orig_params=True``) keeps each unit's sharded flat gradient after
    ``zero_grad(set_to_none=True)`` until the unit's next forward, which frees it before
    the peak: those bytes are taken out of what lived between steps. Smaller tensors and
    the heap's growth are in it too, a few MB here; the model is sized so that the predicted
    terms are tens of MB and more.
"""

from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass
from typing import Any

import torch

#: How far the measured peak may be from the prediction (relative).
PEAK_TOLERANCE = 0.10
HIDDEN, LAYERS, SEQ, PER_RANK, VOCAB = 512, 4, 256, 4, 256
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@dataclass(frozen=True)
class PeakCase:
    """One layout on 2 ranks.

    Attributes:
        name: Short name for tables.
        hybrid_shard_degree: As in the SMP config (2: one shard group; 1: two replicas).
        fsdp: 1 (``FullyShardedDataParallel``, ``use_orig_params=True``) or 2 (``shard_model``).
        bf16: FSDP mixed precision (bf16 compute and reduction, fp32 parameters).
        per_rank: Sequences each rank trains per step.
        layers: Decoder layers.
        seq: Tokens a sequence holds.
    """

    name: str
    hybrid_shard_degree: int
    fsdp: int = 2
    bf16: bool = False
    per_rank: int = PER_RANK
    layers: int = LAYERS
    seq: int = SEQ


CASES = (
    PeakCase("FSDP2 full shard", 2),
    PeakCase("FSDP2 two replicas", 1),
    PeakCase("FSDP1 full shard", 2, fsdp=1),
    PeakCase("FSDP2 full shard bf16", 2, bf16=True),
    PeakCase("FSDP2 two replicas bf16", 1, bf16=True),
)
STEPS = (1, 2, 4)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )


def measure(case: PeakCase, steps: int) -> int:
    """Bytes a step adds to this rank's resident set at its highest.

    Note [Peaks from the resident set]. Every rank of a 2-rank process group calls it.
    """
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import torch_sagemaker as tsm
    from benchmarks.planner import validation_memory as vm
    from benchmarks.planner.measure import census
    from torch_sagemaker.policies import lookup_policy

    if ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the resident set cannot be read")
    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": case.hybrid_shard_degree})
    torch.manual_seed(0)
    # FSDP as the memory validation wraps it (no checkpointing, no offloading).
    layout = vm.MemoryCase(case.name, "llama", {}, fsdp=case.fsdp, bf16=case.bf16)
    model = LlamaForCausalLM(_config(case.layers))
    model = vm._wrap(model, layout, lookup_policy(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.Generator().manual_seed(dist.get_rank())
    above = 0
    for step in range(2):
        batch = torch.randint(0, VOCAB, (case.per_rank, case.seq), generator=ids)
        if step == 1:
            gc.collect()
            # FSDP1 keeps each unit's sharded flat gradient past zero_grad(set_to_none=True),
            # until the unit's next forward frees it: not model state that lives through the
            # step (Note [Peaks from the resident set]).
            base = _status("VmRSS") - census(model).gradients
            _reset_high_water_mark()
        for i, micro in enumerate(batch.chunk(steps)):
            if case.fsdp == 2:  # the replicas' all-reduce after the last micro-batch only
                model.set_requires_all_reduce(i == steps - 1)
            (model(input_ids=micro, labels=micro).loss / steps).backward()
        if step == 1:
            above = _status("VmHWM") - base
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return above


def estimate(case: PeakCase, steps: int) -> Any:
    """The planner's ``MemoryEstimate`` for rank 0 of ``case`` with ``steps`` micro-batches."""
    from benchmarks.planner.validation_time import meta_spec
    from torch_sagemaker.planner import memory
    from torch_sagemaker.planner.candidates import Candidate, Rejected, check
    from torch_sagemaker.planner.inputs import Cluster, Workload
    from torch_sagemaker.planner.presets import accelerator

    spec = meta_spec(_config(case.layers))
    candidate = Candidate(
        case.hybrid_shard_degree, fsdp=case.fsdp, checkpointing=False, accumulation_steps=steps
    )
    cluster = Cluster(hosts=1, per_host=2, accelerator=accelerator("H100"))
    workload = Workload(
        case.seq, case.seq * case.per_rank * 2, "bfloat16" if case.bf16 else "float32"
    )
    checked = check(candidate, spec, cluster, workload)
    if isinstance(checked, Rejected):
        raise ValueError(f"{case.name}: the planner rejects it: {checked.reason}")
    return memory.estimate(spec, checked, workload)


def predict(case: PeakCase, steps: int) -> int:
    """The planner's peak less the parameters and optimizer state, for rank 0 of ``case``."""
    m = estimate(case, steps)
    return m.peak - m.parameters - m.optimizer


def run_cases(cases: tuple[PeakCase, ...] = CASES, counts: tuple[int, ...] = STEPS) -> list:
    """``[(case name, steps, measured, predicted)]`` on this rank, every case and count."""
    return [(c.name, k, measure(c, k), predict(c, k)) for c in cases for k in counts]


def within(row: tuple) -> bool:
    """Whether a row's prediction is within ``PEAK_TOLERANCE`` of its measurement."""
    _, _, measured, predicted = row
    return abs(predicted - measured) <= PEAK_TOLERANCE * measured


def table(rows: list) -> str:
    """Markdown rows: measured and predicted bytes above the model state, and the error."""
    lines = [
        "| case | micro-batches | measured above state B | predicted B | error |",
        "|---|---|---|---|---|",
    ]
    for name, steps, measured, predicted in rows:
        error = (predicted - measured) / measured
        lines.append(f"| {name} | {steps} | {measured:,} | {predicted:,} | {error:+.1%} |")
    return "\n".join(lines)


__all__ = [
    "CASES",
    "PEAK_TOLERANCE",
    "PeakCase",
    "estimate",
    "measure",
    "predict",
    "run_cases",
    "table",
    "within",
]
