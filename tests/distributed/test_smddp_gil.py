"""smddp's worker threads never wait for the GIL (Note [Tensors are released in the caller's
thread] in csrc/smddp/common/scheduler.h).

In torch 2.13 a tensor with a Python object takes the GIL when its C++ reference count falls
from 2 to 1, so a thread that drops the last C++ reference to a tensor Python still holds
waits for the GIL. Here the Python thread keeps the GIL (a switch interval of a minute, pure
Python spinning) while asynchronous collectives run: the queue behind the first one must
still finish, and both ranks must see it finish.
"""

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _queue_behind_a_released_input(deadline_s: float) -> tuple[bool, float]:
    import sys
    import time

    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(4 * world)
    source = torch.full((4,), float(rank))  # held by Python; the backend's reference is its own
    summed = torch.ones(8)
    before = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # this thread keeps the GIL while it runs Python code
    try:
        first = dist.all_gather_into_tensor(gathered, source, async_op=True)
        second = dist.all_reduce(summed, async_op=True)
        start = time.perf_counter()
        while not second.is_completed() and time.perf_counter() - start < deadline_s:
            pass
        finished = second.is_completed()
        elapsed = time.perf_counter() - start
    finally:
        sys.setswitchinterval(before)
    first.wait()
    second.wait()
    assert torch.equal(gathered, torch.arange(world).repeat_interleave(4).float())
    assert torch.equal(summed, torch.full((8,), float(world)))
    return finished, elapsed


def test_async_collectives_finish_while_python_holds_the_gil():
    for finished, elapsed in run_distributed(
        _queue_behind_a_released_input, 5.0, world_size=2, backend="smddp", fresh=True
    ):
        assert finished, f"the second collective did not finish in {elapsed:.1f} s"
