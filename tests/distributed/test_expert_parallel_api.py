"""Expert parallelism: errors for bad input, bf16 mixed precision with an fp32 router, delayed
init as SMP's scripts do it, rank-0 loading, and the recomputation rule of the token shuffle."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.distributed import moe_models as mm
from tests.distributed.launcher import run_distributed


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs():
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.distributed.hf_models import tiny_llama
    from torch_sagemaker.moe.moe_config import MoEConfig
    from torch_sagemaker.sharding import shard_model

    out = {}
    tsm.init({"expert_parallel_degree": 2})
    out["indivisible"] = _error(
        lambda: tsm.transform(mm.tiny_moe("mixtral", num_local_experts=3), config=MoEConfig())
    )
    out["no_config"] = _error(lambda: tsm.transform(mm.tiny_moe("mixtral")))
    out["fsdp1_untransformed"] = _error(
        lambda: FSDP(mm.tiny_moe("mixtral"), device_id=torch.device("cpu"))
    )
    out["fsdp2_untransformed"] = _error(lambda: shard_model(mm.tiny_moe("qwen3_moe")))
    out["dense"] = _error(lambda: tsm.transform(tiny_llama(), config=MoEConfig()))
    out["wrong_type"] = _error(
        lambda: tsm.transform(mm.tiny_moe("mixtral"), config={"smp_moe": True})
    )
    out["unknown_option"] = _error(lambda: MoEConfig(moe_load_balancing="switch"))
    split = tsm.transform(mm.tiny_moe("mixtral"), config=MoEConfig())
    out["ddp"] = _error(lambda: DDP(split))
    out["ddp_dp_group"] = _error(lambda: DDP(split, process_group=tsm.state.dp_process_group))
    out["ddp_dense"] = _error(lambda: DDP(tiny_llama()))
    tsm.state.reset()
    tsm.init({"tensor_parallel_degree": 2})
    # Mixtral's plan splits its experts over the TP ranks; Qwen3-MoE's policy has no TP plan.
    out["with_tp"] = _error(lambda: tsm.transform(mm.tiny_moe("mixtral"), config=MoEConfig()))
    out["with_tp_no_plan"] = _error(
        lambda: tsm.transform(mm.tiny_moe("qwen3_moe"), config=MoEConfig())
    )
    tsm.state.reset()
    out["ep_tp_config"] = _error(
        lambda: tsm.init({"expert_parallel_degree": 2, "tensor_parallel_degree": 2})
    )
    return out


@pytest.mark.distributed
def test_bad_input_gets_clear_errors():
    out = run_distributed(_bad_inputs, world_size=2, timeout=300)[0]
    assert (
        "expert_parallel_degree=2 does not divide" in out["indivisible"]
        and "num_local_experts=3" in out["indivisible"]
        and "[1, 3]" in out["indivisible"]
    ), out["indivisible"]
    assert "needs tsm.transform(model, config=MoEConfig" in out["no_config"], out["no_config"]
    for key in ("fsdp1_untransformed", "fsdp2_untransformed"):
        assert (
            "has no experts split" in out[key]
            and "tsm.transform(model, config=MoEConfig" in out[key]
        ), out[key]
    assert "dense model" in out["dense"] and "config=None" in out["dense"], out["dense"]
    assert out["wrong_type"].startswith("TypeError") and "MoEConfig" in out["wrong_type"], out[
        "wrong_type"
    ]
    assert "moe_load_balancing='switch'" in out["unknown_option"], out["unknown_option"]
    # Note [DDP and DTensor parameters]: refused before DDP's own DTensor error.
    for key in ("ddp", "ddp_dp_group"):
        assert (
            out[key].startswith("ValueError: DistributedDataParallel(MixtralForCausalLM)")
            and "model.layers.0.mlp.experts" in out[key]
            and "same experts" in out[key]
            and "shard_model" in out[key]
        ), out[key]
    assert out["ddp_dense"] == "no error", out["ddp_dense"]
    assert out["with_tp"] == "no error", out["with_tp"]
    assert (
        "tensor_parallel_degree=2" in out["with_tp_no_plan"]
        and "does not split the experts" in out["with_tp_no_plan"]
    ), out["with_tp_no_plan"]
    assert "not compatible with tensor parallelism" in out["ep_tp_config"], out["ep_tp_config"]


def _mixed_precision(apis):
    """bf16 mixed precision: the router runs on fp32 weights and input, the experts in bf16."""
    import torch.sagemaker as tsm

    from torch_sagemaker.moe.moe_config import MoEConfig

    results = {}
    for api in apis:
        tsm.state.reset()
        tsm.init({"expert_parallel_degree": 2})
        ref = mm.tiny_moe("mixtral")
        model = tsm.transform(copy.deepcopy(ref), config=MoEConfig(moe_load_balancing="none"))
        seen = {}

        def router_hook(module, args, output, seen=seen):
            seen["router"] = (module.weight.dtype, args[0].dtype, output[0].dtype)

        def experts_hook(module, args, output, seen=seen):
            seen["experts"] = (args[0].dtype, output.dtype)

        layer = model.model.layers[0].mlp
        layer.gate.register_forward_hook(router_hook)
        layer.experts.register_forward_hook(experts_hook)
        wrapped = mm.wrap(model, api, mixed_precision=True)
        ids = mm.batch(tsm.state.dp_rank)
        out = wrapped(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        expected = ref(input_ids=ids, labels=ids, output_router_logits=True)
        results[api] = dict(
            seen=seen,
            logits_dtype=out.router_logits[0].dtype,
            loss=float(out.loss),
            ref_loss=float(expected.loss),
            grads_finite=all(
                torch.isfinite(mm.full(p.grad)).all()
                for p in wrapped.parameters()
                if p.grad is not None
            ),
        )
    return results


@pytest.mark.distributed
def test_router_stays_fp32_under_bf16_mixed_precision():
    for results in run_distributed(_mixed_precision, ["fsdp1", "fsdp2"], world_size=2, timeout=300):
        for api, r in results.items():
            assert r["seen"]["router"] == (torch.float32,) * 3, (api, r["seen"])
            assert r["seen"]["experts"] == (torch.bfloat16, torch.bfloat16), (api, r["seen"])
            assert r["logits_dtype"] == torch.float32, api
            assert abs(r["loss"] - r["ref_loss"]) < 0.05 and r["grads_finite"], (api, r)


def _delayed_init_smp_style():
    """SMP's pattern: meta model, transform under init_empty_weights, FSDP1 with param_init_fn."""
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from torch_sagemaker.delayed_param import DelayedParamIniter
    from torch_sagemaker.moe.moe_config import MoEConfig

    results = {}
    # The last layout: an MoEConfig with TP (Note [Transform under init_empty_weights]).
    for smp in (
        {"expert_parallel_degree": 2},
        {"expert_parallel_degree": 1},
        {"tensor_parallel_degree": 2},
    ):
        tsm.state.reset()
        tsm.init(smp)
        with init_empty_weights():
            model = mm.tiny_moe("mixtral")
        with init_empty_weights():
            model = tsm.transform(model, config=MoEConfig(moe_load_balancing="none"))
        initer = DelayedParamIniter(model, seed=7)
        policy = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={mm.layer_class(model)}
        )
        with initer.validate_params_and_buffers_inited():
            fsdp = FSDP(
                model,
                auto_wrap_policy=policy,
                device_id=torch.device("cpu"),
                use_orig_params=True,
                param_init_fn=initer.get_param_init_fn(),
                post_param_init_fn=initer.get_post_param_init_fn(),
            )
        ids = mm.batch(tsm.state.dp_rank)
        loss = fsdp(input_ids=ids, labels=ids).loss
        loss.backward()
        with FSDP.state_dict_type(
            fsdp,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False, offload_to_cpu=False),
        ):
            params = {
                k: mm.full(v).clone() for k, v in fsdp.state_dict().items() if "rotary" not in k
            }
        results["tp2" if "tensor_parallel_degree" in smp else smp["expert_parallel_degree"]] = (
            params,
            float(loss),
        )
    return results


