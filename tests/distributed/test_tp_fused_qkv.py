"""Fused query/key/value projections through shipped plans: BLOOM, Falcon, GPT-BigCode, MPT.

Each packs queries, keys and values into one projection. Head by head (BLOOM; Falcon and
GPT-BigCode without multi-query attention) or key/value group by group (Falcon's new
decoder architecture), a column split keeps whole heads. Under multi-query attention
(Falcon-7B, StarCoder) the projection ends with one key and one value head that every
query head shares, and MPT's is ``[q | k | v]`` blocks: the weight stays whole and each
rank computes its rows (Note [Fused projections computed by rows]). BLOOM, MPT and Falcon's
ALiBi variant build their per-head biases outside the attention module, for every head: the
``head_inputs`` style cuts them to each rank's heads (Note [Head-indexed inputs]). Without
the cut BLOOM fails with a shape error, and a cut taking the wrong heads fails the logits.

Each variant runs at tp 2 on 2 ranks against the same model in one process: logits, loss,
every gradient, and 5 SGD steps' losses and parameters. The batch is left-padded (its
attention mask has zeros), so ALiBi's positions come from the mask. Key/value groups the
degree does not divide are refused at ``tsm.transform``, naming the attribute.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

#: variant -> (config class, its attributes, attention implementation).
VARIANTS = {
    "bloom": ("BloomConfig", {"n_embed": 64, "n_layer": 2, "n_head": 4}, "eager"),
    "falcon_new": (
        "FalconConfig",
        {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 2},
        "sdpa",
    ),
    "falcon_alibi_eager": (
        "FalconConfig",
        {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
        "eager",
    ),
    "falcon_alibi_sdpa": (
        "FalconConfig",
        {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
        "sdpa",
    ),
    "falcon_multi_query": ("FalconConfig", {"multi_query": True}, "sdpa"),
    "bigcode_multi_query": ("GPTBigCodeConfig", {"multi_query": True}, "eager"),
    "bigcode_multi_head": ("GPTBigCodeConfig", {"multi_query": False}, "sdpa"),
    "mpt": ("MptConfig", {}, "eager"),
}
SIZES = {
    "FalconConfig": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    "GPTBigCodeConfig": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "MptConfig": {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
}
#: The fused projection of each config class.
FUSED = {
    "BloomConfig": "self_attention.query_key_value",
    "FalconConfig": "self_attention.query_key_value",
    "GPTBigCodeConfig": "attn.c_attn",
    "MptConfig": "attn.Wqkv",
}


def _build(variant: str, seed: int = 0, **overrides):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    name, attrs, attention = VARIANTS[variant]
    dropout = {  # none: the reference draws other masks than the TP ranks' regions
        k: 0.0
        for k in ("hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
    }
    cfg = getattr(transformers, name)(
        vocab_size=128, **dropout, **SIZES.get(name, {}), **{**attrs, **overrides}
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attention).float()


def _padded_batch():
    """Ids, attention mask (row 0 left-padded by 3) and labels (-100 on the padding)."""
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _parity() -> dict:
    import torch
    import torch.sagemaker as tsm

    from tests.distributed.test_tp_parity import full, gradient_diffs, max_diff, parameter_diffs

    tsm.init({"tensor_parallel_degree": 2})
    ids, mask, labels = _padded_batch()
    results = {}
    for variant in VARIANTS:
        ref = _build(variant)
        model = tsm.transform(copy.deepcopy(ref))
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        expected = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        expected.loss.backward()
        r = {
            # (rows at padded positions attend to nothing real; the loss skips them)
            "logits": max_diff(full(out.logits)[mask.bool()], expected.logits[mask.bool()]),
            "loss": abs(float(out.loss.detach() - expected.loss.detach())),
            "grads": max(gradient_diffs(model, ref).values()),
            "grad_scale": max(float(p.grad.abs().max()) for p in ref.parameters()),
        }
        curves = []
        for m in (model, ref):
            m.zero_grad()
            # SGD: under AdamW the key bias (exactly zero gradient: softmax ignores it)
            # moves by +-lr on rounding noise, differently per process.
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            losses = []
            for _ in range(5):
                opt.zero_grad()
                loss = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
                loss.backward()
                opt.step()
                losses.append(float(loss))
            curves.append(losses)
        r["curves"] = curves
        r["params"] = max(parameter_diffs(model, ref).values())
        layers = model.transformer.blocks if variant == "mpt" else model.transformer.h
        fused = layers[0].get_submodule(FUSED[VARIANTS[variant][0]]).weight
        r["fused"] = str(fused.placements)
        r["dtensors"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        results[variant] = r
    return results


def test_bloom_and_falcon_layouts_match_one_process_at_tp2():
    for results in run_distributed(_parity, world_size=2, timeout=300):
        for variant, r in results.items():
            assert r["dtensors"], variant
            # multi-query's shared key/value heads and MPT's [q | k | v] blocks: whole weights
            whole = "multi_query" in variant or variant == "mpt"
            assert r["fused"] == ("(Replicate(),)" if whole else "(Shard(dim=0),)"), (variant, r)
            assert r["logits"] < 2e-5 and r["loss"] < 2e-5, (variant, r)
            assert r["grad_scale"] > 1e-4 and r["grads"] < 2e-5, (variant, r)
            tp, ref = r["curves"]
            assert tp[-1] < tp[0] - 0.1, (variant, tp)
            assert max(abs(a - b) for a, b in zip(tp, ref)) < 1e-4, (variant, tp, ref)
            assert r["params"] < 1e-5, (variant, r["params"])


def _refusals() -> dict:
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2})
    found = {}
    for variant, overrides in (("falcon_new", {"num_kv_heads": 1}),):
        try:
            tsm.transform(_build(variant, **overrides))
            found[variant] = ""
        except ValueError as e:
            found[variant] = str(e)
    return found


def test_key_value_groups_the_degree_does_not_divide_are_refused_naming_the_attribute():
    for found in run_distributed(_refusals, world_size=2, timeout=120):
        assert "num_kv_heads" in found["falcon_new"], found
        assert "tensor_parallel_degree 2" in found["falcon_new"], found
