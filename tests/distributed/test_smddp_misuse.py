"""smddp under calls a correct training script does not make: operands that overlap, ranks
configured differently, outputs that broadcast one element, waits with a timeout, huge
timeouts. Each case once crashed, hung or returned wrong values; gloo's behaviour is the
reference. A group destroyed or aborted while in use: test_smddp_group_lifetime.py."""

import os
import time

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.smddp_rank_helpers import await_told, tell
from tests.distributed.smddp_rank_helpers import cpu_backend as _cpu
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _overlapping_operands():
    """Inputs that overlap the output elsewhere than at this rank's own part, in ordinary
    memory and in the pool, on smddp and gloo: every rank's results."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    n = 1 << 18  # 1 MiB of float32 per rank: above the zero-copy threshold
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        # all_gather_into_tensor, input shifted by one element inside the output (no pool).
        buf = torch.arange(9.0) + 100 * me
        dist.all_gather_into_tensor(buf[0:8], buf[1:5], group=group)
        out[(name, "shifted")] = buf.tolist()
        # all_gather_into_tensor, pool output, input the *other* rank's slot of it.
        pooled = _cpu().allocate_tensor(2 * n, dtype=torch.float32, device=torch.device("cpu"))
        pooled.fill_(-1)
        other = pooled[(1 - me) * n : (2 - me) * n]
        other.copy_(torch.arange(n, dtype=torch.float32) + 1e6 * me)
        dist.all_gather_into_tensor(pooled, other, group=group)
        out[(name, "pool gather")] = pooled.clone()
        # reduce_scatter_tensor, pool input, output the other rank's block of it.
        pooled.copy_(torch.arange(2 * n, dtype=torch.float32) * (me + 1))
        dist.reduce_scatter_tensor(pooled[(1 - me) * n : (2 - me) * n], pooled, group=group)
        out[(name, "pool scatter")] = pooled.clone()
    # The usual in-place forms still read in place (zero copy): FSDP2's all-gather input is
    # its own slot of the output, a reduce-scatter output its own block of the input.
    stats = backend.pool_stats(dist.group.WORLD)
    before = stats["zero_copy_ops"]
    pooled = _cpu().allocate_tensor(2 * n, dtype=torch.float32, device=torch.device("cpu"))
    pooled[me * n : (me + 1) * n] = float(me + 1)
    dist.all_gather_into_tensor(pooled, pooled[me * n : (me + 1) * n])
    gathered = pooled.clone()
    pooled.copy_(torch.arange(2 * n, dtype=torch.float32))
    dist.reduce_scatter_tensor(pooled[me * n : (me + 1) * n], pooled)
    scattered = pooled[me * n : (me + 1) * n].clone()
    zero_copy = backend.pool_stats(dist.group.WORLD)["zero_copy_ops"] - before
    return out, gathered, scattered, zero_copy


def test_overlapping_operands_give_gloos_results_and_in_place_stays_zero_copy():
    import torch

    n = 1 << 18
    for rank, (out, gathered, scattered, zero_copy) in enumerate(
        run_distributed(_overlapping_operands, backend="smddp")
    ):
        for case in ("shifted", "pool gather", "pool scatter"):
            smddp, gloo = out[("smddp", case)], out[("gloo", case)]
            if isinstance(smddp, list):
                assert smddp == gloo, (rank, case, smddp, gloo)
            else:
                assert torch.equal(smddp, gloo), (rank, case, (smddp != gloo).sum().item())
        assert out[("smddp", "shifted")][:8] == [1, 2, 3, 4, 101, 102, 103, 104]
        assert gathered.view(2, n)[:, 0].tolist() == [1.0, 2.0]
        assert torch.equal(scattered, torch.arange(n, dtype=torch.float32) * 2 + 2 * rank * n)
        assert zero_copy == 2, zero_copy


def _all_to_all_in_place():
    """In-place all_to_all_single with unequal splits (own part moves first) on both backends."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    splits = [[1, 3], [3, 1]][me]  # rank 0 keeps 1 row, sends 3; rank 1 sends 3, keeps 1
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        t = torch.arange(4.0) + 10 * me
        dist.all_to_all_single(t, t.clone(), splits, splits, group=group)
        u = torch.arange(4.0) + 10 * me
        dist.all_to_all_single(u, u, splits, splits, group=group)  # the same memory
        out[name] = (t.tolist(), u.tolist())
    return out


