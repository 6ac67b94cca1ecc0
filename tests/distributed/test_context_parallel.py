"""Context parallelism against one process on the whole sequences (cases in cp_cases.py).

Launches (several cases each, tiny models, 3 AdamW steps per case):
- cp 2 on 2 ranks, every family, both comm types, FSDP1 (SMP's call) and FSDP2 alternating,
  on gloo (two families on smddp); bf16 with activation checkpointing; CPU bf16 autocast
  with both comm types; the offload wrapper;
  labels that only count the targets across chunk boundaries;
- cp 2 x tp 2 on 4 ranks;
- cp 2 with hybrid_shard_degree 4 (two data-parallel ranks, different data), cp 2 with
  replicas (hybrid_shard_degree 2) and cp 4, on 4 ranks over smddp;
- DCP checkpoints across context parallel degrees with delayed initialisation;
- clear errors for bad input and for models whose layers are not softmax attention alone.
"""

from __future__ import annotations

import pytest

from tests.distributed import cp_cases
from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp.backend import is_available as smddp_available

pytestmark = pytest.mark.distributed

FAMILIES = ("llama", "mistral", "gpt_neox", "mixtral", "qwen2")
NEEDS_SMDDP = pytest.mark.skipif(not smddp_available(), reason="smddp extension not built")


def _cases(cases: list[tuple[dict, str, str, str, dict]]) -> dict:
    """Runs ``cp_cases.run_case`` for each (config, family, comm, api, options) on this rank."""
    from tests.distributed.test_delayed_param import layout_for

    out, current = {}, None
    for i, (config, family, comm, api, options) in enumerate(cases):
        current = layout_for(config, current)
        out[i] = cp_cases.run_case(family, comm, api, **options)
    return out


def _check_all(per_rank: list[dict], cases: list) -> None:
    for rank, results in enumerate(per_rank):
        for i, case in enumerate(cases):
            what = f"rank {rank} case {case}"
            if case[4].get("mixed") or case[4].get("autocast"):
                cp_cases.check_bf16(results[i], what=what)
            else:
                cp_cases.check(results[i], what=what)


CP2 = {"context_parallel_degree": 2, "hybrid_shard_degree": 2}


def _family_cases() -> list:
    cases = []
    for i, family in enumerate(FAMILIES):
        for j, comm in enumerate(("p2p", "all_gather")):
            cases.append((CP2, family, comm, ("fsdp1", "fsdp2")[(i + j) % 2], {}))
    return cases


def test_cp2_every_family_both_comm_types():
    cases = _family_cases()
    _check_all(run_distributed(_cases, cases, world_size=2, timeout=400), cases)


@NEEDS_SMDDP
def test_cp2_on_smddp():
    """The ring and the gathers over smddp's shared-memory point-to-point and collectives."""
    cases = [c for c in _family_cases() if c[1] in ("llama", "gpt_neox")]
    _check_all(run_distributed(_cases, cases, world_size=2, backend="smddp", timeout=300), cases)


def test_cp2_bf16_checkpointing_and_offload():
    cases = [
        (CP2, "llama", "p2p", "fsdp1", {"checkpointing": True, "mixed": True}),
        (CP2, "qwen2", "all_gather", "fsdp2", {"checkpointing": True, "mixed": True}),
        (CP2, "llama", "p2p", "fsdp2", {"checkpointing": True, "offload": True}),
        (CP2, "gpt_neox", "all_gather", "fsdp1", {"checkpointing": True}),
        # Note [Context parallel attention under autocast]: q and k reach the attention in
        # fp32 (RoPE), v in bf16; the ring used to crash in the CPU flash kernel.
        (CP2, "llama", "p2p", "fsdp1", {"checkpointing": True, "autocast": True}),
        (CP2, "qwen2", "all_gather", "fsdp2", {"autocast": True}),
    ]
    _check_all(run_distributed(_cases, cases, world_size=2, timeout=360), cases)


