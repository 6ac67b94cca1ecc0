"""tsm.state before init: defaults, overrides recorded by assignment, clear errors."""

import pytest
import torch.sagemaker as tsm

from torch_sagemaker.state import State


def test_before_init_reads_defaults_and_records_overrides():
    s = State()
    assert not s.initialized
    assert s.tensor_parallel_degree == 1 and s.activation_loading_horizon == 2
    s.tensor_parallel_degree = 1
    s.cp_size = 1  # SMP alias maps to context_parallel_degree
    s.hybrid_shard_degree = 2
    assert s.overrides == {"tensor_parallel_degree": 1, "context_parallel_degree": 1, "hybrid_shard_degree": 2}
    assert s.hybrid_shard_degree == 2
    s.reset()
    assert s.overrides == {}


def test_unknown_attribute_assignment_is_refused():
    with pytest.raises(AttributeError, match="not a config parameter"):
        State().tensor_paralel_degree = 2


@pytest.mark.parametrize("name", ["rank", "world_size", "tp_rank", "dp_size", "device_mesh",
                                  "tp_process_group", "ranker", "fsdp_mesh"])
def test_topology_needs_init(name):
    with pytest.raises(RuntimeError, match=rf"tsm.state.{name} is only available after"):
        getattr(State(), name)


def test_public_surface():
    assert tsm.state is __import__("torch_sagemaker").state
    assert not tsm.is_initialized()
    for name in ("init", "is_initialized", "state", "transform", "offload_wrapper", "SMPConfig", "__version__"):
        assert hasattr(tsm, name), name
