"""A rank dying around a save's commit: every survivor reports what happened to the checkpoint.

Ranks on smddp save a checkpoint over an earlier one. In the first job (3 ranks) rank 1 dies
right after rank 0 (the coordinator) committed the new checkpoint: the survivors' collectives
fail, but the checkpoint is complete, and both survivors (the coordinator and a rank that
must ask it) say so (``CheckpointError`` with ``committed=True``, not a bare backend
``RuntimeError``). In the second job (2 ranks) the coordinator dies after every rank wrote
its files but before the commit: the survivor says the save is not there, and the earlier
checkpoint loads. Note [Commit outcome].
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.distributed.launcher import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def _state(rank: int, value: float) -> dict:
    import torch

    return {f"w{rank}": torch.full((256,), value + rank), "tag": f"v{value:g}"}


def _save_while_a_rank_dies(root: str, victim: int, after_commit: bool) -> None:
    """Saves v1, then v2 while ``victim`` dies; survivors record what ``save`` raised."""
    import torch.distributed as dist

    from torch_sagemaker.checkpoint import CheckpointError, atomic_dir, save

    rank = dist.get_rank()
    path = f"{root}/ckpt"
    save(_state(rank, 1.0), checkpoint_id=path)
    dying = f"{root}/rank{victim}_dying"
    if rank == victim and after_commit:
        # Die as the confirmation starts (the save protocol's second broadcast; the first one
        # starts the save; DCP's own are not counted), once the coordinator has committed:
        # the staging directory was renamed.
        real_broadcast = dist.broadcast_object_list
        calls: list = []

        def die_once_committed(*args, **kwargs):
            if not sys._getframe(1).f_globals["__name__"].endswith("checkpoint._group"):
                return real_broadcast(*args, **kwargs)
            calls.append(1)
            if len(calls) == 1:
                return real_broadcast(*args, **kwargs)
            while os.path.exists(f"{root}/.ckpt.partial") or not atomic_dir.is_complete(path):
                time.sleep(0.01)
            open(dying, "w").close()
            os._exit(1)

        dist.broadcast_object_list = die_once_committed
    if rank == victim and not after_commit:
        # The coordinator dies where it would commit: every rank has written its files.
        def die_instead_of_committing(*args, **kwargs):
            open(dying, "w").close()
            os._exit(1)

        atomic_dir.commit = die_instead_of_committing
    if rank == 0 and after_commit:
        # The coordinator confirms only once the victim is gone, so its broadcast fails.
        real_commit = atomic_dir.commit

        def commit_then_wait(*args, **kwargs):
            durable = real_commit(*args, **kwargs)
            while not os.path.exists(dying):
                time.sleep(0.01)
            time.sleep(0.5)
            return durable

        atomic_dir.commit = commit_then_wait
    started = time.monotonic()
    try:
        save(_state(rank, 2.0), checkpoint_id=path)
        report = {"error": None}
    except CheckpointError as e:
        report = {
            "error": str(e),
            "committed": getattr(e, "committed", None),
            "type": "CheckpointError",
        }
    except Exception as e:  # noqa: BLE001 - the defect: a bare backend error
        report = {"error": str(e), "type": type(e).__name__}
    report["seconds"] = time.monotonic() - started
    with open(f"{root}/report{rank}.json", "w") as f:
        json.dump(report, f)


def _reports(root, ranks) -> dict:
    return {r: json.loads(open(f"{root}/report{r}.json").read()) for r in ranks}


def _load_tag(path: str, world_size: int) -> tuple[str, float]:
    """The tag and the last rank's value of the checkpoint at ``path``, loaded in this process."""
    import torch

    from torch_sagemaker.checkpoint import load

    state = {**{f"w{r}": torch.zeros(256) for r in range(world_size)}, "tag": ""}
    load(state, checkpoint_id=path)
    return state["tag"], float(state[f"w{world_size - 1}"][0])


def test_peer_dying_after_the_commit_reports_a_complete_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(DistributedTestError, match="rank 1"):
        run_distributed(
            _save_while_a_rank_dies,
            root,
            1,
            True,
            world_size=3,
            backend="smddp",
            fresh=True,
            timeout=120,
            pg_timeout=30,
        )
    reports = _reports(root, (0, 2))
    for rank, report in reports.items():
        assert report["type"] == "CheckpointError" and report["committed"], (rank, report)
        assert "is complete and loadable (rank 0 committed it)" in report["error"], report
        assert f"{tmp_path}/ckpt" in report["error"] and report["seconds"] < 20, report
    assert _load_tag(f"{root}/ckpt", 3) == ("v2", 4.0)  # the new checkpoint, whole
    assert not os.path.exists(f"{root}/.ckpt.replaced")


def test_coordinator_dying_before_the_commit_reports_no_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(DistributedTestError, match="rank 0"):
        run_distributed(
            _save_while_a_rank_dies,
            root,
            0,
            False,
            world_size=2,
            backend="smddp",
            fresh=True,
            timeout=120,
            pg_timeout=30,
        )
    reports = _reports(root, (1,))
    for rank, report in reports.items():
        assert report["type"] == "CheckpointError" and not report["committed"], (rank, report)
        assert "this save is not in" in report["error"], report
        assert "holds a complete checkpoint from an earlier save" in report["error"], report
        assert report["seconds"] < 20, report
    assert _load_tag(f"{root}/ckpt", 2) == ("v1", 2.0)  # the earlier checkpoint, untouched
