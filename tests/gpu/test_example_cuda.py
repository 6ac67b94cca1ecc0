"""The example script on the GPU: 2 ranks sharing the GPUs, bf16, FSDP1 and FSDP2, over smddp.

Skipped without CUDA. ``tsm.init`` picks the GPU from ``LOCAL_RANK`` and the model, the data and
FSDP's buffers live there; the run must train (the loss falls over a few steps of a tiny
Llama) and report device memory, which only a run on the GPU does.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.distributed import test_examples as examples
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

STEPS = 8


@pytest.mark.parametrize("fsdp", ["fsdp1", "fsdp2"])
def test_example_script_trains_on_the_gpu(tmp_path, fsdp):
    config = os.path.join(examples.ROOT, "examples", "configs", "full_shard.json")
    summary, stdout = examples._train(
        tmp_path,
        2,
        "--smp-config",
        config,
        "--fsdp",
        fsdp,
        "--bf16",
        "1",
        "--max-steps",
        str(STEPS),
        "--lr",
        "3e-3",
    )
    assert summary["steps"] == STEPS, summary
    losses = summary["losses"]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    assert "smddp" in summary["title"], summary["title"]
    with open(tmp_path / "run" / "metrics.json") as f:
        rows = [r for r in json.load(f)["steps"] if "gpu_peak_gb" in r]
    assert rows and all(r["gpu_peak_gb"] > 0 for r in rows), rows[:1]
