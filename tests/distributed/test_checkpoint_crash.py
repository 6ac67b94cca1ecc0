"""A rank killed in the middle of a save leaves the previous checkpoint intact and loadable.

Job 1 (2 ranks) saves checkpoint ``ckpt`` (weights W1), changes the weights and saves to the
same ``ckpt`` again; rank 1 dies (``os._exit``) right after writing its shard, before the
save can finish. Job 2 (new processes) must load W1 from ``ckpt``, refuse the unfinished
staging directory, and be able to overwrite ``ckpt`` with a new complete save.

A rank that stops answering during an ``async_save`` (its host died: SIGSTOP, so its sockets
stay open) fails the other ranks' background save within the job's timeout, and a rank that
gives up meanwhile still exits (Note [Async save timeout] in ``state_dict_saver.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASYNC_TIMEOUT_S = 10.0  # the default group's timeout in the async-save fault job
ASYNC_LIMIT_S = 40.0  # the timeout, with room for DCP's steps and a loaded 2-core machine
ASYNC_WORLD = 3
ASYNC_STOPPED = ASYNC_WORLD - 1


def _async_save_rank(out: str, rank: int, port: int) -> None:
    """One rank of the async-save fault job (run by ``python -c``); its store at ``port``.

    Every rank saves once, so the async group exists, then saves again. Rank 2 stops (SIGSTOP)
    in its write, as a dead host would. Rank 0 waits for the save's result; rank 1 gives up at
    once and ends with an error, while its background save still waits for rank 2. Ranks 0
    and 1 write ``rank<R>.json`` with the wall-clock time the save began.
    """
    from datetime import timedelta

    from tools.ranks import set_rank_environment

    set_rank_environment(rank, ASYNC_WORLD, port, "ERROR")
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    torch.set_num_threads(1)
    from torch_sagemaker.checkpoint import CheckpointError
    from torch_sagemaker.checkpoint.async_utils import maybe_finalize_async_calls
    from torch_sagemaker.checkpoint.state_dict_saver import async_save

    dist.init_process_group("gloo", timeout=timedelta(seconds=ASYNC_TIMEOUT_S))
    async_save({"x": torch.full((4,), float(rank))}, checkpoint_id=f"{out}/first")
    maybe_finalize_async_calls(blocking=True)

    class StoppingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            if rank == ASYNC_STOPPED:
                os.kill(os.getpid(), signal.SIGSTOP)
            return super().write_data(plan, planner)

    began = time.time()
    async_save(
        {"x": torch.full((4,), float(rank))},
        checkpoint_id=f"{out}/second",
        storage_writer=StoppingWriter(f"{out}/second"),
    )
    result: dict = {"began": began}
    if rank == 1:
        with open(f"{out}/rank1.json", "w") as f:
            json.dump(result, f)
        raise SystemExit(3)  # as a rank whose own collective failed; exit joins the save
    try:
        maybe_finalize_async_calls(blocking=True)
        result["error"] = None
    except CheckpointError as e:
        result["error"] = str(e)
    result["seconds"] = time.time() - began
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def test_a_stopped_rank_fails_the_others_async_save_within_the_timeout(tmp_path):
    from tools.ranks import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    procs = []
    for rank in range(ASYNC_WORLD):
        code = (
            "from tests.distributed.test_checkpoint_crash import _async_save_rank; "
            f"_async_save_rank({str(tmp_path)!r}, {rank}, {port})"
        )
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO))
    ended: dict[int, tuple[float, int]] = {}
    deadline = time.monotonic() + 120  # start-up, the first save, and the limit
    try:
        while len(ended) < ASYNC_STOPPED and time.monotonic() < deadline:
            for rank, p in enumerate(procs[:ASYNC_STOPPED]):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = (time.time(), p.returncode)
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert len(ended) == ASYNC_STOPPED, (
        f"ranks {sorted(set(range(ASYNC_STOPPED)) - set(ended))} had not exited 120 s after "
        f"starting, with a {ASYNC_TIMEOUT_S:.0f} s timeout"
    )
    waited = json.loads((tmp_path / "rank0.json").read_text())
    gave_up = json.loads((tmp_path / "rank1.json").read_text())
    assert waited["error"] and "async save of" in waited["error"], waited
    assert "timed out" in waited["error"].lower(), waited
    assert waited["seconds"] < ASYNC_LIMIT_S, waited
    assert ended[0][1] == 0, ended
    # Rank 1 ended with its own error, once its background save had failed too.
    assert ended[1][1] == 3, ended
    assert ended[1][0] - gave_up["began"] < ASYNC_LIMIT_S, (ended, gave_up)


def _async_group_timeouts(root: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from torch_sagemaker._torch_compat import c10d as c10d_compat
    from torch_sagemaker.checkpoint.async_utils import maybe_finalize_async_calls
    from torch_sagemaker.checkpoint.state_dict_saver import (
        _ASYNC_GROUPS,
        _mirrored_timeout,
        async_save,
    )
    from torch_sagemaker.smddp import SMDDPOptions

    ranks = [0, 1]
    gloo = dist.new_group(ranks, timeout=timedelta(seconds=7))
    smddp = dist.new_group(ranks, backend="smddp", timeout=timedelta(seconds=9))
    configured = dist.new_group(ranks, backend="smddp", pg_options=SMDDPOptions(timeout=5))
    mirrored = {
        name: _mirrored_timeout(group).total_seconds()
        for name, group in [("default", None), ("gloo", gloo), ("smddp", smddp)]
        + [("configured", configured)]
    }
    # One async group for both saves (same ranks): each save's timeout is set on it.
    applied = {}
    for name, group in [("gloo", gloo), ("default", None)]:
        async_save({"step": 1}, checkpoint_id=f"{root}/{name}", process_group=group)
        maybe_finalize_async_calls(blocking=True)
        applied[name] = c10d_compat.group_timeout(_ASYNC_GROUPS[tuple(ranks)]).total_seconds()
    return {"mirrored": mirrored, "applied": applied}


def test_async_group_takes_the_timeout_of_the_group_it_mirrors(tmp_path):
    from torch_sagemaker.smddp import backend

    if not backend.is_available():
        pytest.skip("smddp extension not built")
    results = run_distributed(
        _async_group_timeouts, str(tmp_path), world_size=2, timeout=120, pg_timeout=120
    )
    for r in results:
        assert r["mirrored"] == {"default": 120, "gloo": 7, "smddp": 9, "configured": 5}, r
        assert r["applied"] == {"gloo": 7, "default": 120}, r
