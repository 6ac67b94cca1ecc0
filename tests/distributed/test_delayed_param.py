"""Delayed parameter init on 4 CPU ranks under FSDP1 and FSDP2 and several shard layouts.

Every layout must produce exactly the values of an unsharded delayed init with the same seed
(gathered full state dicts are compared bit for bit), the rotary buffers must equal a fresh
eager computation, and the values must have the Hugging Face init statistics. GPT-2 on 2
ranks checks the same for init rules a parent module applies to its children.
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
    attention_bias=True,
    mlp_bias=True,
    initializer_range=0.02,
)
SEED = 77


def fresh_layout(config: dict) -> None:
    """``tsm.init(config)`` after a reset, dropping DTensor plans that hold older meshes.

    PyTorch caches redistribution planners by mesh *value* and the planner keeps its mesh
    alive, so a new layout equal to an earlier one would reuse the earlier (destroyed) groups.
    """
    import torch.sagemaker as tsm
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    tsm.state.reset()
    clear_redistribute_planner_cache()
    tsm.init(config)


def layout_for(config: dict, current: dict | None) -> dict:
    """``fresh_layout(config)`` unless ``current``, the config of the layout in place, equals it.

    Consecutive cases of one layout share one ``tsm.init``, as models built one after another
    in a job do: its groups and meshes stay, and so do DTensor's sharding caches, which a
    reset must empty (docs/log/suite.md: their misses were 28% of a parity rank's CPU).
    Returns ``config``, the layout now in place.
    """
    if config != current:
        fresh_layout(config)
    return config


def _meta_model():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(LlamaConfig(**CFG))


def _reference() -> dict:
    """Unsharded delayed init (one process) with the same seed."""
    from torch_sagemaker.delayed_param import DelayedParamIniter

    model = _meta_model()
    DelayedParamIniter(model, seed=SEED, device="cpu").init_model()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _sharded(hsd: int, fsdp: str, tp: int):
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torch_sagemaker.delayed_param import DelayedParamIniter

    fresh_layout({"hybrid_shard_degree": hsd, "tensor_parallel_degree": tp})
    model = _meta_model()
    if tp > 1:
        model = tsm.transform(model)
    initer = DelayedParamIniter(model, seed=SEED, device="cpu")
    with initer.validate_params_and_buffers_inited():
        if fsdp == "fsdp2":
            from torch_sagemaker.sharding import shard_model

            shard_model(model)
            initer.init_model()
            wrapped = model
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            wrapped = FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                param_init_fn=initer.get_param_init_fn(),
                post_param_init_fn=initer.get_post_param_init_fn(),
                use_orig_params=True,
                device_id=torch.device("cpu"),
            )
    local_numel = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in wrapped.parameters()
    )
    full = get_model_state_dict(
        wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return full, buffers, local_numel


def _compare_layouts(layouts) -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ref = _reference()
    eager_inv_freq = LlamaRotaryEmbedding(LlamaConfig(**CFG)).inv_freq
    out = {
        "stats": {k: (v.mean().item(), v.std().item(), v.numel()) for k, v in ref.items()},
        "pad_row": ref["model.embed_tokens.weight"][0].abs().sum().item(),
    }
    for hsd, fsdp, tp in layouts:
        full, buffers, local_numel = _sharded(hsd, fsdp, tp)
        out[(hsd, fsdp, tp)] = dict(
            equal=sorted(k for k in ref if k in full and torch.equal(full[k], ref[k])),
            keys=sorted(full),
            rope=all(torch.equal(b, eager_inv_freq) for n, b in buffers.items() if "inv_freq" in n),
            local_numel=local_numel,
        )
    return out


# (hybrid_shard_degree, FSDP version, tensor_parallel_degree) on 4 ranks. The tensor parallel
# case runs in test_checkpoint_reshard.py's fresh job (one TP layout per process, see there).
LAYOUTS = [(2, "fsdp1", 1), (4, "fsdp1", 1), (2, "fsdp2", 1), (1, "fsdp2", 1)]


@pytest.fixture(scope="module")
def results():
    return run_distributed(_compare_layouts, LAYOUTS, world_size=4, timeout=300)


def test_reference_statistics(results):
    r = results[0]
    assert r["pad_row"] == 0.0
    for key, (mean, std, numel) in r["stats"].items():
        if key.endswith("bias"):
            assert (mean, std) == (0.0, 0.0), key
        elif "norm" in key:
            assert (mean, std) == (1.0, 0.0), key
        else:
            assert abs(std - CFG["initializer_range"]) < 0.1 * CFG["initializer_range"], (key, std)
            assert abs(mean) < 3 * std / numel**0.5 + 1e-4, (key, mean)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_matches_unsharded_init(results, layout):
    total = sum(n for _, _, n in results[0]["stats"].values())
    for rank, r in enumerate(results):
        got = r[layout]
        assert got["keys"] == sorted(results[0]["stats"]), (rank, layout)
        assert got["equal"] == got["keys"], (
            f"rank {rank} {layout}: values differ from unsharded init"
        )
        assert got["rope"], f"rank {rank} {layout}: rotary inv_freq not recomputed"
    hsd, _, tp = layout
    # Each rank holds about 1/(hsd * tp) of the parameters (FSDP pads the last shard).
    assert sum(r[layout]["local_numel"] for r in results[: hsd * tp]) >= total
    assert results[0][layout]["local_numel"] <= total // (hsd * tp) + 1024


def _gpt2_meta(n_layer: int):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=n_layer, n_head=4, n_positions=64)
    config.bos_token_id = config.eos_token_id = 0
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _gpt2_parent_rules(n_layer: int) -> dict:
    """GPT-2, whose attention and MLP modules set their child ``c_proj``'s std (Note [Rules a
    parent applies to its children]), under FSDP1 with flattened parameters and FSDP2."""
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from torch_sagemaker.delayed_param import DelayedParamIniter

    ref = _gpt2_meta(n_layer)
    DelayedParamIniter(ref, seed=SEED, device="cpu").init_model()
    ref_state = ref.state_dict()
    out = {"c_proj": [], "c_attn": []}
    for layer in range(n_layer):
        for name in ("attn.c_proj", "mlp.c_proj", "attn.c_attn"):
            weight = ref_state[f"transformer.h.{layer}.{name}.weight"]
            out["c_attn" if name == "attn.c_attn" else "c_proj"].append(weight.std().item())
    fresh_layout({"hybrid_shard_degree": 2})
    for fsdp in ("fsdp1", "fsdp2"):
        model = _gpt2_meta(n_layer)
        initer = DelayedParamIniter(model, seed=SEED, device="cpu")
        with initer.validate_params_and_buffers_inited():
            if fsdp == "fsdp1":
                wrapped = FSDP(
                    model,
                    auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                    param_init_fn=initer.get_param_init_fn(),
                    post_param_init_fn=initer.get_post_param_init_fn(),
                    use_orig_params=False,
                    device_id=torch.device("cpu"),
                )
            else:
                for block in model.transformer.h:
                    fully_shard(block, mesh=tsm.state.fsdp_mesh)
                wrapped = fully_shard(model, mesh=tsm.state.fsdp_mesh)
                initer.init_model()
        full = get_model_state_dict(
            wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
        )
        out[fsdp] = sorted(k for k, v in ref_state.items() if not torch.equal(full[k], v))
    return out


def test_gpt2_parent_rules_under_fsdp1_and_fsdp2():
    n_layer = 6
    scaled = 0.02 / (2 * n_layer) ** 0.5
    for rank, r in enumerate(run_distributed(_gpt2_parent_rules, n_layer, timeout=300)):
        assert all(abs(std - scaled) < 0.1 * scaled for std in r["c_proj"]), (rank, r["c_proj"])
        assert all(abs(std - 0.02) < 0.002 for std in r["c_attn"]), (rank, r["c_attn"])
        assert r["fsdp1"] == [] and r["fsdp2"] == [], (rank, r)  # the unsharded values
