"""smddp on CUDA tensors: 2 ranks sharing one GPU (NCCL refuses that; the staged path does not).

Skipped without CUDA. Covers what the CPU tests of the staging path
(tests/distributed/test_smddp_staging*.py) cannot: the copies between device and host, the
stream ordering with real streams and events (Note [Device staging] in
csrc/smddp/backend/device_staging.h), training on CUDA parameters over smddp against one process on
the global batch, and the absence of kernels besides copies.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: smddp's staged path"),
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

SIZES = [1, 7, 1 << 20 | 3, (4 << 20) + 5]  # elements: odd, and past several 4 MiB chunks


def _device():
    dev = torch.device("cuda", torch.distributed.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _data(n, dtype, rank, device, salt=0):
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return (((i * 7 + rank + salt) % 3) == 0).to(device)
    v = (i * 31 + rank * 17 + salt) % 23 - (0 if dtype == torch.uint8 else 11)
    if dtype.is_floating_point:
        return (v.to(torch.float64) / 4 + 0.5).to(dtype).to(device)
    return v.to(dtype).to(device)


def _collectives_match_the_cpu_path():
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    dev = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    failures, ran = [], 0
    dtypes = [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    ]
    ops = [
        ReduceOp.SUM,
        ReduceOp.AVG,
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.PRODUCT,
        ReduceOp.BOR,
        dist._make_nccl_premul_sum(0.5),
    ]
    for dtype in dtypes:
        for op in ops:
            for n in SIZES:
                ref = _data(n, dtype, rank, "cpu")
                try:
                    dist.all_reduce(ref, op=op)  # the CPU path (tested against references)
                except (ValueError, TypeError, RuntimeError):
                    continue
                got = _data(n, dtype, rank, dev)
                dist.all_reduce(got, op=op)
                ran += 1
                if not torch.equal(got.cpu(), ref):
                    failures.append(f"all_reduce {dtype} {op} n={n}")
    n = (1 << 20) + 3
    # The other collectives, each against the same call on CPU tensors.
    cases = {
        "broadcast": lambda d: (dist.broadcast(t := _data(n, torch.float32, rank, d), src=1), [t]),
        "all_gather_into_tensor": lambda d: (
            dist.all_gather_into_tensor(
                o := torch.zeros(world * n, dtype=torch.bfloat16, device=d),
                _data(n, torch.bfloat16, rank, d),
            ),
            [o],
        ),
        "reduce_scatter_tensor": lambda d: (
            dist.reduce_scatter_tensor(
                o := torch.zeros(n, dtype=torch.bfloat16, device=d),
                _data(world * n, torch.bfloat16, rank, d),
            ),
            [o],
        ),
        "all_gather": lambda d: (
            dist.all_gather(
                os_ := [torch.zeros(n, device=d) for _ in range(world)],
                _data(n, torch.float32, rank, d),
            ),
            os_,
        ),
        "all_to_all_single": lambda d: (
            dist.all_to_all_single(
                o := torch.zeros(world * n, dtype=torch.int32, device=d),
                _data(world * n, torch.int32, rank, d),
            ),
            [o],
        ),
        "reduce": lambda d: (dist.reduce(t := _data(n, torch.float32, rank, d), dst=0), [t]),
    }
    for name, fn in cases.items():
        _, got = fn(dev)
        _, want = fn("cpu")
        if not all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)):
            failures.append(name)
    # Point to point.
    t = _data(n, torch.float64, rank, dev)
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
        if not torch.equal(t.cpu(), _data(n, torch.float64, 0, "cpu")):
            failures.append("send/recv")
    return failures, ran


def _stream_semantics():
    import torch.distributed as dist

    dev = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 8 << 20
    failures = []
    want = float(sum(r + 1 for r in range(world)))
    for async_op in (False, True):
        t = torch.zeros(n, device=dev)
        torch.cuda.synchronize()
        # Queued before the collective, and late: the collective must still see it.
        torch.cuda._sleep(200_000_000)
        t.fill_(rank + 1)
        work = dist.all_reduce(t, async_op=async_op)
        if async_op:
            work.wait()  # the current stream waits; no host synchronization here
        # Queued after it, without a host sync: must see the result.
        y = t * 2
        if not torch.equal(y.cpu(), torch.full((n,), 2 * want)):
            failures.append(f"async_op={async_op}: a kernel did not see the collective's result")
    # A side stream the caller made current is the one ordered against.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.zeros(n, device=dev)
        torch.cuda._sleep(200_000_000)
        t.fill_(rank + 1)
        dist.all_reduce(t, async_op=True).wait()
        y = t + 0
    s.synchronize()
    if not torch.equal(y.cpu(), torch.full((n,), want)):
        failures.append("the caller's current (side) stream was not the one ordered against")
    # The future's callbacks see the result (DDP's comm hooks chain on it).
    t = torch.ones(n, device=dev)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 3)
    if not torch.equal(fut.wait().cpu(), torch.full((n,), 3.0 * world)):
        failures.append("future callback")
    return failures


def _out_only_ops_wait_for_the_callers_stream():
    """Note [Out-only ops wait for the caller's stream]: a non-root broadcast and a receive."""
    import torch.distributed as dist

    dev = _device()
    rank = dist.get_rank()
    n = 8 << 20
    failures = []
    for name in ("broadcast", "recv"):
        t = torch.zeros(n, device=dev)
        torch.cuda.synchronize()
        # A late write the caller queued before the collective: the result must land after it.
        torch.cuda._sleep(200_000_000)
        t.fill_(-1.0)
        if rank == 0:
            src = torch.full((n,), 7.0, device=dev)
            if name == "broadcast":
                dist.broadcast(src, src=0)
            else:
                dist.send(src, dst=1)
        elif name == "broadcast":
            dist.broadcast(t, src=0)
        elif rank == 1:
            dist.recv(t, src=0)
        if rank == 1 and not torch.equal(t.cpu(), torch.full((n,), 7.0)):
            failures.append(f"{name}: the caller's earlier write landed over the result")
    return failures


def _profile_staged_kernels():
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dev = _device()
    t = torch.ones(16 << 20, device=dev)
    dist.all_reduce(t)  # warm-up: streams and pinned buffers
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(t)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [n for n in names if n.startswith("Memcpy")]
    others = sorted({n for n in names if not n.startswith(("Memcpy", "Memset"))})
    return copies, others


def _timeline_on_cuda():
    """A staged call's phases with real streams and events (Note [Staging timeline])."""
    import torch.distributed as dist

    from tests.distributed.test_smddp_staging_timeline import check_staged_call, staged_calls
    from torch_sagemaker import _C
    from torch_sagemaker.smddp import SMDDPOptions

    dev = _device()
    world = dist.get_world_size()
    n = (4 << 20) // 4 * 2 + 5  # float32: two 4 MiB chunks and 5 elements
    chunks = [c * 4 for _, c in _C._plan_chunks(n, (4 << 20) // 4)]
    failures = []
    # Note [Pinned calls do not wait]: the host waits for the copies of pool buffers only.
    for memory, pageable in (("pinned", False), ("pool", True)):
        options = SMDDPOptions(staging_memory=memory, timeline=True)
        group = dist.new_group(list(range(world)), backend="smddp", pg_options=options)
        pg = group._get_backend(dev)
        for _ in range(2):  # the second call is the one checked: streams and buffers exist
            t = torch.ones(n, device=dev)
            dist.all_reduce(t, group=group, async_op=True).wait()
            calls = staged_calls(pg)
        if not torch.equal(t.cpu(), torch.full((n,), float(world))):
            failures.append(f"{memory}: wrong result")
        if len(calls) != 1:
            failures.append(f"{memory}: {len(calls)} staged calls recorded, want 1")
            continue
        (spans,) = calls.values()
        bad = check_staged_call(spans, chunks, chunks, pageable=pageable)
        failures.extend(f"{memory}: {b}" for b in bad)
    return failures


def _train(kind: str):
    import torch.distributed as dist
    from torch import nn

    dev = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dev)
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dev)
    ref.load_state_dict(model.state_dict())
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8 * world, 32, generator=g).to(dev)
        y = torch.randn(8 * world, 8, generator=g).to(dev)
        mine = slice(8 * rank, 8 * (rank + 1))
        loss = nn.functional.mse_loss(wrapped(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.mse_loss(ref(x), y)  # one process on the global batch
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    if kind == "fsdp2":
        state = {k: v.full_tensor() for k, v in wrapped.state_dict().items()}
    else:
        state = {k.removeprefix("module."): v for k, v in wrapped.state_dict().items()}
    return max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def test_collectives_on_cuda_tensors_match_the_cpu_path():
    for failures, ran in run_distributed(_collectives_match_the_cpu_path, backend="smddp"):
        assert not failures, failures
        assert ran > 100


def test_stream_semantics_before_and_after_the_collective():
    for failures in run_distributed(_stream_semantics, backend="smddp"):
        assert not failures, failures


def test_out_only_ops_wait_for_the_callers_stream():
    for failures in run_distributed(_out_only_ops_wait_for_the_callers_stream, backend="smddp"):
        assert not failures, failures


def test_staged_all_reduce_launches_no_kernels_besides_copies():
    for copies, others in run_distributed(_profile_staged_kernels, backend="smddp"):
        assert copies, "the profiler saw no copies at all"
        assert not others, others


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_training_on_cuda_over_smddp_matches_one_process(kind):
    for diff in run_distributed(_train, kind, backend="smddp"):
        assert diff < 1e-5, diff


def test_staged_call_records_its_phases_and_pinned_calls_do_not_wait():
    for failures in run_distributed(_timeline_on_cuda, backend="smddp"):
        assert not failures, failures


def test_bf16_on_cuda_accumulates_in_fp32_against_an_fp64_reference():
    from tests.distributed.test_smddp_staging_timeline import bf16_sums_round_once

    # 4 ranks on the GPU(s): with 2, one addition rounds once whatever the accumulator.
    for failures in run_distributed(bf16_sums_round_once, "cuda", world_size=4, backend="smddp"):
        assert not failures, failures
