"""smddp under TORCH_DISTRIBUTED_DEBUG=DETAIL: c10d wraps every backend in a
ProcessGroupWrapper that compares each collective (with the group's sequence number) across
ranks before running it. Before smddp reported sequence numbers, creating any group in that
mode failed ("Backend smddp does not yet support sequence numbers")."""

import os

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _collectives_in_detail_mode():
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("smddp", rank=rank, world_size=2)
    out = {}
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    sub = dist.new_group([0, 1])
    g = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(g, torch.full((2,), float(rank)), group=sub)
    out["all_gather"] = [x.tolist() for x in g]
    works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    # Different shapes on the two ranks: the wrapper names the mismatch on both.
    try:
        dist.all_reduce(torch.ones(4 + rank))
        out["mismatch"] = "no error"
    except RuntimeError as e:
        out["mismatch"] = str(e)
    dist.destroy_process_group()
    return out


def test_collectives_and_mismatch_checks_in_detail_debug_mode():
    results = run_distributed(
        _collectives_in_detail_mode,
        world_size=2,
        backend="smddp",
        init_process_group=False,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )
    for r in results:
        assert r["all_reduce"] == [3.0] * 5
        assert r["broadcast"] == [1.0] * 3
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert "mismatch" in r["mismatch"].lower() and "sequence" not in r["mismatch"], r[
            "mismatch"
        ]
