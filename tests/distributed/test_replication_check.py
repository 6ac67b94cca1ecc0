"""The first-use check of replicated modules (Note [Replicated module check]) on 2 ranks.

A module whose output gradient differs between the TP ranks is refused while its
parameters train, and let through once the user froze them after the check was installed
(after ``tsm.transform``, before FSDP1 wraps the model): its gradient then trains nothing,
though FSDP1 gives its output a gradient (its weight is a view of a flat parameter that
trains).
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed


def _output_gradient_differs(freeze_after_install: bool) -> str:
    """A replicated Linear on the same input everywhere, before a trainable Linear in the
    same FSDP1 unit; each rank scales the first one's output by its own factor, so that
    output's gradient differs between the ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from torch_sagemaker.tensor_parallel import consistency

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    consistency.install(first, "first", mesh)
    if freeze_after_install:
        first.requires_grad_(False)
    factor = dist.get_rank() + 1.0

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = first, second

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x) * factor)

    model = FSDP(Model(), use_orig_params=True, device_id=torch.device("cpu"))
    try:
        model(torch.ones(2, 4)).sum().backward()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_module_frozen_after_the_check_is_installed_is_not_refused():
    trained = run_distributed(_output_gradient_differs, False)
    frozen = run_distributed(_output_gradient_differs, True)
    for message in trained:
        assert "first is replicated" in message, message
        assert "the gradient of its output differs" in message, message
    assert frozen == ["no error", "no error"], frozen
