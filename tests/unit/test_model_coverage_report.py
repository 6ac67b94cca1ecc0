"""How the coverage tool (``python -m tools.model_coverage``) classifies a family before any
rank runs: a family whose tiny model cannot be built is a failure, unless what is missing is
a package this machine lacks, which says nothing about tensor parallelism."""

from __future__ import annotations

import pytest


def _raising(error: Exception):
    def build(*args, **kwargs):
        raise error

    return build


@pytest.mark.parametrize(
    "error, result, named",
    [
        (
            ImportError("TimmWrapperModel requires the timm library but it was not found."),
            "skip",
            "needs a package not installed here: ImportError: TimmWrapperModel requires the timm",
        ),
        (ValueError("num_heads must divide hidden_size"), "fail", "the tiny config does not build"),
    ],
)
def test_a_tiny_model_that_does_not_build(monkeypatch, error, result, named):
    from tools.model_coverage import report, tiny

    monkeypatch.setattr(tiny, "build", _raising(error))
    row = report.classify("qwen3", "Qwen3ForCausalLM")
    assert row.result == result and named in row.detail, row
    assert not row.runs
