"""Optimizer steps over DTensor and plain parameters (``torch_sagemaker/sharding/mixed_step.py``).

The layout that needs it (FSDP1, one rank per expert group) trains against one process with
AdamW's ``foreach`` path in test_expert_parallel.py; here, the switch itself on 2 ranks: on
only while an optimizer with both kinds of parameters steps, the previous setting back after
(also after a step that raised, at the next one), the values of the single-tensor path for
AdamW and SGD with momentum, no DTensor state for a plain parameter, and ``module.to()``.
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
    from torch.distributed.tensor.experimental import implicit_replication

    from torch_sagemaker._torch_compat.dtensor import implicit_replication_allowed as allowed
    from torch_sagemaker.sharding import mixed_step

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def params(seed: int) -> list[torch.nn.Parameter]:
        torch.manual_seed(seed)
        sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.randn(5) + dist.get_rank())  # differs by rank
        for p in (sharded, plain):
            p.grad = torch.ones_like(p) * 0.5
        return [sharded, plain]

    out = {}
    mixed_step.install()
    # Outside a step the list operators still refuse the mix (as CUDA's optimizers did).
    try:
        with torch.no_grad():
            torch._foreach_mul_(params(0), 0.5)
        out["outside"] = "ran"
    except RuntimeError as e:
        out["outside"] = str(e)

    seen = []
    for name, make in (
        ("adamw", lambda ps, fe: torch.optim.AdamW(ps, lr=0.1, foreach=fe)),
        ("sgd", lambda ps, fe: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1,
                                                foreach=fe)),
    ):  # fmt: skip
        lists, single = params(0), params(0)
        opt, reference = make(lists, True), make(single, False)
        seen.clear()
        for _ in range(3):
            opt.step(lambda: seen.append(allowed()))
            reference.step()
        out[f"{name}_on_during_steps"] = seen == [True] * 3
        out[f"{name}_off_after"] = not allowed()
        out[f"{name}_diff"] = max(
            (lists[0] - single[0]).abs().max().full_tensor().item(),
            (lists[1] - single[1]).abs().max().item(),
        )
        out[f"{name}_plain_stays_plain"] = type(lists[1]) is torch.nn.Parameter and not any(
            isinstance(v, DTensor) for v in opt.state[lists[1]].values()
        )
    module = torch.nn.Module()
    module.a, module.b = params(2)
    torch.optim.AdamW(module.parameters(), lr=0.1, foreach=True).step()
    module.to(torch.float64)  # no weak reference keeps the DTensor from being swapped
    out["module_to"] = module.a.dtype == module.b.dtype == torch.float64

    # An optimizer whose parameters do not mix is left alone; a caller's own setting is put back.
    seen.clear()
    torch.optim.AdamW(params(1)[1:], lr=0.1, foreach=True).step(lambda: seen.append(allowed()))
    out["unmixed_left_alone"] = seen == [False]
    with implicit_replication():
        opt.step()
        out["callers_setting_kept"] = allowed()

    # A step that raised leaves the switch on; that optimizer's next step restores it.
    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        opt.step(boom)
    out["on_after_raise"] = allowed()
    opt.step()
    out["off_after_next_step"] = not allowed()
    return out


def test_the_switch_covers_mixed_optimizers_steps_only():
    for out in run_distributed(_steps, world_size=2, timeout=120):
        assert "got mixed torch.Tensor and DTensor" in out["outside"], out
        for name in ("adamw", "sgd"):
            assert out[f"{name}_on_during_steps"] and out[f"{name}_off_after"], out
            assert out[f"{name}_diff"] < 1e-6, out
            assert out[f"{name}_plain_stays_plain"], out
        assert out["module_to"], out
        assert out["unmixed_left_alone"] and out["callers_setting_kept"], out
        assert out["on_after_raise"] and out["off_after_next_step"], out