def _boundary_targets(comm: str) -> tuple[float, float, float]:
    """Loss when only the targets across chunk boundaries count: (cp mean, reference, naive)."""
    import copy

    import torch
    import torch.sagemaker as tsm

    tsm.init(CP2)
    cp, rank = tsm.state.cp_size, tsm.state.cp_rank
    ref = cp_cases.tiny_model("llama")
    model = tsm.transform(copy.deepcopy(ref), cp_comm_type=comm)
    ids = cp_cases.sequences(0)
    c = cp_cases.SEQ // (2 * cp)
    labels = torch.full_like(ids, -100)
    labels[:, c::c] = ids[:, c::c]  # the first token of every chunk but the first
    local = model(
        input_ids=cp_cases.smp_split(ids, rank, cp), labels=cp_cases.smp_split(labels, rank, cp)
    ).loss
    expected = ref(input_ids=ids, labels=labels).loss
    # What shifting inside the local concatenation would give (the layout's trap).
    naive = ref.loss_function(
        model(input_ids=cp_cases.smp_split(ids, rank, cp)).logits,
        cp_cases.smp_split(labels, rank, cp),
        ref.config.vocab_size,
    )
    return cp_cases.cp_mean(local), float(expected), float(naive)


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_loss_counts_the_last_token_of_every_chunk(comm):
    for got, want, naive in run_distributed(_boundary_targets, comm, world_size=2, timeout=120):
        assert abs(got - want) < 1e-5, (got, want)
        # Each rank holds chunks (r, 3 - r); the naive shift drops only the target at local
        # position 0, so both keep one (finite) but lose or misplace the others.
        assert naive == naive and abs(naive - want) > 1e-2, (naive, want)


