"""tsm.init in real processes: sources, precedence, process-group creation, re-init rules."""

import json

import pytest

from tests.distributed.launcher import DistributedTestError, run_distributed


def _init_with_env_and_argument(path):
    import os

    import torch.sagemaker as tsm

    os.environ["SM_HP_MP_PARAMETERS"] = json.dumps({"hybrid_shard_degree": 2})
    try:
        tsm.init(path)  # the file asks for hybrid_shard_degree=1, tensor_parallel_degree=2
        first = (tsm.state.hybrid_shard_degree, tsm.state.tensor_parallel_degree)
        tsm.init(path)  # same config again: a no-op
        try:
            tsm.init({"tensor_parallel_degree": 1})
            different = "no error"
        except RuntimeError as e:
            different = str(e)
        try:
            tsm.state.tensor_parallel_degree = 1
            frozen = "no error"
        except AttributeError as e:
            frozen = str(e)
    finally:
        del os.environ["SM_HP_MP_PARAMETERS"]
    return first, different, frozen


def _override_before_init():
    import torch.sagemaker as tsm

    tsm.state.tensor_parallel_degree = 1  # as SMP's example scripts do
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1})
    return tsm.state.tensor_parallel_degree, tsm.is_initialized()


def _bad_config_raises_everywhere():
    import torch.sagemaker as tsm

    try:
        tsm.init({"hybrid_shard_degree": 3, "tensor_parallel_degree": 3})
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_env_wins_and_reinit_rules(tmp_path):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"hybrid_shard_degree": 1, "tensor_parallel_degree": 2}))
    for first, different, frozen in run_distributed(
        _init_with_env_and_argument, str(path), world_size=4
    ):
        assert first == (2, 2)
        assert "already called with a different config" in different
        assert "cannot be changed after tsm.init()" in frozen


@pytest.mark.distributed
def test_pre_init_assignment_and_bad_config():
    assert run_distributed(_override_before_init, world_size=2) == [(1, True), (1, True)]
    for message in run_distributed(_bad_config_raises_everywhere, world_size=4):
        assert "tensor_parallel_degree=3: must divide world_size=4" in message
        assert "hybrid_shard_degree=3" in message


def _init_from_torchrun_env():
    import logging

    import torch.distributed as dist
    import torch.sagemaker as tsm

    from torch_sagemaker.logger import get_logger

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    get_logger().setLevel(logging.INFO)
    assert not dist.is_initialized()
    tsm.init()
    return dist.get_backend(), tsm.state.world_size, [r.getMessage() for r in records]


def _init_without_anything():
    import os

    import torch.sagemaker as tsm

    from torch_sagemaker import launch_env

    for var in launch_env.VARIABLES:
        os.environ.pop(var, None)
    messages = []
    for extra in ({}, {"RANK": "0"}):
        os.environ.update(extra)
        try:
            tsm.init()
            messages.append("no error")
        except RuntimeError as e:
            messages.append(f"{type(e).__name__}: {e}")
    return messages


@pytest.mark.distributed
def test_init_creates_process_group_from_torchrun_env():
    results = run_distributed(_init_from_torchrun_env, world_size=2, init_process_group=False)
    from torch_sagemaker.smddp.backend import default_backend

    for backend, world, _messages in results:
        assert backend == default_backend() and world == 2
    assert any("created the default process group" in m for m in results[0][2])


@pytest.mark.distributed
def test_init_without_process_group_or_torchrun_is_a_clear_error():
    ((none, partial),) = run_distributed(
        _init_without_anything, world_size=1, init_process_group=False
    )
    assert none.startswith("RuntimeError: torch.sagemaker.init() needs a default process group")
    for launcher in ("torchrun", "mpirun", "srun", "docs/launch.md"):
        assert launcher in none, none
    # A launcher half set up is named with the variable it lacks.
    assert partial.startswith("LaunchEnvError: WORLD_SIZE is not set: the torchrun launcher")


