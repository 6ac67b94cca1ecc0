"""smddp collectives against directly computed references, on shared memory and on the
inter-host (TCP mesh) path forced on one machine."""

import pytest

from tests.distributed import test_smddp_support as checks
from tests.distributed.launcher import run_distributed
from torch_sagemaker.distributed import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _run(world_size, env=None, quick=False):
    results = run_distributed(
        checks.run_all, quick, world_size=world_size, backend="smddp", env=env, timeout=300
    )
    digests = [r.pop("digest") for r in results]
    assert all(d == digests[0] for d in digests), "ranks got different bits"
    assert all(r == results[0] for r in results)
    assert results[0]["all_reduce"] > 0
    return results[0]


def test_two_ranks_shared_memory():
    counts = _run(2)
    assert counts["all_reduce"] == sum(len(checks.ops_for(d)) for d in checks.ALL_DTYPES) * len(
        checks.SIZES
    )


def test_three_ranks_small_buffers_force_chunking():
    # 4 KiB buffers: every size above a few hundred elements runs many pipelined steps.
    _run(3, env={"SMDDP_BUFFER_BYTES": "4096", "SMDDP_ONESHOT_BYTES": "1024"}, quick=True)


def test_three_ranks_every_output_copy_streaming():
    # Streaming (non-temporal) stores normally start at outputs of several MiB; a 1-byte
    # threshold sends every copy into an output through them, odd sizes and offsets included.
    _run(3, env={"SMDDP_STREAM_BYTES": "1"}, quick=True)


def test_four_ranks_two_forced_hosts():
    # Two "hosts" of two ranks: shm reduce-scatter, TCP rail exchange, shm all-gather.
    _run(4, env={"SMDDP_FORCE_LOCAL_SIZE": "2"}, quick=True)


def test_two_ranks_one_per_forced_host():
    _run(2, env={"SMDDP_FORCE_LOCAL_SIZE": "1", "SMDDP_BUFFER_BYTES": "8192"}, quick=True)


def _layout_and_async():
    import torch.distributed as dist

    layout = checks.host_layout()
    return layout, checks.check_async_two_groups(), dist.get_world_size()


def test_forced_layout_and_async_ops_on_two_groups():
    res = run_distributed(
        _layout_and_async,
        world_size=4,
        backend="smddp",
        env={"SMDDP_FORCE_LOCAL_SIZE": "2"},
        timeout=300,
    )
    assert res[0][0] == [[0, 1], [2, 3]]
    assert all(r[1] == 4 * 40 for r in res)
