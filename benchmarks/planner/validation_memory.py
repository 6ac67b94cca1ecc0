"""The memory model against a real step: each case trained on spawned CPU ranks and counted.

``CASES`` cover the layouts the library runs on 2 to 8 CPU ranks (full and hybrid sharding,
TP, CP, EP, FSDP1 and FSDP2, checkpointing, offloading, float32 and bf16 mixed precision) on
four model families: dense Llama (multi-head), Qwen2 (grouped-query attention, tied
embeddings), Mixtral (MoE: its own block split over TP, and ``MoELayer`` over EP) and
GPT-NeoX. ``run_cases`` runs on every rank of a job (``tests/distributed/launcher.py``'s
``run_distributed`` in the tests, ``validation.main`` otherwise), each SMP config's cases
under one ``tsm.init``; ``run_case`` builds the tiny model, applies
``tsm.transform``/checkpointing/FSDP/offloading as a script does, trains
two steps with AdamW, and returns what ``measure`` counted next to what the planner predicts
for that rank:

- parameters, gradients, optimizer state: after the second step's optimizer step (gradients
  still held); must match to the byte;
- saved activations: the second forward's, counted by ``measure.SavedActivations``; with
  offloading, the offload engine's own peak of resident layer storages against the
  predicted resident layers. Within ``ACTIVATION_TOLERANCE``; for expert parallelism the
  mean over the ranks (routing decides how many rows each rank receives; their mean is what
  the tokens chose).

FSDP1 with TP is checked for model state only: its root unit stays unsharded through the
forward and autograd saves DTensor views of it, which the hook cannot tell from activations
(docs/planner_validation.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

#: How far saved activations may be from the prediction (relative).
ACTIVATION_TOLERANCE = 0.10
SEQ = 16
BATCH = 2  # sequences per data-parallel rank
VOCAB = 128


@dataclass(frozen=True)
class MemoryCase:
    """One layout to train and count.

    Attributes:
        name: Short name for tables.
        family: ``llama``, ``qwen2``, ``mixtral`` or ``gpt_neox`` (``tiny_config``).
        smp: The SMP config.
        fsdp: 1 or 2.
        checkpointing: Activation checkpointing.
        offload: ``offload_wrapper`` (with ``activation_loading_horizon`` from ``smp``).
        moe: ``tsm.transform(config=MoEConfig())``.
        bf16: FSDP mixed precision (bf16 compute and reduction, fp32 parameters).
        layers: Transformer layers.
        overrides: Config attributes to change.
    """

    name: str
    family: str
    smp: dict[str, Any]
    fsdp: int = 2
    checkpointing: bool = False
    offload: bool = False
    moe: bool = False
    bf16: bool = False
    layers: int = 2
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def checks_activations(self) -> bool:
        """Whether the hook's count is comparable (module docstring: not FSDP1 with TP)."""
        return not (self.fsdp == 1 and self.smp.get("tensor_parallel_degree", 1) > 1)


#: The cases of the validation (4 ranks each).
CASES: tuple[MemoryCase, ...] = (
    MemoryCase("llama full shard", "llama", {"hybrid_shard_degree": 4}),
    MemoryCase("llama hsd2 FSDP1 bf16", "llama", {"hybrid_shard_degree": 2}, fsdp=1, bf16=True),
    MemoryCase("qwen2 tp2 hsd2", "qwen2", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}),
    MemoryCase(
        "qwen2 tp2 hsd2 ckpt",
        "qwen2",
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2},
        checkpointing=True,
    ),
    MemoryCase(
        "qwen2 tp2 no-shard FSDP1",
        "qwen2",
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1},
        fsdp=1,
    ),
    MemoryCase("llama cp2 hsd2", "llama", {"context_parallel_degree": 2, "hybrid_shard_degree": 2}),
    MemoryCase(
        "mixtral ep2 MoELayer",
        "mixtral",
        {"expert_parallel_degree": 2, "hybrid_shard_degree": 2},
        moe=True,
    ),
    MemoryCase(
        "mixtral tp2 experts", "mixtral", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
    ),
    MemoryCase(
        "mixtral ep2 FSDP1",
        "mixtral",
        {"expert_parallel_degree": 2, "hybrid_shard_degree": 0},
        fsdp=1,
        moe=True,
    ),
    MemoryCase(
        "gpt_neox hsd4 FSDP1 bf16", "gpt_neox", {"hybrid_shard_degree": 4}, fsdp=1, bf16=True
    ),
    # Families whose policy comes from transformers' TP plan, with activations the planner
    # measures on reduced copies (torch_sagemaker/planner/probe.py).
    MemoryCase(
        "qwen3 tp2 hsd2 (probed)", "qwen3", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
    ),
    MemoryCase(
        "phi3 tp2 hsd2 bf16 (probed)",
        "phi3",
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2},
        bf16=True,
    ),
    MemoryCase(
        "gemma3 tp2 sliding (probed)",
        "gemma3_text",
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2},
    ),
    # A shipped plan on transformers' Conv1D, its packed [q | k | v] split block by block;
    # with GPT-2's default dropout (0.1 everywhere).
    MemoryCase(
        "gpt2 tp2 hsd2 (probed)",
        "gpt2",
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2},
    ),
    MemoryCase(
        "llama offload h1",
        "llama",
        {"hybrid_shard_degree": 4, "activation_loading_horizon": 1},
        checkpointing=True,
        offload=True,
        layers=4,
    ),
    MemoryCase(
        "llama offload h2",
        "llama",
        {"hybrid_shard_degree": 4, "activation_loading_horizon": 2},
        checkpointing=True,
        offload=True,
        layers=4,
    ),
)


