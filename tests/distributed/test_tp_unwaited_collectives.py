"""Tensor parallelism under activation checkpointing leaves no collective unwaited (2 ranks).

A checkpointed layer's recompute stops at the last tensor its backward needs, so a
row-parallel output's collective issued before that point and only used after it is never
waited for; its Work (holding the output) stayed in c10d's registry for good, one per layer
and step: GPT-NeoX's parallel residual sums the attention's output only after the MLP
(Note [Collectives nobody waits for] in torch_sagemaker/_torch_compat/c10d.py). Checked as
SMP's scripts checkpoint (``apply_activation_checkpointing`` with ``NO_REENTRANT``) and with
``checkpoint_transformer_layers``, against Llama, whose sequential residual waits for both.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import batch, build


def _unwaited_per_step(family: str, how: str) -> list[int]:
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from torch_sagemaker._torch_compat.c10d import unwaited_collectives
    from torch_sagemaker.sharding.activation_checkpointing import checkpoint_transformer_layers

    tsm.init({"tensor_parallel_degree": 2})
    model = tsm.transform(build(family))
    if how == "smp_script":
        layer_class = type(model.get_decoder().layers[0])
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            check_fn=lambda m: isinstance(m, layer_class),
        )
    else:
        checkpoint_transformer_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = unwaited_collectives()
    counts = []
    for _ in range(3):
        ids = batch(0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(unwaited_collectives() - start)
    return counts


@pytest.mark.parametrize("how", ["smp_script", "checkpoint_transformer_layers"])
def test_checkpointed_tp_layers_leave_no_collective_unwaited(how):
    for family in ("gpt_neox", "llama"):
        for rank, counts in enumerate(
            run_distributed(_unwaited_per_step, family, how, world_size=2)
        ):
            assert counts == [0, 0, 0], (family, how, rank, counts)
