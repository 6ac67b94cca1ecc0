"""Tensor parallel parity: every family, tp=2 on 2 ranks and tp=2 x hybrid_shard_degree=2 on 4.

Each rank builds the tiny model from a seed, keeps an untransformed copy as the reference,
transforms the other and runs the same batch through both: logits, loss and every
parameter gradient (gathered to full) must match within fp32 tolerance, and 5 AdamW steps
must follow the reference's loss curve. All families run in one launch per world size.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed

FAMILIES = ("llama", "mistral", "gpt_neox", "mixtral", "qwen2")
ATOL = 2e-5
STEPS = 5


def tiny_config(family: str, **overrides):
    """A tiny fp32 config: hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128, no dropout."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0)
    if family == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=8)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2)
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(**common, hidden_dropout=0.0, use_parallel_residual=True)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build(family: str, seed: int = 0, **overrides):
    """The model of ``tiny_config(family)`` with weights drawn from ``seed`` (same on every rank)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def batch(dp_rank: int, vocab: int = 128, size: tuple[int, int] = (2, 12)):
    """Input ids of data-parallel rank ``dp_rank`` (TP ranks of a group share one batch)."""
    import torch

    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, vocab, size, generator=g)


def full(t):
    """A DTensor's full value (a plain tensor is returned as is)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a, b) -> float:
    return float((full(a).detach() - full(b).detach()).abs().max())


def compare_forward_backward(model, ref, ids) -> dict:
    """Max abs differences of logits, loss and each gradient between ``model`` and ``ref``."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    expected = ref(input_ids=ids, labels=ids)
    expected.loss.backward()
    ref_params = dict(ref.named_parameters())
    grads = {name: max_diff(p.grad, ref_params[name].grad) for name, p in model.named_parameters()}
    return dict(logits=max_diff(out.logits, expected.logits), loss=abs(float(out.loss - expected.loss)),
                grads=grads, loss_value=float(expected.loss),
                grad_scale=max(float(p.grad.abs().max()) for p in ref.parameters()))


def train_losses(model, ids, steps: int = STEPS) -> list[float]:
    """Loss of each of ``steps`` AdamW steps on the same batch."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _parity_all_families(families, tp: int, hybrid_shard_degree: int, fsdp: bool) -> dict:
    import torch
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": tp, "hybrid_shard_degree": hybrid_shard_degree})
    results = {}
    for family in families:
        ref = build(family)
        model = tsm.transform(copy.deepcopy(ref))
        if fsdp:
            shard_model(model)
        ids = batch(tsm.state.dp_rank)
        r = compare_forward_backward(model, ref, ids)
        if fsdp:
            # Reference gradients of a data-parallel step: the mean over every dp rank's batch.
            ref.zero_grad()
            for dp in range(tsm.state.dp_size):
                (ref(input_ids=batch(dp), labels=batch(dp)).loss / tsm.state.dp_size).backward()
            ref_params = dict(ref.named_parameters())
            r["grads"] = {n: max_diff(p.grad, ref_params[n].grad) for n, p in model.named_parameters()}
        model.zero_grad()
        ref.zero_grad()
        r["tp_losses"] = train_losses(model, ids)
        r["ref_losses"] = train_losses(ref, ids) if not fsdp else None
        r["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
        r["keys_equal"] = list(model.state_dict()) == list(ref.state_dict())
        results[family] = r
        torch.manual_seed(0)
    return results


def shard_model(model) -> None:
    """FSDP2 over ``tsm.state.fsdp_mesh``: each transformer layer, then the root."""
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.policy import transformer_layer_class

    layer_cls = transformer_layer_class(model)
    for module in model.modules():
        if isinstance(module, layer_cls):
            fully_shard(module, mesh=tsm.state.fsdp_mesh)
    fully_shard(model, mesh=tsm.state.fsdp_mesh)


def check(results: dict, *, curve: bool = True) -> None:
    for family, r in results.items():
        assert r["keys_equal"], family
        assert r["param_types"] == ["DTensor"], (family, r["param_types"])
        assert r["logits"] < ATOL, (family, r["logits"])
        assert r["loss"] < ATOL, (family, r["loss"])
        assert r["grad_scale"] > 1e-4, family  # gradients are not trivially zero
        bad = {n: d for n, d in r["grads"].items() if d > ATOL}
        assert not bad, (family, bad)
        if curve and r["ref_losses"] is not None:
            assert r["tp_losses"][-1] < r["tp_losses"][0] - 0.1, (family, r["tp_losses"])
            for a, b in zip(r["tp_losses"], r["ref_losses"]):
                assert abs(a - b) < 1e-4, (family, r["tp_losses"], r["ref_losses"])


@pytest.mark.distributed
def test_tp2_matches_reference_for_every_family():
    per_rank = run_distributed(_parity_all_families, FAMILIES, 2, 0, False, world_size=2, timeout=300)
    for results in per_rank:
        check(results)
