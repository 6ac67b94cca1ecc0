"""Mixtral's auxiliary load-balancing loss under tensor parallelism 2 (2 ranks).

With ``output_router_logits=True`` Hugging Face records each router's logits and adds
``router_aux_loss_coef * load_balancing_loss_func(...)`` to the loss, mixing the logits with
plain tensors. The router's logits used to come back as DTensors and the forward raised;
the ``router`` style returns them plain. Loss, logits and every gradient against one process.
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import ATOL, batch, build, compare_forward_backward


def _aux_loss_case() -> dict:
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2})
    ref = build("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    model = tsm.transform(copy.deepcopy(ref))
    return compare_forward_backward(model, ref, batch(0))


@pytest.mark.distributed
def test_router_aux_loss_matches_one_process():
    for rank, r in enumerate(run_distributed(_aux_loss_case, world_size=2)):
        assert r["loss"] < ATOL and r["logits"] < ATOL, (rank, r)
        bad = {n: d for n, d in r["grads"].items() if d > ATOL}
        assert not bad and r["grad_scale"] > 1e-4, (rank, bad)
