"""FSDP1's ``LOCAL_STATE_DICT`` after ``tsm.init``: what it refuses, and to whom (2 ranks).

The scripts' ``local`` checkpoint type resumes exactly in
``tests/distributed/test_smp_script_checkpoints.py``. Here: a local state dict loaded into
another layout is refused with the sizes named, and a unit the FSDP1 patch did not build (an
``exempt`` model given its own mesh) keeps PyTorch's refusal of ``LOCAL_STATE_DICT``
(Note [LOCAL_STATE_DICT on SMP's meshes]).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.launcher import run_distributed


def _fsdp(width: int, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True, **kwargs)


def _local_state_dict_rules() -> dict:
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from torch_sagemaker.sharding import exempt

    tsm.init({"hybrid_shard_degree": dist.get_world_size()})
    out: dict = {}
    saved = _fsdp(6)
    with FSDP.state_dict_type(saved, StateDictType.LOCAL_STATE_DICT):
        state = saved.state_dict()
        saved.load_state_dict(state)  # its own output loads (use_orig_params=True)
    wider = _fsdp(10)
    with FSDP.state_dict_type(wider, StateDictType.LOCAL_STATE_DICT):
        try:
            wider.load_state_dict(state)
        except ValueError as error:
            out["other_layout"] = str(error)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = FSDP(exempt(nn.Linear(4, 4)), device_id=torch.device("cpu"), device_mesh=mesh)
    with FSDP.state_dict_type(theirs, StateDictType.LOCAL_STATE_DICT):
        try:
            theirs.state_dict()
        except RuntimeError as error:
            out["not_ours"] = str(error)
    return out


@pytest.mark.distributed
def test_local_state_dict_refusals():
    for out in run_distributed(_local_state_dict_rules, world_size=2, backend="smddp"):
        assert "flat parameter shard has" in out["other_layout"], out
        assert "only loads into the layout it was saved from" in out["other_layout"], out
        assert "DeviceMesh is not compatible with LOCAL_STATE_DICT" in out["not_ours"], out