@pytest.mark.distributed
def test_delayed_init_as_smp_scripts_do_it():
    for results in run_distributed(_delayed_init_smp_style, world_size=2, timeout=300):
        ep2, ep1, tp2 = results[2][0], results[1][0], results["tp2"][0]
        assert ep2.keys() == ep1.keys() == tp2.keys()
        experts = ep2["model.layers.0.mlp.experts.gate_up_proj"]
        assert experts.shape == (4, 96, 32)
        assert abs(float(experts.std()) - 0.02) < 0.003  # initializer_range
        for name, value in ep2.items():  # layout-independent initialization
            torch.testing.assert_close(value, ep1[name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(tp2[name], ep1[name], rtol=0, atol=0, msg=name)
        assert torch.isfinite(torch.tensor([results[k][1] for k in results])).all()


def _rank0_loading():
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights

    from torch_sagemaker.moe.moe_config import MoEConfig

    tsm.init({"expert_parallel_degree": 2})
    ref = mm.tiny_moe("qwen2_moe", seed=3)
    if dist.get_rank() == 0:
        model = copy.deepcopy(ref)
        model = tsm.transform(
            model, config=MoEConfig(moe_load_balancing="none"), load_state_dict_from_rank0=True
        )
    else:
        with init_empty_weights():
            model = mm.tiny_moe("qwen2_moe", seed=99)
            model = tsm.transform(
                model, config=MoEConfig(moe_load_balancing="none"), load_state_dict_from_rank0=True
            )
    diffs = {
        n: float((mm.full(p) - dict(ref.named_parameters())[n]).abs().max())
        for n, p in model.named_parameters()
    }
    return max(diffs.values())


@pytest.mark.distributed
def test_load_state_dict_from_rank0():
    assert run_distributed(_rank0_loading, world_size=2, timeout=300) == [0.0, 0.0]


def _generate_until_every_rank_is_done() -> dict:
    """EP 2 without FSDP (inference): each rank decodes its own prompt, and the EOS token is
    rank 0's first greedy token, so rank 0 is done after one step while rank 1 goes on
    (Note [Generation with experts on other ranks]; it hung)."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.moe.moe_config import MoEConfig

    tsm.init({"expert_parallel_degree": 2})
    ref = mm.tiny_moe("mixtral").eval()
    prompts = [mm.batch(d, rows=1, seq=6) for d in range(2)]
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eos = int(ref.generate(prompts[0], **greedy)[0, 6])
        model = tsm.transform(copy.deepcopy(ref), config=MoEConfig(moe_load_balancing="none"))
        model.eval()
        mine = prompts[dist.get_rank()]
        got = model.generate(mine, eos_token_id=eos, **greedy)
        want = ref.generate(mine, eos_token_id=eos, **greedy)
    return {"got": got.tolist(), "want": want.tolist()}


@pytest.mark.distributed
def test_generate_runs_until_every_rank_is_done():
    per_rank = run_distributed(_generate_until_every_rank_is_done, world_size=2, timeout=120)
    for rank, r in enumerate(per_rank):
        assert r["got"] == r["want"], (rank, r)
    # Rank 0 stopped at its EOS; rank 1 decoded all six tokens.
    assert len(per_rank[0]["got"][0]) == 7 and len(per_rank[1]["got"][0]) == 12, per_rank


def _fsdp1_no_shard_refused():
    import torch.sagemaker as tsm

    from torch_sagemaker.moe.moe_config import MoEConfig

    tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 1})  # two replicas per expert
    model = tsm.transform(mm.tiny_moe("mixtral"), config=MoEConfig(moe_load_balancing="none"))
    return _error(lambda: mm.wrap(model, "fsdp1"))


@pytest.mark.distributed
def test_fsdp1_no_shard_with_replicated_experts_is_refused():
    out = run_distributed(_fsdp1_no_shard_refused, world_size=4, timeout=300)[0]
    assert "hybrid_shard_degree=1 (NO_SHARD)" in out and "FSDP2" in out, out


def _shuffle_under_recomputation(balancings):
    """Two forwards, then one backward of the summed losses, with the token shuffle: per-rank
    gradients with checkpointing against the same model without it (same seeds, same data)."""
    import torch.sagemaker as tsm

    from torch_sagemaker.moe.moe_config import MoEConfig

    tsm.init({"expert_parallel_degree": 2})
    rank = tsm.state.dp_rank
    # Micro-batches of 16 and 24 tokens: a recompute of the first one must not replay the
    # second one's permutation (nor draw a fresh one).
    batches = [mm.batch(rank, rows=2), mm.batch(rank + 2, rows=3)]
    base = mm.tiny_moe("mixtral")
    out = {}
    for balancing in balancings:
        cfg = MoEConfig(moe_load_balancing=balancing, global_token_shuffle=True)
        for target in ("layer", "moe"):  # reentrant on decoder layers, non-reentrant on MoELayer
            grads = []
            for checkpoint in (False, True):
                model = tsm.transform(copy.deepcopy(base), config=cfg)
                if checkpoint:
                    mm.apply_checkpointing(model, target)
                torch.manual_seed(0)  # the permutations come from the global CPU generator
                sum(model(input_ids=b, labels=b).loss for b in batches).backward()
                grads.append(
                    {
                        mm.clean(n): p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        for n, p in model.named_parameters()
                    }
                )
            plain, ckpt = grads
            assert plain.keys() == ckpt.keys()
            out[(balancing, target)] = max(
                float((g - ckpt[n]).abs().max()) for n, g in plain.items()
            )
    return out


@pytest.mark.distributed
def test_token_shuffle_under_recomputation_of_several_forwards():
    """Note [Token shuffle under recomputation]: the recompute of each forward deals out that
    forward's tokens again, for reentrant and non-reentrant checkpointing."""
    for out in run_distributed(
        _shuffle_under_recomputation, ["none", "sinkhorn"], world_size=2, timeout=300
    ):
        assert len(out) == 4 and max(out.values()) < 1e-6, out