def test_launcher_error_type_is_assertion():
    assert issubclass(DistributedTestError, AssertionError)


def _init_with_rank_dependent_configs():
    import torch.distributed as dist
    import torch.sagemaker as tsm

    rank = dist.get_rank()
    messages = []
    for config in (
        {"tensor_parallel_degree": 2 if rank == 0 else 1, "random_seed": 7},
        {"tensor_parallel_degree": 3 if rank == 1 else 1},
    ):
        try:
            tsm.init(config)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    tsm.init({"hybrid_shard_degree": 2})  # the group is still usable afterwards
    return messages, tsm.state.hybrid_shard_degree


@pytest.mark.distributed
def test_ranks_with_different_configs_all_fail_naming_the_difference():
    results = run_distributed(_init_with_rank_dependent_configs, world_size=2)
    for rank, (messages, hsd) in enumerate(results):
        differ, invalid = messages
        assert (
            "tensor_parallel_degree differs across ranks: 2 on ranks [0], 1 on ranks [1]" in differ
        )
        assert "random_seed" not in differ and "same config" in differ
        if rank == 1:
            assert "tensor_parallel_degree=3: must divide world_size=2" in invalid
        else:
            assert (
                "ranks [1] got an invalid config (rank 1: tensor_parallel_degree=3: must divide "
                "world_size=2"
            ) in invalid
        assert hsd == 2


def _init_on_hosts_of_different_sizes():
    import os

    import torch.distributed as dist
    import torch.sagemaker as tsm

    tsm.state.reset()
    # What `srun -n 3 -N 2` gives: two ranks on the first host, one on the second.
    os.environ["LOCAL_WORLD_SIZE"] = "2" if dist.get_rank() < 2 else "1"
    try:
        tsm.init({"hybrid_shard_degree": 0})
    except ValueError as e:
        return str(e)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return "no error"


@pytest.mark.distributed
def test_hosts_with_different_numbers_of_ranks_are_refused_on_every_rank():
    """Each rank would resolve its own sharding plan from its host's rank count."""
    for message in run_distributed(_init_on_hosts_of_different_sizes, world_size=3, fresh=True):
        assert "hosts hold different numbers of ranks (LOCAL_WORLD_SIZE: 2 on ranks [0, 1], " in (
            message
        ), message
        assert "1 on ranks [2]" in message and "--nproc-per-node" in message


def _dtensor_caches_after_destroy_then_reset():
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.tensor import (
        Replicate,
        Shard,
        _collective_utils,
        _redistribute,
        distribute_tensor,
    )

    def sizes():
        return {
            "transform infos": _redistribute._gen_transform_infos.cache_info().currsize,
            "mesh topology": _collective_utils.MeshTopoInfo.build_from_mesh.cache_info().currsize,
            "planners": len(_redistribute._planner_cache),
        }

    tsm.init({"tensor_parallel_degree": 2})
    x = distribute_tensor(torch.arange(8.0), tsm.state.tp_mesh, [Shard(0)])
    assert x.redistribute(tsm.state.tp_mesh, [Replicate()]).to_local().tolist() == list(range(8))
    # The cost model's mesh topology cache fills on meshes of several dimensions; fill it here.
    _collective_utils.MeshTopoInfo.build_from_mesh(tsm.state.tp_mesh)
    filled = sizes()
    dist.destroy_process_group()  # the groups are gone; tsm.state still holds them
    tsm.state.reset()
    return filled, sizes()


@pytest.mark.distributed
def test_reset_after_destroy_empties_the_dtensor_caches_that_hold_groups():
    # fresh: the function destroys the default group, which a shared pool keeps for the next call.
    results = run_distributed(_dtensor_caches_after_destroy_then_reset, world_size=2, fresh=True)
    for filled, after in results:
        assert all(filled.values()), filled
        assert not any(after.values()), after
