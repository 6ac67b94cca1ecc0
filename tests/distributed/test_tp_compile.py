"""``torch.compile`` of the decoder layers of a tensor-parallel model, against one process.

Compiling the layers of a model that ``tsm.transform`` split over 2 TP ranks (inductor, as
``torch.compile`` defaults to) used to give wrong gradients or fail: the TP region around
attention swaps the generator's state, Dynamo broke the graph there, and PyTorch's compiled
DTensor autograd went wrong at the break (Note [TP regions under torch.compile] in
``tensor_parallel/plan.py``). A region that draws nothing is skipped while compiling; one
that may draw (attention dropout in training) raises and names the fixes.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.hf_models import global_batches, tiny_llama
from tests.distributed.launcher import run_distributed


def _compiled_tp(attention_dropout: float) -> dict:
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2})
    batch = global_batches(1, 2)[0]
    model = tsm.transform(
        tiny_llama(attn_implementation="sdpa", attention_dropout=attention_dropout)
    )
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer)
    try:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}"}
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name.replace("._orig_mod", "")] = (
            grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        ).clone()
    return {"loss": float(loss), "grads": grads}


@pytest.mark.distributed
def test_compiled_tp_layers_match_one_process():
    batch = global_batches(1, 2)[0]
    ref = tiny_llama(attn_implementation="sdpa")
    ref_loss = ref(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    for rank, out in enumerate(run_distributed(_compiled_tp, 0.0, world_size=2, timeout=600)):
        assert "error" not in out, out
        assert abs(out["loss"] - float(ref_loss)) < 1e-5, (rank, out["loss"], float(ref_loss))
        for name, param in ref.named_parameters():
            torch.testing.assert_close(
                out["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}"
            )


@pytest.mark.distributed
def test_compiled_tp_attention_with_dropout_is_refused():
    for out in run_distributed(_compiled_tp, 0.1, world_size=2, timeout=600):
        assert "error" in out, "a compiled TP region with dropout must not run"
        assert "cannot be compiled" in out["error"] and "dropout" in out["error"], out["error"]