@pytest.mark.slow
def test_cp2_tp2_on_four_ranks():
    config = {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
    cases = [
        (config, "llama", "p2p", "fsdp2", {}),
        (config, "mixtral", "all_gather", "fsdp2", {"checkpointing": True}),
        (config, "gpt_neox", "p2p", "fsdp1", {"checkpointing": True}),
    ]
    # The pool's ranks may have run other TP layouts: the launcher clears DTensor's mesh caches.
    per_rank = run_distributed(_cases, cases, world_size=4, timeout=400)
    _check_all(per_rank, cases)


@NEEDS_SMDDP
def test_cp_hybrid_shard_replicas_and_cp4_on_four_ranks():
    hsd4 = {"context_parallel_degree": 2, "hybrid_shard_degree": 4}  # dp_shard 2 x cp 2
    replicas = {"context_parallel_degree": 2, "hybrid_shard_degree": 2}  # 2 replicas of cp 2
    cp4 = {"context_parallel_degree": 4, "hybrid_shard_degree": 4}
    cases = [
        (hsd4, "llama", "p2p", "fsdp1", {}),
        (hsd4, "mistral", "all_gather", "fsdp2", {}),
        (replicas, "qwen2", "p2p", "fsdp2", {}),
        (replicas, "llama", "all_gather", "fsdp1", {}),
        (cp4, "llama", "p2p", "fsdp2", {}),
        (cp4, "gpt_neox", "all_gather", "fsdp1", {}),
    ]
    per_rank = run_distributed(_cases, cases, world_size=4, backend="smddp", timeout=500)
    _check_all(per_rank, cases)
    for i, (config, *_rest) in enumerate(cases):
        curves = [r[i]["curve"] for r in per_rank]
        if config["context_parallel_degree"] == 2:
            # Ranks 0/1 and 2/3 are the two data-parallel ranks: different data.
            assert curves[0] == curves[1] and curves[2] == curves[3], (i, curves)
            assert curves[0] != curves[2], (i, "data-parallel ranks should see different data")


def _router_aux_loss(how: str) -> dict[str, tuple[float, float] | float]:
    """Mixtral's router auxiliary loss under cp 2 (FSDP2) against one process."""
    import copy

    import torch
    import torch.sagemaker as tsm

    tsm.init(CP2)
    cp, rank = tsm.state.cp_size, tsm.state.cp_rank
    in_config = how == "config"
    ref = cp_cases.tiny_model("mixtral", output_router_logits=in_config, router_aux_loss_coef=0.5)
    model = cp_cases.wrap(tsm.transform(copy.deepcopy(ref)), "fsdp2")
    call = {} if in_config else {"output_router_logits": True}
    ids = cp_cases.sequences(0)
    local = cp_cases.smp_split(ids, rank, cp)
    with torch.no_grad():  # the first call checks the formula; the measured one is a later step
        model(input_ids=local, labels=local, **call)
    out = model(input_ids=local, labels=local, **call)
    out.loss.backward()
    want = ref(input_ids=ids, labels=ids, **call)
    want.loss.backward()
    ref_grads = {cp_cases.clean(n): p.grad for n, p in ref.named_parameters()}
    grads = cp_cases.max_diffs(cp_cases.full_grads(model), ref_grads)
    return {
        "loss": (cp_cases.cp_mean(out.loss), float(want.loss)),
        "aux": (cp_cases.cp_mean(out.aux_loss), float(want.aux_loss)),
        "grad": max(grads.values()),
    }


@pytest.mark.parametrize("how", ["config", "call"])
def test_router_aux_loss_covers_the_whole_sequences(how):
    """Note [Context parallel router auxiliary loss]: CP mean and gradients as one process."""
    for r in run_distributed(_router_aux_loss, how, world_size=2, timeout=120):
        for key in ("loss", "aux"):
            got, want = r[key]
            assert abs(got - want) < 1e-5, (key, r)
        assert r["grad"] < 2e-5, r


#: Families whose layers mix positions outside softmax attention, and what the refusal names.
NOT_ATTENTION_ONLY = {
    "lfm2_moe": "'conv'",
    "falcon_h1": "'hybrid'",
    "deepseek_v32": "'indexed_attention'",
    "llama4_text": "'chunked_attention'",
}


def _errors() -> dict[str, str]:
    """Each kind of bad input, with the message it raised (``"no error"`` otherwise)."""
    import copy

    import torch
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import DynamicCache

    from torch_sagemaker.context_parallel import split_sequence
    from torch_sagemaker.sharding import shard_model

    tsm.init(CP2)
    rank, out = tsm.state.cp_rank, {}

    def record(name, fn):
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError, RuntimeError) as e:
            out[name] = str(e)

    ref = cp_cases.tiny_model("llama")
    model = tsm.transform(copy.deepcopy(ref))
    ids = cp_cases.sequences(0)
    record("odd_length", lambda: model(input_ids=ids[:, :7], labels=ids[:, :7]))
    record("split_length", lambda: split_sequence(ids[:, :14]))
    record("unsplit", lambda: model(input_ids=ids, labels=ids))
    periodic = torch.tensor([[5, 9] * 8])  # every rank gets [5, 9, 5, 9, 5, 9, 5, 9]
    record("periodic", lambda: model(input_ids=split_sequence(periodic)))
    local = cp_cases.smp_split(ids, rank, 2)
    record(
        "one_rank_bad_mask",
        lambda: model(
            input_ids=local, attention_mask=torch.zeros_like(local) if rank == 1 else None
        ),
    )
    record("different_lengths", lambda: model(input_ids=local[:, : 8 - 2 * rank]))
    # transformers before 5.24 passes the cache on as past_key_values, later ones as cache.
    record("kv_cache", lambda: model(input_ids=local, past_key_values=DynamicCache()))
    record("ok_after_errors", lambda: model(input_ids=local, labels=local))
    record(
        "sliding_window", lambda: tsm.transform(cp_cases.tiny_model("mistral", sliding_window=8))
    )
    record(
        "fsdp1_untransformed",
        lambda: FSDP(copy.deepcopy(ref), device_id=torch.device("cpu"), use_orig_params=True),
    )
    record("fsdp2_untransformed", lambda: shard_model(copy.deepcopy(ref)))
    plain = copy.deepcopy(ref)
    plain.config._attn_implementation = "tsm_context_parallel"
    record("attention_without_transform", lambda: plain(input_ids=local))
    record("comm_type", lambda: tsm.transform(copy.deepcopy(ref), cp_comm_type="ring"))
    from tools.model_coverage.tiny import build

    for family in NOT_ATTENTION_ONLY:  # hybrid, sparse (DSA) and chunked attention
        record(family, lambda family=family: tsm.transform(build(family)))
    from torch_sagemaker.context_parallel.attention import context_parallel_attention

    q = torch.zeros(1, 2, 4, 8)
    attention = model.model.layers[0].self_attn
    record("softcap", lambda: context_parallel_attention(attention, q, q, q, None, softcap=30.0))
    return out