def test_all_to_all_in_place_equals_out_of_place():
    for out in run_distributed(_all_to_all_in_place, backend="smddp"):
        assert out["smddp"][1] == out["smddp"][0] == out["gloo"][0], out


def _settings_differ_on_rank_1(variable, value):
    import torch.distributed as dist

    before = os.environ.get(variable)
    if dist.get_rank() == 1:
        os.environ[variable] = value
    try:
        dist.new_group([0, 1])
    except ValueError as e:
        return str(e)
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before
    return "no error"


@pytest.mark.parametrize(
    "variable, value",
    [("SMDDP_ONESHOT_BYTES", "0"), ("SMDDP_CHUNK_BYTES", "64K"), ("SMDDP_NET_ALGO", "ring")],
)
def test_ranks_with_different_algorithm_settings_fail_at_group_creation(variable, value):
    # Before: wrong all-reduce sums (one-shot threshold), wrong reduce-scatters and then a
    # hang (chunk size), with no error.
    messages = run_distributed(_settings_differ_on_rank_1, variable, value, backend="smddp")
    for message in messages:
        assert (
            f"has {variable}=" in message and "every rank of a group must use the same" in message
        )


def _one_rank_pinned_to_one_cpu():
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    cpus = os.sched_getaffinity(0)
    if me == 1:
        os.sched_setaffinity(0, {min(cpus)})  # 2 local ranks > 1 CPU: "oversubscribed"
    try:
        group = dist.new_group([0, 1])
        n = 3 << 18  # 3 MiB per rank: several chunks of either automatic size
        x = torch.arange(2 * n, dtype=torch.float32) * (me + 1)
        y = torch.empty(n)
        dist.reduce_scatter_tensor(y, x, group=group)
        z = torch.arange(4 * n, dtype=torch.float32) + me
        dist.all_reduce(z, group=group)
    finally:
        # Every thread of the process: the group's threads started while it was pinned.
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass  # the thread has ended
    want = torch.arange(2 * n, dtype=torch.float32)[me * n : (me + 1) * n] * 3
    return torch.equal(y, want), torch.equal(z, torch.arange(4 * n, dtype=torch.float32) * 2 + 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_ranks_with_different_cpu_affinity_agree_on_the_chunk_size():
    # Before: each rank chose its automatic chunk from its own affinity mask, and the
    # pinned rank read its peer's buffer at the wrong steps.
    assert run_distributed(_one_rank_pinned_to_one_cpu, backend="smddp") == [(True, True)] * 2


def _broadcast_outputs():
    """all_reduce, broadcast and recv into an expand()ed tensor (stride 0: every element is
    the same memory), on smddp and on gloo: the base tensors' values."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        # gloo reads and writes an expanded tensor's numel() elements from its first one, past
        # the end of a storage sized for the base (a heap overflow that glibc's malloc check
        # reports as "free(): invalid pointer"), so each base is the head of a storage that
        # holds them all, filled with the same value.
        base = torch.full((4,), float(me + 1))[:1]
        dist.all_reduce(base.expand(4), group=group)
        out[(name, "all_reduce")] = base.item()
        base = torch.full((6,), float(me + 1))[:2].view(2, 1)
        dist.broadcast(base.expand(2, 3), 0, group=group)
        out[(name, "broadcast")] = base.flatten().tolist()
    # The list all_gather copies into each output itself (gloo refuses expanded outputs).
    bases = [torch.zeros(1) for _ in range(2)]
    dist.all_gather([b.expand(3) for b in bases], torch.full((3,), me + 1.0))
    out[("smddp", "all_gather")] = [b.item() for b in bases]
    return out


def test_outputs_that_broadcast_one_element_take_the_result_as_on_gloo():
    # Before: torch's "more than one element of the written-to tensor refers to a single
    # memory location" from smddp's copy into the output, where gloo writes through.
    for out in run_distributed(_broadcast_outputs, backend="smddp"):
        for op in ("all_reduce", "broadcast"):
            assert out[("smddp", op)] == out[("gloo", op)], (op, out)
        assert out[("smddp", "all_reduce")] == 3.0
        assert out[("smddp", "all_gather")] == [1.0, 2.0]


def _coalesce_two_dtypes():
    import torch
    import torch.distributed as dist

    try:
        with dist._coalescing_manager():
            dist.all_reduce(torch.ones(3))
            dist.all_reduce(torch.ones(3, dtype=torch.float64))
        return "no error"
    except TypeError as e:
        message = str(e)
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still usable
    return message, t.tolist()


def test_coalescing_two_dtypes_names_the_rule():
    # Before: "input and output dtypes differ", in a call that has no output.
    for message, after in run_distributed(_coalesce_two_dtypes, backend="smddp"):
        assert "one dtype" in message and "Float and Double" in message, message
        assert after == [2.0, 2.0]


def _all_to_all_two_dtypes():
    """ProcessGroup.alltoall (below dist.all_to_all's own dtype check) with float32 and float64
    pieces, each input of its output's dtype: the error, then whether the group still works."""
    import torch
    import torch.distributed as dist

    ins = [torch.tensor([1.5, 2.5]), torch.tensor([7.0], dtype=torch.float64)]
    outs = [torch.zeros(2), torch.zeros(1, dtype=torch.float64)]
    try:
        dist.group.WORLD.alltoall(outs, ins, dist.AllToAllOptions()).wait()
        message = f"no error: outputs {[o.tolist() for o in outs]}"
    except TypeError as e:
        message = str(e)
    t = torch.ones(2)
    dist.all_reduce(t)
    return message, t.tolist()


def test_all_to_all_of_two_dtypes_names_the_rule():
    # Before: the pieces were concatenated with at::cat, which promoted them all to float64
    # while the byte spans came from each piece's own size: wrong outputs and no error.
    for message, after in run_distributed(_all_to_all_two_dtypes, backend="smddp"):
        assert "inputs[0] is Float and inputs[1] is Double" in message, message
        assert after == [2.0, 2.0]


def _wait_with_timeout_on_a_late_peer():
    """Rank 0 waits 1 s for an all_reduce that rank 1 makes only after that wait returned
    (or, if it never does, after 20 s: then rank 0's wait returns late and the test fails)."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        await_told("late peer: rank 0's timed wait returned", timeout_s=20)
        dist.all_reduce(torch.ones(4))
        return None
    work = dist.all_reduce(torch.ones(4), async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=__import__("datetime").timedelta(seconds=1))
        outcome = "completed"
    except RuntimeError as e:
        outcome = str(e)
    waited = time.monotonic() - start
    tell("late peer: rank 0's timed wait returned")
    work.wait()  # it still completes once the peer arrives
    return outcome, waited


def test_wait_with_a_timeout_returns_when_it_runs_out():
    # Before: wait(timeout=1 s) ran the collective itself and returned after the peer came.
    outcome, waited = run_distributed(_wait_with_timeout_on_a_late_peer, backend="smddp")[0]
    assert "timed out" in outcome and waited < 3, (outcome, waited)


def _group_with_timeout(seconds):
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    group = dist.new_group([0, 1], pg_options=SMDDPOptions(timeout=seconds))
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    return t.tolist()


def test_a_huge_timeout_means_waiting_long_not_failing_at_once():
    # Before: 1e10 s overflowed the deadline into the past; set-up "timed out" at once.
    assert run_distributed(_group_with_timeout, 1e10, backend="smddp") == [[2.0] * 4] * 2