def tiny_config(family: str, layers: int = 2, **overrides: Any) -> Any:
    """A tiny Hugging Face config: hidden 64, 4 heads, vocab 128.

    Llama, Qwen2, Mixtral, GPT-NeoX, Qwen3, Phi-3 and Gemma 3 as the cases need them, without
    dropout; any other ``model_type`` as transformers builds it with these sizes (2
    key/value heads) and its own dropout rates (BERT's, OPT's and GPT-2's are 0.1).
    """
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    cfg: Any
    if family == "llama":  # multi-head attention
        cfg = tf.LlamaConfig(**common, num_key_value_heads=4)
    elif family == "qwen2":  # grouped-query attention, tied head
        cfg = tf.Qwen2Config(**{**common, "tie_word_embeddings": True}, num_key_value_heads=2)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        )
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(**common, hidden_dropout=0.0)
    elif family == "qwen3":  # per-head query and key norms
        cfg = tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16)
    elif family == "phi3":  # fused QKV and gate/up projections
        cfg = tf.Phi3Config(
            **common, num_key_value_heads=2, pad_token_id=None, eos_token_id=None, resid_pdrop=0.0
        )
    elif family == "gemma3_text":  # a window shorter than SEQ: masked attention, 2 rotary bases
        cfg = tf.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=16, sliding_window=8)
    else:  # any other family: transformers' config with the same sizes
        from transformers import AutoConfig

        from torch_sagemaker.planner.model import mlp_size_attr

        default = AutoConfig.for_model(family)
        known = {k: v for k, v in common.items() if hasattr(default, k)}
        mlp_attr = mlp_size_attr(default)  # OPT's ffn_dim, BART's decoder_ffn_dim
        if mlp_attr:
            known[mlp_attr] = common["intermediate_size"]
        cfg = AutoConfig.for_model(family, **known, num_key_value_heads=2)
        for attr in [a for a in vars(cfg) if a.endswith("_token_id")]:
            value = getattr(cfg, attr)
            if isinstance(value, int) and value >= VOCAB:
                setattr(cfg, attr, 0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _wrap(model: Any, case: MemoryCase, policy: Any) -> Any:
    from torch.distributed.fsdp import (
        FullyShardedDataParallel,
        MixedPrecision,
        MixedPrecisionPolicy,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import torch_sagemaker as tsm
    from torch_sagemaker.sharding import checkpoint_transformer_layers, shard_model

    if case.checkpointing:
        checkpoint_transformer_layers(model)
    bf16 = torch.bfloat16
    if case.fsdp == 2:
        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) if case.bf16 else None
        model = shard_model(model, mp_policy=mp)
    else:
        mp1 = (
            MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=torch.float32)
            if case.bf16
            else None
        )
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({policy.layer_cls(model)}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
            mixed_precision=mp1,
        )
    if case.offload:
        model = tsm.offload_wrapper(model)
    return model


