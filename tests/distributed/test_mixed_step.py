"""Optimizer steps over DTensor and plain parameters (``torch_sagemaker/sharding/mixed_step.py``).

The layout that needs it (FSDP1, one rank per expert group) trains against one process with
AdamW's ``foreach`` path in test_expert_parallel.py; here, the switch itself on 2 ranks: on
only for optimizers that hold a registered parameter, off after every step, reset by the next
step after one that raised, and the step's values equal the single-tensor path's.
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed


def _steps() -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from torch_sagemaker.sharding import mixed_step

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    allowed = lambda: DTensor._op_dispatcher._allow_implicit_replication  # noqa: E731

    def params(seed: int):
        torch.manual_seed(seed)
        sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.randn(5) + dist.get_rank())  # differs by rank
        for p in (sharded, plain):
            p.grad = torch.ones_like(p) * 0.5
        return [sharded, plain]

    out = {}
    # Not registered: the list path refuses the mix (as on CUDA by default).
    unregistered = params(0)
    try:
        torch.optim.AdamW(unregistered, lr=0.1, foreach=True).step()
        out["unregistered"] = "stepped"
    except RuntimeError as e:
        out["unregistered"] = str(e)
    out["off_after_refusal"] = not allowed()

    foreach, single = params(0), params(0)
    mixed_step.register([foreach[0], single[0]])
    seen = []
    opt = torch.optim.AdamW(foreach, lr=0.1, foreach=True)
    for _ in range(3):
        opt.step(lambda: seen.append(allowed()))
    out["on_during_steps"] = seen == [True] * 3
    out["off_after_steps"] = not allowed()
    reference = torch.optim.AdamW(single, lr=0.1, foreach=False)
    for _ in range(3):
        reference.step()
    out["sharded_diff"] = (foreach[0] - single[0]).abs().max().full_tensor().item()
    out["plain_diff"] = (foreach[1] - single[1]).abs().max().item()
    out["plain_is_plain"] = type(foreach[1]) is torch.nn.Parameter

    # An optimizer holding nothing registered is left alone.
    other = params(1)[1:]
    seen.clear()
    torch.optim.AdamW(other, lr=0.1, foreach=True).step(lambda: seen.append(allowed()))
    out["other_left_alone"] = seen == [False]

    # A step that raised leaves the switch on; that optimizer's next step resets it.
    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        opt.step(boom)
    out["on_after_raise"] = allowed()
    opt.step()
    out["off_after_next_step"] = not allowed()
    return out


def test_the_switch_is_scoped_to_the_registered_optimizers_steps():
    for out in run_distributed(_steps, world_size=2, timeout=120):
        assert "got mixed torch.Tensor and DTensor" in out["unregistered"], out
        assert out["off_after_refusal"], out
        assert out["on_during_steps"] and out["off_after_steps"], out
        assert out["sharded_diff"] < 1e-6 and out["plain_diff"] < 1e-6, out
        assert out["plain_is_plain"], out
        assert out["other_left_alone"], out
        assert out["on_after_raise"] and out["off_after_next_step"], out
