"""Tiny mixture-of-experts models and the parity harness of the expert parallel tests (no
downloads)."""

from __future__ import annotations

import copy
import functools

import torch

VOCAB = 128
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_moe(family: str, seed: int = 0, **overrides):
    """A 2-layer fp32 MoE causal LM with 4 experts, top-2, identical for the same seed."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        use_cache=False,
    )
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=4)
    elif family == "qwen2_moe":
        # Layer 1 is a dense MLP (mlp_only_layers); the sparse block has a gated shared expert.
        cfg = tf.Qwen2MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        )
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=4,
            norm_topk_prob=True,
            head_dim=8,
        )
    elif family == "olmoe":  # no policy: its transformers TP plan (policies/transformers_plan.py)
        cfg = tf.OlmoeConfig(
            **common, intermediate_size=24, num_experts=4, norm_topk_prob=False, head_dim=8
        )
    elif family == "gpt_oss":  # no policy; transformers' plan splits only the embedding, and
        # its EP plan names the experts (biased: gate_up_proj_bias, down_proj_bias)
        cfg = tf.GptOssConfig(
            **common, intermediate_size=24, num_local_experts=4, head_dim=8, sliding_window=8
        )
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():  # Qwen routers start at zero (ties); give them a real routing
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def batch(dp_rank: int, rows: int = 2, seq: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, VOCAB, (rows, seq), generator=g)


def left_padding(ids: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """An attention mask that pads row ``i`` of ``ids`` on the left by ``(i + dp_rank) %
    (seq // 2)`` tokens."""
    mask = torch.ones_like(ids)
    for i in range(ids.shape[0]):
        mask[i, : (i + dp_rank) % (ids.shape[1] // 2)] = 0
    return mask


def layer_class(model):
    from torch_sagemaker.policies import transformer_layer_classes

    (cls,) = transformer_layer_classes(model)  # a policy's model: its one layer class
    return cls


def wrap(model, api: str, mixed_precision: bool = False):
    """FSDP1 exactly as SMP's scripts call it, or FSDP2 through ``shard_model``."""
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

    from benchmarks.smp_fsdp1 import wrap_as_smp
    from torch_sagemaker.sharding import shard_model

    if api == "fsdp2":
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            if mixed_precision
            else None
        )
        return shard_model(model, mp_policy=mp)
    mp = (
        MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.float32
        )
        if mixed_precision
        else None
    )
    strategy = (
        ShardingStrategy.HYBRID_SHARD
        if tsm.state.layout.requested_hybrid_shard_degree
        else ShardingStrategy.FULL_SHARD
    )
    return wrap_as_smp(model, strategy, mp)


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clean(name: str) -> str:
    for part in (
        "_fsdp_wrapped_module.",
        "_checkpoint_wrapped_module.",
        "_offload_wrapped_module.",
    ):
        name = name.replace(part, "")
    return name[len("module.") :] if name.startswith("module.") else name


def dtensor_layouts(model) -> dict[str, tuple]:
    """(mesh, placements, shape, stride) of every DTensor parameter, by Hugging Face name."""
    from torch.distributed.tensor import DTensor

    return {
        clean(n): (p.device_mesh, p.placements, p.shape, p.stride())
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }


def full_grads(model, layouts: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's unsharded gradient under its Hugging Face name.

    ``layouts`` (``dtensor_layouts`` before wrapping): FSDP1 NO_SHARD leaves the gradients of
    tensor-parallel parameters as plain local tensors, even when summoned (Note [FSDP1
    NO_SHARD with DTensor parameters]); they are gathered with their parameter's layout.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    def whole(name: str, grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) or not layouts or name not in layouts:
            return full(grad).detach().clone()
        mesh, placements, shape, stride = layouts[name]
        if grad.shape == shape:
            return grad.detach().clone()
        local = DTensor.from_local(grad, mesh, placements, shape=shape, stride=stride)
        return local.full_tensor().detach().clone()

    units = FSDP.fsdp_modules(model)
    if units:  # summon from the outermost unit (the model may sit inside the offload wrapper)
        with FSDP.summon_full_params(units[0], with_grads=True):
            return {clean(n): whole(clean(n), p.grad) for n, p in model.named_parameters()}
    return {clean(n): whole(clean(n), p.grad) for n, p in model.named_parameters()}


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole value under its Hugging Face name (FSDP1: its full state dict,
    gathered over the TP ranks too)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = FSDP.fsdp_modules(model)
    if not units:
        return {clean(n): full(p).detach().clone() for n, p in model.named_parameters()}
    config = FullStateDictConfig(rank0_only=False, offload_to_cpu=False)
    with FSDP.state_dict_type(units[0], StateDictType.FULL_STATE_DICT, config):
        state = units[0].state_dict()
    names = {clean(n) for n, _ in model.named_parameters()}
    return {clean(k): full(v).detach().clone() for k, v in state.items() if clean(k) in names}


def reference_aux(router_logits, num_experts: int, top_k: int, aux_coeff: float, z_coeff: float):
    """The per-rank auxiliary terms of MoELayer, computed directly from the router logits."""
    total = torch.zeros(())
    for logits in router_logits:
        probs = torch.softmax(logits.float(), -1)
        chosen = torch.topk(probs, top_k, -1).indices
        fraction = (
            torch.stack([(chosen == e).sum() for e in range(num_experts)]).float() / chosen.numel()
        )
        total = total + aux_coeff * num_experts * (fraction * probs.mean(0)).sum()
        total = total + z_coeff * torch.logsumexp(logits.float(), -1).pow(2).mean()
    return total


def first_experts_only_hook(experts, dp_rank):
    """Routes every choice to experts 0 and 1, EP rank 0's at ep 2 of 4 experts.

    DP rank 0 sends all to expert 0; rank 1 half its tokens to expert 1. The other EP rank's
    experts get no token (Note [Experts without a token on this rank]). ``dp_rank()`` says
    whose batch runs.
    """

    def pre(module, args):
        hidden, index, weights = args
        index = torch.zeros_like(index)
        if dp_rank() == 1:
            index[: index.shape[0] // 2] = 1
        return hidden, index, weights

    return experts.register_forward_pre_hook(pre)


def _experts_modules(model) -> list:
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def moe_reference(model, cfg):
    """``model`` (plain, one process) with its sparse blocks replaced by ``MoELayer`` without any
    expert parallelism: the reference for the routing options (Sinkhorn, balanced), which
    Hugging Face's blocks do not have. Each rank's batch then routes as on that rank."""
    from torch_sagemaker.moe.moe_layer import MoELayer
    from torch_sagemaker.policies import lookup_policy

    policy = lookup_policy(model)
    spec = policy.moe
    for name, block in [
        (n, m) for n, m in model.named_modules() if type(m).__name__ == spec.block_class
    ]:
        layer = MoELayer(
            block,
            spec,
            cfg,
            num_experts=policy.num_experts(model.config),
            top_k=spec.top_k(model.config),
            normalize=spec.normalize(model.config),
            shuffle=None,
        )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    return model


def parity_case(
    family: str,
    api: str,
    moe_kwargs: dict,
    steps: int = 2,
    checkpoint: str | None = None,
    offload: bool = False,
    router_logits: bool = True,
    moe_ref: bool = False,
    microbatches: int = 1,
    mask: bool = False,
    rows: tuple[int, ...] | None = None,
    implementation: str | None = None,
    first_experts_only: bool = False,
    foreach: bool | None = None,
) -> dict:
    """One expert parallel run against one process on the concatenated batch (run on every rank).

    Returns per step the max differences of the loss, the router logits, every gradient and the
    gradient norm (``tsm.grad_norm.clip_grad_norm_`` against PyTorch's on the reference), and
    every parameter's after the last AdamW step (``params``).
    ``router_logits=False`` runs without ``output_router_logits`` (the model's loss then has
    no Hugging Face auxiliary loss).
    ``moe_ref=True`` makes the reference's blocks ``MoELayer`` without expert parallelism
    (``moe_reference``), for the routing options; it adds its own auxiliary terms.
    ``microbatches=2`` runs two forwards (other batches) and one backward of their summed
    losses per step, as gradient accumulation in one graph does. ``mask=True`` pads the rows
    on the left (``left_padding``; the labels ignore the padding), which Hugging Face's
    auxiliary loss then leaves out; ``rows`` gives each DP rank's batch rows (2 by default).
    ``implementation`` sets ``config._experts_implementation`` (e.g. ``"eager"``);
    ``first_experts_only=True`` overrides every choice (``first_experts_only``), in the model
    and the reference alike, so the last EP rank's experts get no token.
    ``foreach=True``: both AdamWs take their list (``foreach``) path, CUDA's default.
    """
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.grad_norm import clip_grad_norm_
    from torch_sagemaker.moe import set_aux_loss_scale
    from torch_sagemaker.moe.moe_config import MoEConfig

    cfg = MoEConfig(**moe_kwargs)
    dp_rank, dp_size = tsm.state.dp_rank, tsm.state.dp_size

    def inputs(d: int, m: int) -> dict:
        ids = batch(d + m * dp_size, rows=rows[d] if rows else 2)
        if not mask:
            return {"input_ids": ids, "labels": ids}
        attention = left_padding(ids, d)
        return {
            "input_ids": ids,
            "attention_mask": attention,
            "labels": ids.masked_fill(attention == 0, -100),
        }

    # batches[m][d]: micro-batch m of DP rank d (micro-batch 0 is batch(d)).
    batches = [[inputs(d, m) for d in range(dp_size)] for m in range(microbatches)]
    ref = tiny_moe(family)
    if implementation:
        ref.config._experts_implementation = implementation
    model = tsm.transform(copy.deepcopy(ref), config=cfg)
    routed = {"dp_rank": dp_rank}  # whose batch the reference runs
    if first_experts_only:
        for experts in _experts_modules(model):
            first_experts_only_hook(experts, lambda: dp_rank)
    if moe_ref:
        ref = moe_reference(ref, cfg)
    if first_experts_only:
        for experts in _experts_modules(ref):
            first_experts_only_hook(experts, lambda: routed["dp_rank"])
    if checkpoint:
        apply_checkpointing(model, checkpoint)
    layouts = dtensor_layouts(model)
    model = wrap(model, api)
    if offload:
        model = tsm.offload_wrapper(model)
    num_experts, top_k = 4, 2
    aux_coeff = (
        cfg.moe_aux_loss_coeff if cfg.moe_load_balancing == "aux_loss" and not moe_ref else 0.0
    )
    z_coeff = cfg.moe_z_loss_coeff if cfg.smp_moe and not moe_ref else 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=foreach)
    out = {"loss": [], "ref_loss": [], "logits": [], "grads": [], "norm": [], "grad_scale": []}
    for _ in range(steps):
        res = [model(**b[dp_rank], output_router_logits=router_logits) for b in batches]
        sum(r.loss for r in res).backward()
        ref_opt.zero_grad()
        # The reference divides each rank's loss by dp_size before backward, so MoELayer's
        # attached aux terms take the same factor (Note [Auxiliary losses in backward]).
        set_aux_loss_scale(1.0 / dp_size)
        ref_loss, logits_diff = 0.0, 0.0
        for m, micro in enumerate(batches):
            for d, ref_inputs in enumerate(micro):
                routed["dp_rank"] = d
                r = ref(**ref_inputs, output_router_logits=True)
                aux = reference_aux(r.router_logits, num_experts, top_k, aux_coeff, z_coeff)
                loss = (
                    r.loss if router_logits else r.loss - r.aux_loss * ref.router_aux_loss_coef
                ) + aux
                (loss / dp_size).backward()
                if d == dp_rank:
                    ref_loss += float(loss.detach()) - float(aux.detach())
                    if router_logits:
                        logits_diff = max(
                            logits_diff,
                            *(
                                float((a - b).abs().max())
                                for a, b in zip(res[m].router_logits, r.router_logits, strict=True)
                            ),
                        )
        out["ref_loss"].append(ref_loss)
        out["logits"].append(logits_diff)
        set_aux_loss_scale(1.0)
        grads = full_grads(model, layouts)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
        out["grads"].append({n: float((g - ref_grads[n]).abs().max()) for n, g in grads.items()})
        out["grad_scale"].append(
            min(float(g.abs().max()) for n, g in ref_grads.items() if "experts" in n)
        )
        norm = clip_grad_norm_(model, 1e9)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        out["norm"].append(abs(float(norm) - float(ref_norm)))
        out["loss"].append(sum(float(r.loss) for r in res))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    params = full_params(model)
    ref_params = dict(ref.named_parameters())
    assert params.keys() == ref_params.keys(), sorted(set(params) ^ set(ref_params))
    out["params"] = {n: float((p - ref_params[n]).abs().max()) for n, p in params.items()}
    out["local_experts"] = sorted(
        {
            tuple(p.to_local().shape)
            for n, p in model.named_parameters()
            if "experts." in n and hasattr(p, "to_local")
        }
    )
    out["world"] = dist.get_world_size()
    return out


def apply_checkpointing(model, target: str) -> None:
    """Activation checkpointing on every decoder layer (``"layer"``: reentrant, as SMP's scripts
    without FP8) or on every MoELayer (``"moe"``: non-reentrant, as SMP's MoE + FP8 path)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from torch_sagemaker.moe.moe_layer import MoELayer

    cls = MoELayer if target == "moe" else layer_class(model)
    impl = CheckpointImpl.NO_REENTRANT if target == "moe" else CheckpointImpl.REENTRANT
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, cls),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
    )


def run_cases(cases: list[tuple]) -> dict:
    """``parity_case`` for each (name, family, api, moe_kwargs, extra, smp_config).

    Consecutive cases with the same SMP config share one ``tsm.init`` (``layout_for``).
    """
    from tests.distributed.test_delayed_param import layout_for

    results, current = {}, None
    for name, family, api, moe_kwargs, extra, smp_config in cases:
        current = layout_for(smp_config, current)
        results[name] = parity_case(family, api, moe_kwargs, **extra)
    return results


def check(results: dict, atol: float = 2e-5) -> None:
    for name, r in results.items():
        for step, (loss, ref_loss) in enumerate(zip(r["loss"], r["ref_loss"], strict=True)):
            assert abs(loss - ref_loss) < 1e-4, (name, step, r["loss"], r["ref_loss"])
        # Step 0 compares the same weights; later steps compare after AdamW updates whose fp32
        # rounding differences (normalized by Adam) grow with the logits' magnitude.
        assert r["logits"][0] < atol and max(r["logits"]) < 5 * atol, (name, r["logits"])
        assert max(r["norm"]) < 1e-4, (name, r["norm"])
        assert min(r["grad_scale"]) > 1e-5, (name, "expert gradients are trivially zero")
        for step, grads in enumerate(r["grads"]):
            bad = {n: d for n, d in grads.items() if d > atol}
            assert not bad, (name, step, bad)
        # After the last step. AdamW (lr 1e-2) divides each gradient by its running RMS, so an
        # element whose gradient is small against the fp32 differences allowed above moves by
        # up to lr * atol / |grad| more or less than the reference's: with ATen limited to AVX2
        # kernels one Mixtral expert element ended 1.45e-4 off. A misplaced or missed update
        # moves elements by about lr per step, 20x this limit.
        bad = {n: d for n, d in r["params"].items() if d > 5e-4}
        assert not bad, (name, "params", bad)
