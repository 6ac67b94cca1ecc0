"""A rank killed in the middle of a save leaves the previous checkpoint intact and loadable.

Job 1 (2 ranks) saves checkpoint ``ckpt`` (weights W1), changes the weights and saves to the
same ``ckpt`` again; rank 1 dies (``os._exit``) right after writing its shard, before the
save can finish. Job 2 (new processes) must load W1 from ``ckpt``, refuse the unfinished
staging directory, and be able to overwrite ``ckpt`` with a new complete save.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.launcher import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def _model():
    """A small FSDP2-sharded MLP with seeded weights (no transformers import: fast start)."""
    import torch
    import torch.sagemaker as tsm
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.sharding import fsdp2_mesh

    tsm.init({"hybrid_shard_degree": 2})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    fully_shard(model, mesh=fsdp2_mesh())
    return model


def _state(model):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(model), "tag": "W1"}


def _save_then_die(root: str) -> None:
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.checkpoint import FileSystemWriter

    from torch_sagemaker.checkpoint import save

    model = _model()
    save(_state(model), checkpoint_id=f"{root}/ckpt")

    class DyingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            result = super().write_data(plan, planner)
            if tsm.state.rank == 1:
                result.wait()
                os._exit(1)  # killed mid-save: shard written, save not finished
            return result

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = _state(model)
    state["tag"] = "W2"
    save(state, checkpoint_id=f"{root}/ckpt", storage_writer=DyingWriter("unused-until-reset"))


def _check_after_crash(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torch_sagemaker.checkpoint import CheckpointError, load, save

    model = _model()
    expected = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = _state(model)
    state["tag"] = ""
    load(state, checkpoint_id=f"{root}/ckpt")
    restored = all(
        torch.equal(v.to_local() if isinstance(v, DTensor) else v, expected[k])
        for k, v in model.state_dict().items()
    )
    try:
        load(_state(model), checkpoint_id=f"{root}/.ckpt.partial")
        partial_error = "no error"
    except CheckpointError as e:
        partial_error = str(e)
    # A later save overwrites the checkpoint and cleans up the unfinished one (once every
    # rank is done looking at it).
    dist.barrier()
    save({"model": _state(model)["model"], "tag": "W3"}, checkpoint_id=f"{root}/ckpt")
    again = {"model": _state(model)["model"], "tag": ""}
    load(again, checkpoint_id=f"{root}/ckpt")
    return dict(
        tag=state["tag"],
        restored=restored,
        partial_error=partial_error,
        tag_after=again["tag"],
        partial_left=os.path.exists(f"{root}/.ckpt.partial"),
    )


def test_killed_rank_leaves_previous_checkpoint_loadable(tmp_path):
    root = str(tmp_path)
    with pytest.raises(DistributedTestError):
        run_distributed(_save_then_die, root, world_size=2, fresh=True, timeout=120, pg_timeout=30)
    assert os.path.isdir(f"{root}/.ckpt.partial"), "the crash should have left an unfinished save"
    assert os.listdir(f"{root}/.ckpt.partial"), "rank 1 should have written its shard before dying"
    results = run_distributed(_check_after_crash, root, world_size=2, timeout=120)
    for r in results:
        assert r["tag"] == "W1" and r["restored"], r
        assert "incomplete" in r["partial_error"] and ".ckpt.partial" in r["partial_error"], r
        assert r["tag_after"] == "W3" and not r["partial_left"], r
