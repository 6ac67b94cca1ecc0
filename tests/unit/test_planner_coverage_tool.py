"""``python -m tools.model_coverage.planner``: the page of families the planner sizes."""

from __future__ import annotations

from tools.model_coverage import planner


def test_the_page_sorts_families_by_how_the_planner_sizes_them(tmp_path):
    out = tmp_path / "planner_coverage.md"
    rows = planner.main(["--families", "llama,phi,diffllama,rwkv", "--output", str(out)])
    results = {r.family: r.result for r in rows}
    assert results == {
        "llama": "written",
        "phi": "measured",
        "diffllama": "refused",
        "rwkv": "not planned",
    }
    text = out.read_text()
    assert "Of 4 causal-LM families, 2 are planned" in text
    assert "| diffllama | refused | cannot build a reduced DiffLlamaForCausalLM" in text
