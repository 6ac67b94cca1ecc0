"""What ``tsm.init`` does on a CUDA machine, with CUDA mocked: the backend string it asks for
(Note [Backend for CUDA tensors] in torch_sagemaker/smddp/backend.py), the GPU it makes
current, and the chunk plan of the staged all-reduce."""

import pytest
import torch
import torch.distributed as dist

from torch_sagemaker import _init, env_settings
from torch_sagemaker.smddp import backend

needs_ext = pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built")


@needs_ext
def test_smddp_is_registered_for_cpu_and_cuda():
    assert backend.register()
    assert set(dist.Backend.backend_capability[backend.BACKEND_NAME]) == {"cpu", "cuda"}
    # "smddp" alone then serves both devices with one backend object.
    cfg = dist.distributed_c10d.BackendConfig(dist.Backend("smddp"))
    assert cfg.get_device_backend_map() == {"cpu": "smddp", "cuda": "smddp"}


@needs_ext
@pytest.mark.parametrize(
    ("cuda", "choice", "expected"),
    [
        (False, "smddp", "smddp"),
        (False, "nccl", "smddp"),  # no CUDA: nothing to give NCCL
        (True, "smddp", "smddp"),
        (True, "nccl", "cpu:smddp,cuda:nccl"),
    ],
)
def test_default_backend(monkeypatch, cuda, choice, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert backend.default_backend(choice) == expected
    assert backend.default_backend(choice, cuda=cuda) == expected


def test_default_backend_without_the_extension(monkeypatch):
    monkeypatch.setattr(backend, "register", lambda: False)
    assert backend.default_backend(cuda=False) == "gloo"
    assert backend.default_backend(cuda=True) == "cpu:gloo,cuda:nccl"


def test_default_backend_rejects_unknown_choice():
    with pytest.raises(ValueError, match="'mpi'.*expected 'smddp' or 'nccl'"):
        backend.default_backend("mpi")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, "smddp"), ({"TSM_CUDA_BACKEND": "NCCL"}, "nccl"), ({"TSM_CUDA_BACKEND": ""}, "smddp")],
)
def test_cuda_backend_from_environment(environ, expected):
    assert env_settings.cuda_backend(environ) == expected


def test_cuda_backend_rejects_unknown_value():
    with pytest.raises(env_settings.ConfigError, match="TSM_CUDA_BACKEND='gloo'.*smddp, nccl"):
        env_settings.cuda_backend({"TSM_CUDA_BACKEND": "gloo"})


@pytest.mark.parametrize(
    ("cuda", "local_rank", "count", "expected"),
    [
        (True, "3", 8, 3),
        (True, "9", 8, 1),  # more local ranks than GPUs (ranks share GPUs)
        (True, None, 8, None),  # no LOCAL_RANK: the script's choice stands
        (True, "x", 8, None),
        (True, "\u00b2", 8, None),  # "²".isdigit(), but int() raised on it
        (True, "1" * 5000, 8, None),  # more digits than int() takes
        (False, "1", 0, None),
    ],
)
def test_init_sets_the_device_from_local_rank(monkeypatch, cuda, local_rank, count, expected):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    _init._set_cuda_device()
    assert calls == ([] if expected is None else [expected])


def test_init_creates_the_group_with_the_chosen_backend(monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "register", lambda: True)
    monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: seen.setdefault("b", b))
    monkeypatch.setattr(_init, "log_rank0", lambda *a: None)
    for var, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TSM_CUDA_BACKEND", "nccl")
    _init._ensure_process_group(_init._read_launcher())
    assert seen["b"] == "cpu:smddp,cuda:nccl"
    seen.clear()
    monkeypatch.delenv("TSM_CUDA_BACKEND")
    _init._ensure_process_group(_init._read_launcher())
    assert seen["b"] == "smddp"


@needs_ext
@pytest.mark.parametrize(
    ("numel", "chunk", "expected"),
    [
        (0, 4, [(0, 0)]),  # Note [Empty staged calls]: one empty collective
        (1, 4, [(0, 1)]),
        (4, 4, [(0, 4)]),
        (9, 4, [(0, 4), (4, 4), (8, 1)]),
        (3, 100, [(0, 3)]),
    ],
)
def test_plan_chunks(numel, chunk, expected):
    from torch_sagemaker import _C

    assert _C._plan_chunks(numel, chunk) == expected


@needs_ext
def test_plan_chunks_rejects_bad_arguments():
    from torch_sagemaker import _C

    with pytest.raises(ValueError, match="chunk_elems > 0"):
        _C._plan_chunks(10, 0)
