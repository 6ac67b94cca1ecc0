"""SMP's checkpoint API as its example scripts call it: the file-system writer and reader, the
sharded-save strategy, FSDP1's full state dict config, and the DCP patches (no processes)."""

from __future__ import annotations

import pytest
import torch


def test_file_system_writer_hooks_and_reader_path(tmp_path):
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint.filesystem import (
        DistributedFileSystemReader,
        DistributedFileSystemWriter,
        path_to_file_system,
    )

    seen = []
    writer = DistributedFileSystemWriter(
        tmp_path,
        pre_write_hooks=[lambda w: seen.append(("pre", w.is_coordinator))],
        post_write_hooks=[
            lambda w: seen.append(("post", sorted(p.name for p in w.path.iterdir())))
        ],
    )
    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, no_dist=True)
    assert (
        seen[0] == ("pre", True)
        and seen[1][0] == "post"
        and any(n.endswith(".distcp") for n in seen[1][1])
    )
    reader = DistributedFileSystemReader(tmp_path)
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], torch.arange(4.0)) and str(reader.path) == str(tmp_path)
    assert type(path_to_file_system(tmp_path)).__name__ == "FileSystem"


def test_load_takes_the_directory_from_storage_reader(tmp_path):
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemReader
    from torch_sagemaker.checkpoint.state_dict_loader import load
    from torch_sagemaker.checkpoint.state_dict_saver import save

    path = tmp_path / "llama_v2-3steps"
    save({"w": torch.arange(3.0), "total_steps": 3}, checkpoint_id=path)
    out = {"w": torch.zeros(3), "total_steps": 0}
    load(state_dict=out, storage_reader=DistributedFileSystemReader(path))  # the scripts' spelling
    assert torch.equal(out["w"], torch.arange(3.0)) and out["total_steps"] == 3

    class Unlocated:
        pass

    with pytest.raises(ValueError, match="does not say which directory.*pass checkpoint_id"):
        load(state_dict=out, storage_reader=Unlocated())


def test_pytorch_dist_save_sharded_strategy_validates():
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemWriter
    from torch_sagemaker.checkpoint.state_dict_saver import (
        PyTorchDistSaveShardedStrategy,
    )

    writer = PyTorchDistSaveShardedStrategy(thread_count=3).storage_writer("/tmp/x")
    assert isinstance(writer, DistributedFileSystemWriter) and writer.thread_count == 3
    with pytest.raises(ValueError, match="only backend='torch_dist'"):
        PyTorchDistSaveShardedStrategy(backend="zarr")
    with pytest.raises(ValueError, match="keep_only_main_replica=False"):
        PyTorchDistSaveShardedStrategy(keep_only_main_replica=False)
    with pytest.raises(ValueError, match="thread_count=0"):
        PyTorchDistSaveShardedStrategy(thread_count=0)


def test_full_state_dict_config_takes_translate_on_save_once_installed():
    from torch.distributed.fsdp.api import FullStateDictConfig

    from torch_sagemaker.sharding import fsdp1_state_dict

    fsdp1_state_dict.install()
    try:
        assert FullStateDictConfig(rank0_only=True, offload_to_cpu=True).translate_on_save is True
        cfg = FullStateDictConfig(rank0_only=True, translate_on_save=False)
        assert cfg.translate_on_save is False and cfg.rank0_only is True
    finally:
        fsdp1_state_dict.uninstall()
    with pytest.raises(TypeError):
        FullStateDictConfig(translate_on_save=True)
    fsdp1_state_dict.install()  # as tsm.init leaves it for the rest of the session


def test_dcp_patches_are_installed_at_import_and_undone_by_uninstall():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import optimizer as dcp_optimizer
    from torch.distributed.checkpoint import utils as dcp_utils
    from torch.distributed.tensor import DTensor

    from torch_sagemaker.checkpoint import dcp_patches

    assert (
        dcp_optimizer.load_sharded_optimizer_state_dict
        is dcp_patches.load_sharded_optimizer_state_dict
    )
    assert dcp.load_sharded_optimizer_state_dict is dcp_patches.load_sharded_optimizer_state_dict
    native = dcp_patches.load_sharded_optimizer_state_dict.__tsm_native__
    hook = DTensor.__get_tensor_shard__  # Note [Packed shards in checkpoints]
    assert hook is not hook.__tsm_native__
    dcp_patches.uninstall()
    try:
        assert dcp_optimizer.load_sharded_optimizer_state_dict is native
        assert dcp_utils._DistWrapper.__init__ is dcp_patches._native_wrapper_init
        assert DTensor.__get_tensor_shard__ is hook.__tsm_native__
    finally:
        dcp_patches.install()


def test_dcp_patches_uninstall_restores_pytorch_after_a_reload():
    # A reload finds the patches installed; uninstall must still restore PyTorch's functions.
    import importlib

    from torch.distributed.checkpoint import optimizer as dcp_optimizer
    from torch.distributed.checkpoint import utils as dcp_utils

    from torch_sagemaker.checkpoint import dcp_patches

    torch_init = dcp_patches._native_wrapper_init
    torch_load = dcp_patches.load_sharded_optimizer_state_dict.__tsm_native__
    reloaded = importlib.reload(dcp_patches)
    reloaded.install()
    reloaded.uninstall()
    try:
        assert dcp_utils._DistWrapper.__init__ is torch_init
        assert dcp_optimizer.load_sharded_optimizer_state_dict is torch_load
    finally:
        reloaded.install()


def test_block_split_checkpoint_hooks_take_only_whole_strided_dtensors():
    # The package's DCP hooks describe a tensor split block by block (GPT-2's packed c_attn)
    # one chunk per block; a partial sum, or any other layout, stays PyTorch's.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from torch_sagemaker._torch_compat.dtensor import StridedShard
    from torch_sagemaker.checkpoint.strided_shards import _block_chunks

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.arange(12.0).reshape(2, 6)
        packed = DTensor.from_local(local, mesh, [StridedShard(1, split_factor=3)])
        chunks = _block_chunks(packed)
        assert chunks is not None
        assert [tuple(c.offsets) for c, *_ in chunks] == [(0, 0), (0, 2), (0, 4)]
        assert _block_chunks(DTensor.from_local(local, mesh, [Shard(1)])) is None
        square = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
        partial = DTensor.from_local(local, square, [StridedShard(1, split_factor=3), Partial()])
        assert _block_chunks(partial) is None
    finally:
        if owned:
            dist.destroy_process_group()
