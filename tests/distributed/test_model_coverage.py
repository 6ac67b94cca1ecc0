"""The coverage command (``python -m tools.model_coverage``) on a few families.

The full sweep over transformers' causal-LM registry is long and its output is committed
(docs/model_coverage.md); here the command runs end to end on two families, one through
its plan and one through a policy that takes its TP plan from transformers, a multimodal
one whose plan and head counts are on its text sub-config (Gemma 3), one transformers ships
no plan for and ``shipped_plans`` does (BART's decoder: its own loss, so gathered logits;
RoBERTa: a head bias its parent holds too, Note [Tied parameters of parameter holders];
RoFormer: attention that reshapes by its full ``all_head_size``; OpenAI-GPT: transformers'
Conv1D, its packed [q | k | v] split block by block and cut at a full width without a head
size; CTRL: plan keys naming a Sequential's numbered members, and a full width of its own;
XGLM: ``embed_dim``, a full width in that family only; Whisper: the decoder's own head
count, here unlike the encoder's; Mllama's text model: cross-attention layers run on image
states, keyed by number; ModernBERT's decoder: a fused [input | gate] computed by rows
outside attention; DBRX: grouped-query [q | k | v] computed by rows, and experts that see
only this rank's choices, Note [Experts that run every index]), plus one it skips, and
must write their rows. (GPT-2, BLOOM and MPT
have parity tests of their own: test_tp_gpt2.py, test_tp_fused_qkv.py.) The tool's parity
also runs Gemma 4's image-text model at tensor_parallel_degree 1 x hybrid shard 2, the route
its TP refusal advises.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed


def test_coverage_command_runs_families_and_writes_the_table(tmp_path):
    from tools.model_coverage import parity
    from tools.model_coverage.__main__ import main

    out = tmp_path / "coverage.md"
    rows = {
        r.family: r
        for r in main(
            [
                "--families",
                "qwen3,qwen3_moe,gemma3,bart,roberta,roformer,openai-gpt,ctrl,xglm,whisper,"
                "mllama,modernbert-decoder,dbrx,rwkv",
                "--output",
                str(out),
            ]
        )
    }
    assert rows["qwen3"].path == "plan" and rows["qwen3"].result == "pass", rows["qwen3"]
    moe = rows["qwen3_moe"]
    assert moe.path == "policy `qwen3_moe`, TP from the plan" and moe.result == "pass", moe
    gemma3 = rows["gemma3"]  # Gemma3ForConditionalGeneration: a vision tower, replicated
    assert gemma3.path == "plan" and gemma3.result == "pass", gemma3
    assert all(parity.passed(r)[0] for r in gemma3.per_rank)
    assert 0.2 < gemma3.per_rank[0]["split_share"] < 0.9  # the text model's share
    shipped = (
        *("bart", "roberta", "roformer", "openai-gpt", "ctrl", "xglm", "whisper", "mllama"),
        "dbrx",
    )
    for family in (*shipped, "modernbert-decoder"):
        row = rows[family]
        assert row.path == "shipped plan" and row.result == "pass", row
        assert all(parity.passed(r)[0] for r in row.per_rank) and len(row.per_rank) == 4
        # (Whisper: 0.78, its positions whole; ModernBERT: 0.61, its fused [input | gate]
        # whole)
        assert row.per_rank[0]["split_share"] > (0.6 if family == "modernbert-decoder" else 0.75)
    assert rows["rwkv"].result == "skip" and "no base_model_tp_plan" in rows["rwkv"].detail
    for family in ("qwen3", "qwen3_moe"):
        per_rank = rows[family].per_rank
        assert len(per_rank) == 4 and all(parity.passed(r)[0] for r in per_rank)
        assert all(r["grad_scale"] > 1e-3 for r in per_rank)  # the gradients are not trivial
        assert per_rank[0]["split_share"] > 0.9  # the plan splits nearly every parameter
        assert per_rank[0]["losses"]["tp"] != per_rank[2]["losses"]["tp"]  # two dp batches
    text = out.read_text()
    assert "| qwen3 | Qwen3ForCausalLM | plan | pass |" in text, text
    assert "| bart | BartForCausalLM | shipped plan | pass |" in text, text
    assert "| rwkv | RwkvForCausalLM | none | skip |" in text, text


def test_gemma4_with_per_layer_embeddings_trains_as_its_refusal_advises():
    # Tensor parallelism refuses Gemma 4's image-text model with per-layer embeddings
    # (Note [Gemma 4's per-layer embeddings]) and advises tensor_parallel_degree=1 (FSDP
    # alone): that route must match one process.
    from tools.model_coverage import launch, parity
    from tools.model_coverage.tiny import tiny_config

    assert tiny_config("gemma4").text_config.hidden_size_per_layer_input > 0
    per_rank = launch.run_families(
        ["gemma4"],
        world=2,
        config={"tensor_parallel_degree": 1, "hybrid_shard_degree": 2},
        timeout=300,
    )["gemma4"]
    assert isinstance(per_rank, list) and len(per_rank) == 2, per_rank
    for result in per_rank:
        assert parity.passed(result)[0], parity.passed(result)[1]
        assert result["grad_scale"] > 1e-3  # the gradients are not trivial
    assert per_rank[0]["losses"]["tp"] != per_rank[1]["losses"]["tp"]  # two dp batches


def test_coverage_command_wraps_in_fsdp1_as_smps_scripts_do(tmp_path):
    # ``--fsdp 1``: HYBRID_SHARD, use_orig_params=True, checkpointing after the wrap. Granite
    # SWA's attention sinks failed there until the sinks were named when the style was
    # applied (Note [Replicated parameters under FSDP1]).
    from tools.model_coverage import parity
    from tools.model_coverage.__main__ import main

    out = tmp_path / "coverage_fsdp1.md"
    rows = {
        r.family: r
        for r in main(["--families", "qwen3,granite_swa", "--fsdp", "1", "--output", str(out)])
    }
    for family in ("qwen3", "granite_swa"):
        row = rows[family]
        assert row.result == "pass", row
        assert all(parity.passed(r)[0] for r in row.per_rank) and len(row.per_rank) == 4
        assert all(r["grad_scale"] > 1e-3 for r in row.per_rank)
    text = out.read_text()
    assert "--fsdp 1" in text and "FSDP1 as SMP's example scripts wrap" in text, text