def test_bad_input_gets_clear_errors():
    for rank, out in enumerate(run_distributed(_errors, world_size=2, timeout=120)):
        assert "not divisible by 2 * context_parallel_degree = 4" in out["odd_length"], out
        assert "14" in out["split_length"] and "multiple of 4" in out["split_length"], out
        assert "looks unsplit" in out["unsplit"], out
        assert out["periodic"] == "no error", out  # split correctly, its chunks repeat
        # Rank 1 passed the mask and names the rule; rank 0 names the rank that refused.
        bad_mask = ["context parallel rank(s) [1] of this group rejected", "supports no padding"]
        assert bad_mask[rank] in out["one_rank_bad_mask"], (rank, out)
        assert "different local lengths [8, 6]" in out["different_lengths"], out
        assert "has no KV cache" in out["kv_cache"], out
        assert out["ok_after_errors"] == "no error", out
        assert "sliding_window=8" in out["sliding_window"], out
        for key in ("fsdp1_untransformed", "fsdp2_untransformed"):
            assert "did not go through tsm.transform" in out[key], (key, out)
        assert "was not prepared by tsm.transform" in out["attention_without_transform"], out
        assert "cp_comm_type='ring'" in out["comm_type"], out
        assert "does not apply ['softcap']" in out["softcap"], out
        for family, kind in NOT_ATTENTION_ONLY.items():
            message = out[family]
            assert "is not supported with context parallelism" in message, (family, message)
            assert kind in message and "context_parallel_degree=1" in message, (family, message)


def _checkpoint_across_degrees(root: str) -> dict[str, list[float]]:
    """Delayed init + cp 2 saves, cp 1 resumes (and saves), cp 2 resumes that: loss curves."""
    from torch_sagemaker.checkpoint import TrainingState

    def run(cp: int, load: str | None, save: str | None, steps: range) -> list[float]:
        model, optim = cp_cases.delayed_build(cp)
        if load:
            TrainingState(model, optim).load(load)
        losses = []
        for step in steps:
            losses.append(cp_cases.train_step(model, optim, step))
            if save and step == steps[0]:
                TrainingState(model, optim, step=step + 1).save(save)
        return losses

    return dict(
        cp2=run(2, None, f"{root}/cp2", range(4)),
        cp1_from_cp2=run(1, f"{root}/cp2", f"{root}/cp1", range(1, 4)),
        cp2_from_cp1=run(2, f"{root}/cp1", None, range(2, 4)),
        cp1=run(1, None, None, range(1)),
    )


def test_checkpoints_load_across_context_parallel_degrees(tmp_path):
    for r in run_distributed(_checkpoint_across_degrees, str(tmp_path), world_size=2, timeout=300):
        full = r["cp2"]
        assert len(set(full)) == 4, full
        assert abs(r["cp1"][0] - full[0]) < 1e-5, (r["cp1"], full)  # delayed init, cp 1 vs 2
        for key, start in (("cp1_from_cp2", 1), ("cp2_from_cp1", 2)):
            for got, want in zip(r[key], full[start:]):
                assert abs(got - want) < 1e-5, (key, r[key], full)