def _batch(rank: int, tp: int, cp: int) -> torch.Tensor:
    from torch_sagemaker.context_parallel.layout import split_local

    dp_rank = rank // (tp * cp)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(dp_rank))
    return split_local(ids, (rank // tp) % cp, cp) if cp > 1 else ids


def predict(
    case: MemoryCase, spec: Any, world: int, rank: int, profile: Any = None
) -> dict[str, int]:
    """What the planner predicts for ``rank`` of ``case`` on ``world`` ranks (one host)."""
    from torch_sagemaker.planner import activations, shards
    from torch_sagemaker.planner.candidates import Candidate, Rejected, check
    from torch_sagemaker.planner.inputs import Cluster, Workload
    from torch_sagemaker.planner.memory import activation_shape, sharding
    from torch_sagemaker.planner.presets import accelerator
    from torch_sagemaker.planner.probe import with_activations

    if profile is not None and spec.policy.activations is None:  # measured by the caller
        spec = dataclasses.replace(
            spec, policy=dataclasses.replace(spec.policy, activations=profile)
        )
    spec = with_activations(spec)
    smp = case.smp
    candidate = Candidate(
        hybrid_shard_degree=smp.get("hybrid_shard_degree", 0),
        tensor_parallel_degree=smp.get("tensor_parallel_degree", 1),
        context_parallel_degree=smp.get("context_parallel_degree", 1),
        expert_parallel_degree=smp.get("expert_parallel_degree", 1),
        fsdp=case.fsdp,
        checkpointing=case.checkpointing,
        offload=case.offload,
        horizon=smp.get("activation_loading_horizon", 2),
        moe=case.moe,
    )
    cluster = Cluster(hosts=1, per_host=world, accelerator=accelerator("H100"))
    tp, cp = candidate.tensor_parallel_degree, candidate.context_parallel_degree
    workload = Workload(
        SEQ, SEQ * BATCH * world // (tp * cp), "bfloat16" if case.bf16 else "float32"
    )
    checked = check(candidate, spec, cluster, workload)
    if isinstance(checked, Rejected):
        raise ValueError(f"{case.name}: the planner rejects it: {checked.reason}")
    state = shards.state_bytes(spec, sharding(spec, checked, workload, rank))
    act = activations.activation_bytes(
        spec,
        activation_shape(checked, workload, rank),
        checkpointing=case.checkpointing,
        offload=case.offload,
        horizon=candidate.horizon,
    )
    return {
        "parameters": state.parameters,
        "gradients": state.gradients,
        "optimizer": state.optimizer,
        "activations": act.layers if case.offload else act.saved,
    }


def run_case(case: MemoryCase, profile: Any = None, init: bool = True) -> dict[str, Any]:
    """Trains ``case`` on this rank's job (a process group exists) and counts; see the module.

    ``init=False``: under the ``tsm.init`` in place, which must be ``case.smp``'s, and left
    in place after (``run_cases``).

    Returns:
        ``{"measured": {...}, "predicted": {...}}`` for this rank, with the keys
        ``parameters``, ``gradients``, ``optimizer`` and ``activations``.
    """
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import torch_sagemaker as tsm
    from benchmarks.planner import measure
    from torch_sagemaker.moe.moe_config import MoEConfig
    from torch_sagemaker.offload import get_stats
    from torch_sagemaker.planner.model import describe, model_class
    from torch_sagemaker.planner.probe_attention import FusedAttention
    from torch_sagemaker.policies import lookup_policy

    rank, world = dist.get_rank(), dist.get_world_size()
    if init:
        tsm.state.reset()
        tsm.init(case.smp)
    elif not tsm.state.initialized:
        raise RuntimeError(f"{case.name}: run_case(init=False) needs tsm.init(case.smp) first")
    torch.manual_seed(0)
    config = tiny_config(case.family, case.layers, **case.overrides)
    # SDPA where the family supports it, else eager, as the planner's probe runs it.
    sdpa = getattr(model_class(config), "_supports_sdpa", False)
    attention = "sdpa" if sdpa else "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).float()
    policy = lookup_policy(model)
    spec = describe(model, policy)
    model = tsm.transform(model, config=MoEConfig() if case.moe else None)
    model = _wrap(model, case, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _batch(rank, tsm.state.tp_size, tsm.state.cp_size)
    for step in range(2):
        if case.offload and step == 1:
            get_stats(model, reset=True)  # the second step's peak only
        counter = measure.SavedActivations(model)
        with counter, FusedAttention():  # the kernel the probe assumes (its Note)
            loss = model(input_ids=ids, labels=ids).loss
        saved = counter.bytes
        loss.backward()
        optimizer.step()
        if step == 0:
            optimizer.zero_grad(set_to_none=True)
    counted = measure.census(model, optimizer)
    if case.offload:
        saved = get_stats(model).peak_resident_bytes
    measured = {
        "parameters": counted.parameters,
        "gradients": counted.gradients,
        "optimizer": counted.optimizer,
        "activations": saved,
    }
    result = {"measured": measured, "predicted": predict(case, spec, world, rank, profile)}
    if init:
        tsm.state.reset()
    return result


def run_cases(
    cases: tuple[MemoryCase, ...] = CASES, profiles: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """``run_case`` for each case (every rank calls it); the results in ``cases``' order.

    The cases of one SMP config run one after another under one ``tsm.init``, as models
    built in turn in a job do: its groups stay, and so do DTensor's sharding caches, which a
    reset empties (what is counted does not depend on them). ``profiles``
    (``probed_profiles``) saves every rank measuring the same families again.
    """
    import torch_sagemaker as tsm

    configs: list[dict[str, Any]] = []
    for case in cases:
        if case.smp not in configs:
            configs.append(case.smp)
    results: dict[int, dict[str, Any]] = {}
    for config in configs:
        tsm.state.reset()
        tsm.init(config)
        for i, case in enumerate(cases):
            if case.smp == config:
                results[i] = run_case(case, (profiles or {}).get(case.family), init=False)
    tsm.state.reset()
    return [results[i] for i in range(len(cases))]


def probed_profiles(cases: tuple[MemoryCase, ...] = CASES) -> dict[str, Any]:
    """The measured ``ActivationProfile`` of each case's family whose policy has none.

    The probe's result depends on the family's config and plan, not on the layout, so one
    process measures it for every rank (``run_cases``).
    """
    from transformers import AutoModelForCausalLM

    from torch_sagemaker.planner.model import describe
    from torch_sagemaker.planner.probe import probe_activations
    from torch_sagemaker.policies import lookup_policy

    profiles = {}
    for case in cases:
        if case.family in profiles:
            continue
        config = tiny_config(case.family, case.layers, **case.overrides)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        spec = describe(model, lookup_policy(model))
        if spec.policy.activations is None:
            profiles[case.family] = probe_activations(spec)
    return profiles


def compare(case: MemoryCase, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's verdict from every rank's result.

    Returns:
        ``{"state_exact": bool, "state": [(rank, key, measured, predicted)...] mismatches,
        "activations": (measured, predicted, error) or None, "within": bool}``; activations
        are rank 0's, or the mean over ranks with expert parallelism.
    """
    mismatches = [
        (r, key, res["measured"][key], res["predicted"][key])
        for r, res in enumerate(per_rank)
        for key in ("parameters", "gradients", "optimizer")
        if res["measured"][key] != res["predicted"][key]
    ]
    activations = None
    within = True
    if case.checks_activations:
        if case.smp.get("expert_parallel_degree", 1) > 1:
            measured = sum(r["measured"]["activations"] for r in per_rank) / len(per_rank)
            predicted = sum(r["predicted"]["activations"] for r in per_rank) / len(per_rank)
        else:
            measured = per_rank[0]["measured"]["activations"]
            predicted = per_rank[0]["predicted"]["activations"]
        error = predicted / measured - 1 if measured else float("inf")
        activations = (measured, predicted, error)
        within = abs(error) <= ACTIVATION_TOLERANCE
    return {
        "state_exact": not mismatches,
        "state": mismatches,
        "activations": activations,
        "within": within,
    }


def table(cases: tuple[MemoryCase, ...], verdicts: list[dict[str, Any]], per_rank0: list) -> str:
    """The validation table (Markdown): model state exact or not, activations and error."""
    lines = [
        "| case | FSDP | ckpt | offload | params B | grads B | optim B | state exact | "
        "activations measured B | predicted B | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, verdict, r0 in zip(cases, verdicts, per_rank0, strict=True):
        m = r0["measured"]
        act = verdict["activations"]
        act_cells = (
            f"{act[0]:,.0f} | {act[1]:,.0f} | {act[2]:+.1%}"
            if act
            else "not compared (FSDP1 + TP) | | "
        )
        lines.append(
            f"| {case.name} | {case.fsdp} | {'yes' if case.checkpointing else 'no'} | "
            f"{'h=' + str(case.smp.get('activation_loading_horizon', 2)) if case.offload else 'no'}"
            f" | {m['parameters']:,} | {m['gradients']:,} | {m['optimizer']:,} | "
            f"{'yes' if verdict['state_exact'] else 'NO'} | {act_cells} |"
        )
    return "\n".join(lines)


__all__ = [
    "ACTIVATION_TOLERANCE",
    "CASES",
    "MemoryCase",
    "compare",
    "predict",
    "run_case",
    "probed_profiles",
    "run_cases",
    "table",
    "tiny_config",
]
