"""The device staging path of smddp, run with CPU tensors (``stage_cpu=True``).

Device tensors are copied to host mirrors, reduced by the CPU algorithms and copied back,
the all-reduce in chunks (Note [Device staging], Note [Staging pipeline] in
csrc/smddp/backend/device_staging.h). With ``SMDDPOptions(stage_cpu=True)`` CPU tensors take that
same code, with no-op streams and a trace of every step, so the chunk schedule and the
wrapping of each collective are checked here without a GPU: results must be bit-identical
to the plain CPU path and to a reference, for odd sizes and sizes that are not a multiple of
the chunk, every dtype and every op; and the trace must show each chunk copied in, reduced
and copied back exactly once, in order. The CUDA side (events, streams, pinned memory) is
covered by tests/gpu/test_smddp_cuda.py.
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.staging_common import (
    CHUNK,
    distinct_data,
    staged_and_plain_groups,
    staging_trace,
)
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

SIZES = [0, 1, 7, 1023, 1024, 3 * 1024 + 7, 5000]  # elements


def _expected_allreduce_trace(n, esz):
    from torch_sagemaker import _C

    chunks = _C._plan_chunks(n, max(1, CHUNK // esz))
    steps = ["issue"] + [f"d2h {b}+{c}" for b, c in chunks]
    for b, c in chunks:
        steps += [f"reduce {b}+{c}", f"h2d {b}+{c}"]
    return steps


def _all_reduce_every_dtype_and_op():
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    staged, plain = staged_and_plain_groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    dtypes = [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    ]
    ops = {
        "SUM": ReduceOp.SUM,
        "AVG": ReduceOp.AVG,
        "PRODUCT": ReduceOp.PRODUCT,
        "MIN": ReduceOp.MIN,
        "MAX": ReduceOp.MAX,
        "BAND": ReduceOp.BAND,
        "BOR": ReduceOp.BOR,
        "BXOR": ReduceOp.BXOR,
        "PREMUL_SUM": dist._make_nccl_premul_sum(0.5),
    }
    failures, ran = [], 0
    for dtype in dtypes:
        for name, op in ops.items():
            for n in SIZES:
                mine = distinct_data(n, dtype, rank)
                ref = mine.clone()
                try:
                    dist.all_reduce(ref, op=op, group=plain)
                except (ValueError, TypeError, RuntimeError) as e:
                    # Unsupported here (e.g. AVG on integers): the staged path must refuse too.
                    got = mine.clone()
                    try:
                        dist.all_reduce(got, op=op, group=staged)
                        failures.append(f"{dtype} {name} n={n}: staged ran, plain raised {e}")
                    except (ValueError, TypeError, RuntimeError):
                        pass
                    staging_trace(staged)
                    continue
                got = mine.clone()
                dist.all_reduce(got, op=op, group=staged)
                ran += 1
                if not torch.equal(got, ref):
                    bad = (got != ref).nonzero().flatten()[:5].tolist()
                    failures.append(f"{dtype} {name} n={n}: differs at {bad}")
                trace = staging_trace(staged)
                want = _expected_allreduce_trace(n, mine.element_size())
                if trace != want:
                    failures.append(f"{dtype} {name} n={n}: trace {trace[:8]} != {want[:8]}")
    # SUM against a reference computed here from every rank's data.
    for dtype in (torch.float64, torch.int64):
        n = 3 * 1024 + 7
        got = distinct_data(n, dtype, rank)
        dist.all_reduce(got, group=staged)
        want = sum(distinct_data(n, dtype, r) for r in range(world))
        if not torch.equal(got, want):
            failures.append(f"{dtype} SUM differs from the reference")
    return failures, ran


def _expected_pipeline_trace(n, esz, step):
    from torch_sagemaker import _C

    chunks = _C._plan_chunks(n, max(1, CHUNK // esz))
    steps = ["issue"] + [f"d2h {b}+{c}" for b, c in chunks]
    for b, c in chunks:
        steps += [f"{step} {b}+{c}", f"h2d {b}+{c}"]
    return steps


def _gather_and_scatter_pipelines():
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    staged, plain = staged_and_plain_groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    failures, ran = [], 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        for n in SIZES:
            esz = torch.empty(0, dtype=dtype).element_size()
            # all_gather_into_tensor: every rank's part, in rank order.
            out = torch.zeros(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, distinct_data(n, dtype, rank), group=staged)
            want = torch.cat([distinct_data(n, dtype, r) for r in range(world)])
            if not torch.equal(out, want):
                failures.append(f"all_gather_into_tensor {dtype} n={n}")
            if staging_trace(staged) != _expected_pipeline_trace(n, esz, "gather"):
                failures.append(f"all_gather_into_tensor {dtype} n={n}: trace")
            ops = [ReduceOp.SUM, ReduceOp.MAX]
            if dtype.is_floating_point:
                ops.append(ReduceOp.AVG)
            for op in ops:
                mine = distinct_data(world * n, dtype, rank)
                got, ref = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
                dist.reduce_scatter_tensor(got, mine, op=op, group=staged)
                dist.reduce_scatter_tensor(ref, mine.clone(), op=op, group=plain)
                ran += 1
                if not torch.equal(got, ref):
                    failures.append(f"reduce_scatter_tensor {dtype} {op} n={n}")
                if staging_trace(staged) != _expected_pipeline_trace(n, esz, "reduce"):
                    failures.append(f"reduce_scatter_tensor {dtype} {op} n={n}: trace")
        # SUM against a reference computed here.
        if dtype in (torch.float32, torch.int64):
            n = 5000
            got = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter_tensor(got, distinct_data(world * n, dtype, rank), group=staged)
            staging_trace(staged)
            want = sum(distinct_data(world * n, dtype, r) for r in range(world))[
                rank * n : (rank + 1) * n
            ]
            if not torch.equal(got, want):
                failures.append(f"reduce_scatter_tensor {dtype} SUM vs reference")
    return failures, ran


def _other_collectives():
    import torch
    import torch.distributed as dist

    staged, plain = staged_and_plain_groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 3 * 1024 + 7
    failures = []

    def check(name, fn):
        got, ref = fn(staged), fn(plain)
        for g, r in zip(got, ref, strict=True):
            if not torch.equal(g, r):
                failures.append(f"{name}: differs from the plain path")
        trace = staging_trace(staged)
        if not trace or trace[0] != "issue" or not any(s.startswith(("d2h", "h2d")) for s in trace):
            failures.append(f"{name}: not staged (trace {trace})")

    def bcast(g):
        t = distinct_data(n, torch.float32, rank)
        dist.broadcast(t, src=1, group=g)
        return [t]

    def reduce(g):
        t = distinct_data(n, torch.float32, rank)
        dist.reduce(t, dst=0, group=g)
        return [t]

    def all_gather(g):
        outs = [torch.zeros(n) for _ in range(world)]
        dist.all_gather(outs, distinct_data(n, torch.float32, rank), group=g)
        return outs

    def all_gather_into_tensor(g):
        out = torch.zeros(world * n, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, distinct_data(n, torch.bfloat16, rank), group=g)
        return [out]

    def reduce_scatter(g):
        out = torch.zeros(n)
        dist.reduce_scatter(
            out, [distinct_data(n, torch.float32, rank, r) for r in range(world)], group=g
        )
        return [out]

    def reduce_scatter_unequal_parts(g):
        # input_list[p] is rank p's part: n + 5 p elements; then parts empty but rank 0's.
        sizes = [n + 5 * p for p in range(world)]
        out = torch.zeros(sizes[rank], dtype=torch.bfloat16)
        ins = [distinct_data(m, torch.bfloat16, rank, p) for p, m in enumerate(sizes)]
        dist.reduce_scatter(out, ins, op=dist.ReduceOp.MAX, group=g)
        out2 = torch.zeros(0) if rank else torch.zeros(7)
        ins2 = [torch.full((7,), float(rank))] + [torch.zeros(0)] * (world - 1)
        dist.reduce_scatter(out2, ins2, group=g)
        return [out, out2]

    def reduce_scatter_tensor(g):
        out = torch.zeros(n, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, distinct_data(world * n, torch.bfloat16, rank), group=g)
        return [out]

    def gather(g):
        outs = [torch.zeros(n) for _ in range(world)] if rank == 0 else None
        dist.gather(distinct_data(n, torch.float32, rank), outs, dst=0, group=g)
        return outs or []

    def scatter(g):
        out = torch.zeros(n)
        ins = [distinct_data(n, torch.float32, 0, r) for r in range(world)] if rank == 0 else None
        dist.scatter(out, ins, src=0, group=g)
        return [out]

    def all_to_all_single(g):
        out = torch.zeros(world * n, dtype=torch.int32)
        dist.all_to_all_single(out, distinct_data(world * n, torch.int32, rank), group=g)
        return [out]

    def all_to_all(g):
        outs = [torch.zeros(n, dtype=torch.int64) for _ in range(world)]
        dist.all_to_all(
            outs, [distinct_data(n, torch.int64, rank, r) for r in range(world)], group=g
        )
        return outs

    def non_contiguous_all_reduce(g):
        t = distinct_data(2 * n, torch.float32, rank).view(n, 2).t()  # strided: the mirror path
        dist.all_reduce(t, group=g)
        return [t]

    def send_recv(g):
        t = distinct_data(n, torch.float64, rank)
        peer = 1 - rank
        if rank == 0:
            dist.send(t, dst=dist.get_global_rank(g, peer), group=g)
            dist.recv(t, src=dist.get_global_rank(g, peer), group=g)
        else:
            dist.recv(t, src=dist.get_global_rank(g, peer), group=g)
            dist.send(t * 3, dst=dist.get_global_rank(g, peer), group=g)
        return [t]

    for fn in (
        bcast,
        reduce,
        all_gather,
        all_gather_into_tensor,
        reduce_scatter,
        reduce_scatter_unequal_parts,
        reduce_scatter_tensor,
        gather,
        scatter,
        all_to_all_single,
        all_to_all,
        non_contiguous_all_reduce,
        send_recv,
    ):
        check(fn.__name__, fn)

    # Async collectives queued back to back on one tensor run in issue order, each on the
    # result of the one before: sum, then the sum of the sums.
    t = distinct_data(n, torch.float64, rank)
    works = [dist.all_reduce(t, group=staged, async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    want = sum(distinct_data(n, torch.float64, r) for r in range(world)) * world**2
    if not torch.equal(t, want):
        failures.append("three queued async all_reduces: wrong result")
    # The future reports the caller's tensor, not a host mirror.
    t = distinct_data(n, torch.float32, rank)
    fut = dist.all_reduce(t, group=staged, async_op=True).get_future()
    (value,) = fut.wait()
    if value.data_ptr() != t.data_ptr():
        failures.append("the future's value is not the caller's tensor")
    staging_trace(staged)
    return failures


def test_staged_all_reduce_every_dtype_op_and_size_matches_plain_path_and_schedule():
    for failures, ran in run_distributed(_all_reduce_every_dtype_and_op, backend="smddp"):
        assert not failures, failures[:10]
        assert ran > 300  # the supported (dtype, op) pairs over every size


def test_staged_all_gather_and_reduce_scatter_pipelines():
    for failures, ran in run_distributed(_gather_and_scatter_pipelines, backend="smddp"):
        assert not failures, failures[:10]
        assert ran == 5 * len(SIZES) * 2 + 3 * len(SIZES)


def test_every_other_collective_through_the_staging_mirrors():
    for failures in run_distributed(_other_collectives, backend="smddp"):
        assert not failures, failures


# --- ranks that disagree: an error on every rank, never mixed data -----------------------------


def _staged_group(timeout_s, chunk=CHUNK):
    from datetime import timedelta

    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    return dist.new_group(
        [0, 1],
        backend="smddp",
        timeout=timedelta(seconds=timeout_s),
        pg_options=SMDDPOptions(stage_cpu=True, staging_chunk_bytes=chunk),
    )


def _staged_mismatches():
    """Calls the ranks disagree on, each in a group of its own (a failed collective poisons its
    group): what every rank raised, or None. Where a rank's chunks could pair with the other
    rank's separate calls, it makes those calls too."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    big, small = 2 * CHUNK // 4, CHUNK // 4  # float32: 2 chunks, 1 chunk

    def all_reduce(n):
        return lambda g: dist.all_reduce(torch.ones(n), group=g)

    def all_gather(n):
        return lambda g: dist.all_gather_into_tensor(torch.zeros(2 * n), torch.ones(n), group=g)

    def reduce_scatter(n):
        return lambda g: dist.reduce_scatter_tensor(torch.zeros(n), torch.ones(2 * n), group=g)

    def error(calls, chunk=CHUNK):
        g = _staged_group(timeout_s=10, chunk=chunk)
        try:
            for call in calls:
                call(g)
        except RuntimeError as e:
            return str(e)
        finally:
            staging_trace(g)
        return None

    errors = []
    for op in (all_reduce, all_gather, reduce_scatter):
        # Note [Chunks carry the whole call]: rank 0's two chunks against two calls of rank 1.
        errors.append(error([op(big), op(small)] if rank == 0 else [op(small), op(small)]))
        # Note [Empty staged calls]: an empty call against one of 4 elements.
        errors.append(error([op(0 if rank == 0 else 4), op(4)]))
    # One call cut into other chunks: 2 chunks on rank 0, one on rank 1.
    errors.append(error([all_reduce(big)], chunk=CHUNK if rank == 0 else 2 * CHUNK))
    return errors


