"""Terms of the planner's memory model checked against the model they describe, in one process:
the saved activations of sliding-window attention, FSDP's gathered buffers of MoE layers.

The multi-rank validation of the whole memory model is tests/distributed/test_planner_memory.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from benchmarks.planner import measure
from torch_sagemaker.planner import activations
from torch_sagemaker.planner.candidates import Candidate, check
from torch_sagemaker.planner.inputs import Cluster, Workload
from torch_sagemaker.planner.memory import activation_shape
from torch_sagemaker.planner.model import describe
from torch_sagemaker.planner.presets import accelerator
from torch_sagemaker.planner.probe import with_activations
from torch_sagemaker.planner.probe_attention import FusedAttention
from torch_sagemaker.policies import lookup_policy
from torch_sagemaker.sharding import checkpoint_transformer_layers

SEQ, BATCH = 64, 2


def _windowed(family: str, window: int | None) -> transformers.PreTrainedConfig:
    shape = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=window, **shape)
    # Qwen2 windows the layers from max_window_layers on: here the second one only.
    return transformers.Qwen2Config(
        sliding_window=window or 256,
        use_sliding_window=window is not None,
        max_window_layers=1,
        **shape,
    )


def _measured_and_predicted(config, checkpointing: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    spec = describe(model, lookup_policy(model))
    if checkpointing:
        checkpoint_transformer_layers(model)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    counter = measure.SavedActivations(model)
    with counter:
        loss = model(input_ids=ids, labels=ids).loss
    measured = counter.bytes
    del loss
    workload = Workload(SEQ, SEQ * BATCH, "float32")
    cluster = Cluster(hosts=1, per_host=1, accelerator=accelerator("H100"))
    checked = check(Candidate(1, checkpointing=checkpointing, fsdp=2), spec, cluster, workload)
    predicted = activations.activation_bytes(
        spec,
        activation_shape(checked, workload),
        checkpointing=checkpointing,
        offload=False,
        horizon=1,
    ).saved
    return measured, predicted


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_no_longer_than_the_sequence_is_predicted_to_the_storage(family):
    # A window of SEQ or less makes transformers pass a mask: the attention saves it and
    # key/value heads repeated to every query head (Note [Masked attention saves more]).
    # The saved_tensors_hooks count is the validation's, bar its 4-byte loss weight.
    unmasked = None
    for window in (None, SEQ + 1, SEQ, SEQ // 4):
        measured, predicted = _measured_and_predicted(_windowed(family, window), False)
        assert predicted == pytest.approx(measured, abs=8), (family, window)
        if window is None:
            unmasked = measured
        elif window > SEQ:
            assert measured == unmasked  # no mask below the window's length
        else:
            assert measured > unmasked


def test_a_checkpointed_sliding_window_keeps_its_boolean_mask_in_the_closure():
    # Checkpointing keeps each layer's input; the mask travels in the checkpoint's closure,
    # which the hook does not see (Note [A checkpoint's closure keeps the mask]).
    plain, plain_predicted = _measured_and_predicted(_windowed("mistral", None), True)
    measured, predicted = _measured_and_predicted(_windowed("mistral", SEQ // 4), True)
    assert measured == plain and plain_predicted == pytest.approx(plain, abs=8)
    assert predicted == pytest.approx(measured + SEQ * SEQ, abs=8)


MIXTRAL_TINY = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("moe", [False, True])
def test_fsdp_buffers_of_an_moe_layer_include_its_experts(tmp_path, moe):
    # Running a layer holds its experts unsharded with the rest of it: in the layer's own
    # FSDP unit without an MoEConfig, in a nested unit with one (Note [A layer gathers its
    # experts]). Buffers: the root, the running and the prefetched layer, one layer's grads.
    import json

    from torch_sagemaker.planner import memory
    from torch_sagemaker.planner.candidates import Checked
    from torch_sagemaker.planner.model import load_model

    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(MIXTRAL_TINY))
    spec = load_model(path)
    root = 2 * 128 * 64 + 64  # embedding, head, final norm
    dense = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 4 * 64  # q, o, k, v, norms, router
    experts = 4 * 2 * 96 * 64 + 4 * 64 * 96  # fused gate/up and down of 4 experts
    ep = 2 if moe else 1
    candidate = Candidate(4 // ep, expert_parallel_degree=ep, moe=moe)
    cluster = Cluster(hosts=1, per_host=4, accelerator=accelerator("H100"))
    workload = Workload(16, 64, "float32")
    checked = check(candidate, spec, cluster, workload)
    assert isinstance(checked, Checked), checked
    layer = dense + experts // ep
    assert memory.estimate(spec, checked, workload).buffers == (root + 3 * layer) * 4


def test_partial_rotary_tables_are_sized_from_rope_parameters():
    # Transformers 5 folds GPT-NeoX's rotary_pct into rope_parameters["partial_rotary_factor"];
    # the rotary tables (cos, sin per position) are that fraction of a head wide.
    config = transformers.GPTNeoXConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=96,
        rotary_pct=0.25,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    config.architectures = ["GPTNeoXForCausalLM"]
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    measured, predicted = _measured_and_predicted(config, False)
    assert predicted == pytest.approx(measured, abs=8)


def _one_forward(model, spec, vocab_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(saved bytes counted in one forward of BATCH x SEQ tokens, the planner's figure).

    The forward runs SDPA with unequal head sizes as the probe assumes (FusedAttention).
    """
    ids = torch.randint(0, vocab_size, (BATCH, SEQ))
    counter = measure.SavedActivations(model)
    with counter, FusedAttention():
        loss = model(input_ids=ids, labels=ids).loss
    measured = counter.bytes  # while the graph holds what it saved
    del loss
    workload = Workload(SEQ, SEQ * BATCH, "float32" if dtype == torch.float32 else "bfloat16")
    cluster = Cluster(hosts=1, per_host=1, accelerator=accelerator("H100"))
    checked = check(Candidate(1, fsdp=2), spec, cluster, workload)
    predicted = activations.activation_bytes(
        spec, activation_shape(checked, workload), checkpointing=False, offload=False, horizon=1
    ).saved
    return measured, predicted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cast_saved_beside_its_source_is_one_storage_under_float32(dtype):
    # BLOOM saves its attention's float32 softmax and the softmax cast back to the compute
    # dtype: two storages under bfloat16, one under float32, where the cast returns its
    # input (Saved.cast). The probe runs in bfloat16 and must say which terms are such casts.
    config = transformers.BloomConfig(
        vocab_size=96, hidden_size=64, n_layer=2, n_head=8, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    spec = with_activations(describe(model, lookup_policy(model)))
    assert any(t.cast for t in spec.policy.activations.attention)
    measured, predicted = _one_forward(model, spec, config.vocab_size, dtype)
    assert predicted == pytest.approx(measured, abs=8)


def _latent_attention_config() -> transformers.PreTrainedConfig:
    # Query/key heads of 16 + 8 and value heads of 32 (DeepSeek V3: 128 + 64 and 128);
    # the second layer is an MoE layer.
    return transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_is_predicted_to_the_storage(dtype):
    # Multi-head latent attention's own sizes (ranks, rotary and value head sizes) are probed
    # and sized (Note [Latent attention's sizes]); SDPA with unequal head sizes runs as the
    # fused kernel the prediction assumes (Note [Attention with unequal head sizes]).
    config = _latent_attention_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(dtype)
    spec = with_activations(describe(model, lookup_policy(model)))
    assert spec.qk_v_head_dims == (24, 32)  # the attention FLOPs' head sizes (timing.py)
    sizes = {t.size for t in spec.policy.activations.attention}
    assert {"q_lora", "kv_lora", "rope", "heads_nope", "heads_v"} & sizes == {
        "q_lora", "kv_lora", "heads_nope", "heads_v"
    }  # fmt: skip
    measured, predicted = _one_forward(model, spec, config.vocab_size, dtype)
    # What the planner leaves out, exactly: the loss's 4-byte weight and, in the MoE layer,
    # the experts' int32 token counts and (bfloat16) the router weight's float32 copy, which
    # are per layer, not per token. Under float32 two casts return their input: the router's
    # cast of its input is then the MoE block's input, which the prediction counts twice
    # (the two are saved as different kinds of inputs, so the probe does not pair them),
    # and the key/value latent's norm saves its input with the rotary part beside it.
    experts, hidden, tokens = config.n_routed_experts, config.hidden_size, BATCH * SEQ
    left_out = 4 + 4 * experts
    if dtype == torch.bfloat16:
        left_out += 4 * experts * hidden
    else:
        left_out += 4 * tokens * (config.qk_rope_head_dim * config.num_hidden_layers - hidden)
    assert measured - predicted == left_out
