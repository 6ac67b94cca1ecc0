"""tsm.transform edge cases on 2 CPU ranks (tp=2), all cases in one launch.

GQA with fewer kv heads than ranks, a vocabulary the degree does not divide (untied and
tied), Mixtral's expert split, tp=1 preparation, meta-device models, dtype, and the errors
for unsupported models and indivisible heads.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import (
    ATOL,
    batch,
    build,
    compare_forward_backward,
    train_losses,
)


def _parity(family: str, **overrides) -> dict:
    import torch.sagemaker as tsm

    ref = build(family, **overrides)
    model = tsm.transform(copy.deepcopy(ref))
    vocab = ref.config.vocab_size
    r = compare_forward_backward(model, ref, batch(0, vocab=vocab))
    model.zero_grad()
    ref.zero_grad()
    ids = batch(0, vocab=vocab)
    r["curves"] = (train_losses(model, [ids], 0), train_losses(ref, [ids], 0))
    return r


def _mixtral_split() -> dict:
    """Each rank's expert shard equals the reference's experts [2r, 2r + 2), for both params."""
    import torch
    import torch.sagemaker as tsm

    ref = build("mixtral")
    model = tsm.transform(copy.deepcopy(ref))
    r = tsm.state.tp_rank
    out = {}
    for name in ("gate_up_proj", "down_proj"):
        local = getattr(model.model.layers[0].mlp.experts, name)
        full = getattr(ref.model.layers[0].mlp.experts, name)
        out[name] = (
            tuple(local.to_local().shape),
            torch.equal(local.to_local(), full[2 * r : 2 * r + 2].detach()),
            [str(p) for p in local.placements],
        )
    return out


def _given_embeddings() -> dict:
    """``inputs_embeds`` instead of ``input_ids`` (prompt tuning, multimodal inputs), with
    an odd sequence length and a gradient for the embeddings themselves."""
    import torch.sagemaker as tsm

    from tests.distributed.test_tp_parity import max_diff

    ref = build("llama", num_key_value_heads=1)
    model = tsm.transform(copy.deepcopy(ref))
    ids = batch(0, vocab=ref.config.vocab_size)[:, :13]
    given = ref.get_input_embeddings()(ids).detach()
    mine, theirs = given.clone().requires_grad_(), given.clone().requires_grad_()
    out = model(inputs_embeds=mine, labels=ids, use_cache=False)
    out.loss.backward()
    expected = ref(inputs_embeds=theirs, labels=ids, use_cache=False)
    expected.loss.backward()
    return dict(
        logits=max_diff(out.logits, expected.logits),
        loss=abs(float(out.loss.detach() - expected.loss.detach())),
        # The input embedding takes no part: its weight has no gradient on either side.
        grads={
            n: max_diff(p.grad, q.grad) if p.grad is not None else float(q.grad is not None)
            for (n, p), q in zip(model.named_parameters(), ref.parameters())
        },
        embeds_grad=float((mine.grad - theirs.grad).abs().max()),
    )


def _greedy_generation() -> tuple[list, list]:
    """``generate()`` with a KV cache: the tokens one process picks, step after step."""
    import torch
    import torch.sagemaker as tsm

    ref = build("llama", num_key_value_heads=1).eval()
    model = tsm.transform(copy.deepcopy(ref)).eval()
    ids = batch(0, vocab=ref.config.vocab_size)[:, :6]
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return model.generate(ids, **kwargs).tolist(), ref.generate(ids, **kwargs).tolist()


def _features() -> dict:
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.tensor import DTensor

    from torch_sagemaker.policies import get_policy, transformer_layer_classes

    out: dict = {}
    tsm.init({"tensor_parallel_degree": 2})
    out["gqa_kv1"] = _parity("llama", num_key_value_heads=1)
    out["vocab_odd"] = _parity("llama", vocab_size=127)
    out["vocab_odd_tied"] = _parity("qwen2", vocab_size=127)
    out["mixtral_eager"] = _parity("mixtral", _experts_implementation="eager")
    out["mixtral_split"] = _mixtral_split()
    out["inputs_embeds"] = _given_embeddings()
    out["generate"] = _greedy_generation()
    ids = batch(0)
    labels = ids.clone()
    labels[0, 3] = 200  # outside the 128-token vocabulary
    try:
        tsm.transform(build("llama"))(input_ids=ids, labels=labels)
    except ValueError as e:
        out["label_outside"] = str(e)
    ref = build("llama")
    ref.set_attn_implementation("eager")  # the implementation that returns weights
    weights = tsm.transform(copy.deepcopy(ref))(input_ids=ids, output_attentions=True).attentions
    expected = ref(input_ids=ids, output_attentions=True).attentions
    out["attentions"] = (
        [tuple(w.shape) for w in weights] == [tuple(w.shape) for w in expected],
        max((a - b).abs().max().item() for a, b in zip(weights, expected)),
    )
    twice = tsm.transform(build("llama"))(input_ids=ids, labels=ids).loss
    twice.backward(retain_graph=True)
    try:
        twice.backward()
    except RuntimeError as e:
        out["second_backward"] = str(e)
    # Tied weights stay one parameter.
    qwen = tsm.transform(build("qwen2"))
    out["tied"] = qwen.lm_head.weight is qwen.model.embed_tokens.weight
    try:
        tsm.transform(qwen)
    except ValueError as e:
        out["twice"] = str(e)
    out["layer_cls"] = [c.__name__ for c in transformer_layer_classes(qwen)]
    # A meta-device model stays on meta (delayed initialization), with its TP layout.
    with torch.device("meta"):
        meta = build("llama")
    tsm.transform(meta)
    q = meta.model.layers[0].self_attn.q_proj.weight
    out["meta"] = (
        all(p.is_meta for p in meta.parameters()),
        isinstance(q, DTensor),
        tuple(q.to_local().shape),
    )
    # dtype: floating parameters cast, RoPE's inv_freq kept in fp32.
    cast = tsm.transform(build("llama"), dtype=torch.bfloat16)
    out["dtype"] = (
        sorted({str(p.dtype) for p in cast.parameters()}),
        str(cast.model.rotary_emb.inv_freq.dtype),
    )
    # Errors.
    out["errors"] = {}
    for name, make in (
        ("unsupported", lambda: torch.nn.Linear(2, 2)),
        (
            "heads",
            lambda: build("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=48),
        ),
    ):
        try:
            tsm.transform(make())
        except ValueError as e:
            out["errors"][name] = str(e)
    # The norm-gradient all-reduce of the Transformer Engine backend (plain CPU collectives).
    from torch_sagemaker.tensor_parallel.te import allreduce_grads_over

    w = torch.nn.Parameter(torch.ones(3))
    allreduce_grads_over([w], tsm.state.tp_process_group)
    (w * (tsm.state.tp_rank + 1)).sum().backward()
    out["allreduced_grad"] = w.grad.tolist()
    tsm.state.reset()
    tsm.init({"tensor_parallel_degree": 1})
    plain = tsm.transform(build("gpt_neox"))
    out["tp1"] = (
        get_policy(plain).name,
        sorted({type(p).__name__ for p in plain.parameters()}),
        [c.__name__ for c in transformer_layer_classes(plain)],
    )
    return out


@pytest.fixture(scope="module")
def features():
    return run_distributed(_features, world_size=2, timeout=300)


def _assert_parity(r: dict, what: str) -> None:
    assert r["logits"] < ATOL and r["loss"] < ATOL, (what, r["logits"], r["loss"])
    bad = {n: d for n, d in r["grads"].items() if d > ATOL}
    assert not bad, (what, bad)
    tp, ref = r["curves"]
    assert tp[-1] < tp[0] - 0.1, (what, tp)
    assert max(abs(a - b) for a, b in zip(tp, ref)) < 1e-4, (what, tp, ref)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["gqa_kv1", "vocab_odd", "vocab_odd_tied", "mixtral_eager"])
def test_edge_case_parity(features, case):
    """kv_heads=1 < tp (replicated kv head), vocab 127 (uneven shards), eager experts."""
    for rank_result in features:
        _assert_parity(rank_result[case], case)


@pytest.mark.distributed
def test_inputs_embeds_enter_as_the_embedding_output_would(features):
    for rank_result in features:
        r = rank_result["inputs_embeds"]
        assert r["logits"] < ATOL and r["loss"] < ATOL and r["embeds_grad"] < ATOL, r
        assert not {n: d for n, d in r["grads"].items() if d > ATOL}, r


@pytest.mark.distributed
def test_a_label_outside_the_vocabulary_is_refused_as_cross_entropy_refuses_it(features):
    for rank_result in features:
        assert "target 200 is outside the vocabulary [0, 128)" in rank_result["label_outside"]


@pytest.mark.distributed
def test_output_attentions_returns_every_head(features):
    # Each rank computes its heads' weights; they used to be returned as they were.
    for rank_result in features:
        same_shapes, diff = rank_result["attentions"]
        assert same_shapes and diff < ATOL, rank_result["attentions"]


@pytest.mark.distributed
def test_a_second_backward_through_the_loss_is_refused_by_name(features):
    # The backward reuses the saved softmax as the gradient (memory); a retained graph's
    # second backward used to fail with autograd's in-place message.
    for rank_result in features:
        assert "back-propagated twice" in rank_result["second_backward"]


@pytest.mark.distributed
def test_generate_picks_the_tokens_one_process_picks(features):
    for rank_result in features:
        tp, ref = rank_result["generate"]
        assert tp == ref and len(tp[0]) == 11, (tp, ref)


@pytest.mark.distributed
def test_mixtral_experts_are_split_whole(features):
    for rank_result in features:
        for name, (shape, equal, placements) in rank_result["mixtral_split"].items():
            assert equal, name
            assert shape[0] == 2 and placements == ["S(0)"], (name, shape, placements)


@pytest.mark.distributed
def test_preparation_semantics(features):
    r = features[0]
    assert r["tied"] and r["layer_cls"] == ["Qwen2DecoderLayer"]
    assert "already transformed" in r["twice"]
    assert r["meta"] == (True, True, (32, 64))  # 2 of 4 heads x head_dim 16
    assert r["dtype"] == (["torch.bfloat16"], "torch.float32")
    assert r["tp1"] == ("gpt_neox", ["Parameter"], ["GPTNeoXLayer"])
    for rank_result in features:
        assert rank_result["allreduced_grad"] == [3.0, 3.0, 3.0]  # 1 + 2 over the TP group


@pytest.mark.distributed
def test_clear_errors(features):
    errors = features[0]["errors"]
    assert "does not support Linear" in errors["unsupported"]
    assert (
        "LlamaForCausalLM" in errors["unsupported"] and "register_policy" in errors["unsupported"]
    )
    assert "tensor_parallel_degree=2 does not divide num_attention_heads=3" in errors["heads"]