def test_staged_calls_the_ranks_disagree_on_raise_on_every_rank():
    # Before: rank 0's chunks paired with rank 1's separate calls, and an empty call joined no
    # collective, so the next call paired with the peer's: mixed data and no error.
    results = run_distributed(_staged_mismatches, backend="smddp", fresh=True, pg_timeout=30)
    for rank, errors in enumerate(results):
        for case, message in enumerate(errors):
            assert message is not None and "mismatched collectives" in message, (rank, case, errors)
    assert "all_reduce (Float, SUM, 2048 elements)" in results[0][0], results[0][0]
    assert "all_reduce (Float, SUM, 0 elements)" in results[0][1], results[0][1]


def _expanded_outputs():
    """all_reduce, broadcast and recv into an expand()ed tensor (stride 0), staged and plain:
    the base tensors' values, or the error."""
    import torch
    import torch.distributed as dist

    staged, plain = staged_and_plain_groups()
    me = dist.get_rank()
    out = {}
    for name, group in (("staged", staged), ("plain", plain)):
        for op in ("all_reduce", "broadcast", "recv"):
            base = torch.full((2, 1), float(me + 1))
            try:
                if op == "all_reduce":
                    dist.all_reduce(base.expand(2, 3), group=group)
                elif op == "broadcast":
                    dist.broadcast(base.expand(2, 3), 0, group=group)
                elif me == 0:
                    dist.send(torch.arange(6.0).view(2, 3), 1, group=group)
                else:
                    dist.recv(base.expand(2, 3), 0, group=group)
                out[(name, op)] = base.flatten().tolist()
            except RuntimeError as e:
                out[(name, op)] = str(e)
        staging_trace(staged)
    return out


def test_staged_outputs_that_share_memory_take_the_result_as_the_plain_path():
    # Before: the staged copy out refused them with torch's "more than one element of the
    # written-to tensor refers to a single memory location", after the collective had run.
    for rank, out in enumerate(run_distributed(_expanded_outputs, backend="smddp")):
        for op in ("all_reduce", "broadcast", "recv"):
            assert out[("staged", op)] == out[("plain", op)], (rank, op, out)
        assert out[("staged", "all_reduce")] == [3.0, 3.0]
        if rank == 1:
            assert out[("staged", "recv")] == [2.0, 5.0]
