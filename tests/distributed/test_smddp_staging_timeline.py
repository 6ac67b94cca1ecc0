"""Where a staged smddp call's time goes, and bf16 through the staging path.

Each staged call records its phases per chunk (Note [Staging timeline] in
csrc/smddp/backend/device_staging.h): the checks here are shared with the CUDA tests
(tests/gpu/test_smddp_cuda.py), which run them on real streams. bf16, the dtype SMP's scripts
reduce in, is accumulated in fp32 and rounded once, checked against an fp64 reference.
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.staging_common import (
    CHUNK,
    distinct_data,
    staged_and_plain_groups,
    staging_trace,
)
from torch_sagemaker._torch_compat.c10d import reduce_scatter_single
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


# --- where a staged call's time goes (Note [Staging timeline]) ---------------------------------

RUN = ("run (caller's thread)", "run (pool thread)")


def check_staged_call(spans, chunks_in, chunks_out, mirrored=False, pageable=True, buffers=1):
    """What is wrong with one staged call's spans ``[(phase, begin, end, bytes)]``, as a list.

    Every phase of Note [Staging timeline] must be there, the per-chunk ones once per chunk with
    that chunk's bytes (``chunks_in``: bytes copied in per chunk, ``chunks_out``: out), nested in
    the call, in order. ``mirrored``: a whole-message collective (one "chunk" per mirror copied
    in or out, none for a side it does not copy), whose host buffers come during the issue and
    whose CPU collective is one span. ``pageable``: host memory whose copies the host must wait
    for (always so on CPU). ``buffers``: the host buffers the call allocates.
    """
    by = {}
    for phase, begin, end, nbytes in sorted(spans, key=lambda s: (s[1], -s[2])):
        by.setdefault(phase, []).append((begin, end, nbytes))
    bad = []
    runs = [p for p in RUN if p in by]
    ins, outs = len(chunks_in), len(chunks_out)
    want = {"call": 1, "issue": 1, "queued": 1, "complete": 1, "wait": 1, "host buffers": buffers}
    want["host collective"] = 1 if mirrored else ins
    if ins:
        want.update({"d2h queue": ins, "issue event wait": 1, "d2h wait": 1 if mirrored else ins})
    if outs:
        want["h2d queue"] = outs
        if pageable:
            want["copies wait"] = 1
    got = {p: len(v) for p, v in by.items() if p not in RUN}
    if got != want or len(runs) != 1 or len(by[runs[0]]) != 1:
        return [f"phases {sorted(got.items())} and runs {runs}, want {sorted(want.items())}"]
    (call,) = by["call"]
    (run,) = by[runs[0]]
    for phase, found in by.items():
        for begin, end, _ in found:
            if not (call[0] <= begin <= end <= call[1]):
                bad.append(f"{phase} [{begin}, {end}] outside the call {call[:2]}")
    (issue,), (queued,) = by["issue"], by["queued"]
    if issue[0] != call[0] or not (issue[1] <= queued[0] <= queued[1] <= run[0]):
        bad.append(f"issue {issue[:2]}, queued {queued[:2]}, run {run[:2]} out of order")
    # The executor's part, one after the other: host buffers (pipelines), every copy in, the
    # issue event, then per chunk its wait, its collective and its copy out.
    steps = [] if mirrored else [("host buffers", k) for k in range(buffers)]
    steps += [("d2h queue", k) for k in range(ins)] + ([("issue event wait", 0)] if ins else [])
    if mirrored:
        steps += [("d2h wait", 0)] if ins else []
        steps += [("host collective", 0)] + [("h2d queue", k) for k in range(outs)]
    else:
        for k in range(ins):
            steps += [("d2h wait", k), ("host collective", k), ("h2d queue", k)]
    if outs and pageable:
        steps.append(("copies wait", 0))
    last = run[0]
    for phase, k in steps:
        begin, end, _ = by[phase][k]
        if begin < last or end > run[1]:
            bad.append(f"{phase} #{k} [{begin}, {end}] not after {last} inside the run")
        last = end
    if mirrored and not all(issue[0] <= b <= e <= issue[1] for b, e, _ in by["host buffers"]):
        bad.append("a mirror's host buffer was not allocated during the issue")
    for phase, sizes in (("d2h queue", chunks_in), ("h2d queue", chunks_out)):
        if [nbytes for _, _, nbytes in by.get(phase, [])] != sizes:
            bad.append(f"{phase} bytes {[b for *_, b in by.get(phase, [])]} != {sizes}")
    if not mirrored and [b for *_, b in by["host collective"]] != chunks_in:
        bad.append(f"host collective bytes {[b for *_, b in by['host collective']]}")
    (complete,), (wait,) = by["complete"], by["wait"]
    if complete[0] < run[1] or complete[1] > wait[1] or wait[1] != call[1]:
        bad.append(f"run {run[:2]}, complete {complete[:2]}, wait {wait[:2]}, call {call[:2]}")
    return bad


def staged_calls(pg):
    """The staged calls recorded since the last look, by call number: [(phase, b, e, bytes)]."""
    calls = {}
    for seq, phase, begin, end, nbytes in pg._staging_timeline():
        calls.setdefault(seq, []).append((phase, begin, end, nbytes))
    return calls


def _timeline_through_the_seam():
    import torch
    import torch.distributed as dist

    from torch_sagemaker import _C
    from torch_sagemaker.smddp import SMDDPOptions

    staged, _ = staged_and_plain_groups()
    ranks = list(range(dist.get_world_size()))
    recorded = dist.new_group(
        ranks,
        backend="smddp",
        pg_options=SMDDPOptions(stage_cpu=True, staging_chunk_bytes=CHUNK, timeline=True),
    )
    pg = recorded._get_backend(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 3 * 1024 + 7  # float32: chunks of 1024 elements, the last of 7
    chunks = [c * 4 for _, c in _C._plan_chunks(n, CHUNK // 4)]
    failures, runs = [], []

    def check(name, *args, **kwargs):
        calls = staged_calls(pg)
        if len(calls) != 1:
            failures.append(f"{name}: {len(calls)} staged calls recorded, want 1")
            return None
        ((seq, spans),) = calls.items()
        failures.extend(f"{name}: {b}" for b in check_staged_call(spans, *args, **kwargs))
        runs.extend(p for p, *_ in spans if p in RUN)
        return seq

    seqs = []
    t = distinct_data(n, torch.float32, rank)
    dist.all_reduce(t, group=recorded, async_op=True).wait()
    seqs.append(check("async all_reduce", chunks, chunks))
    dist.all_reduce(t, group=recorded)  # synchronous: the Python layer waits on the work
    seqs.append(check("all_reduce", chunks, chunks))
    one = distinct_data(1, torch.bfloat16, rank)
    dist.all_reduce(one, group=recorded)
    seqs.append(check("one-element bf16 all_reduce", [2], [2]))
    out = torch.zeros(n, dtype=torch.float32)
    reduce_scatter_single(out, distinct_data(world * n, torch.float32, rank), group=recorded)
    seqs.append(check("reduce_scatter_tensor", [world * c for c in chunks], chunks, buffers=2))
    b = distinct_data(n, torch.float32, rank)
    dist.broadcast(b, src=0, group=recorded)
    root = rank == 0  # the root copies its tensor in, the others copy the result out
    seqs.append(check("broadcast", [4 * n] * root, [4 * n] * (not root), mirrored=True))
    strided = distinct_data(2 * n, torch.float64, rank).view(n, 2).t()  # in and out mirrors
    dist.all_reduce(strided, group=recorded)
    seqs.append(check("strided all_reduce", [16 * n], [16 * n], mirrored=True))
    # Not recorded where the timeline is off.
    dist.all_reduce(distinct_data(n, torch.float32, rank), group=staged)
    if list(staged._get_backend(torch.device("cpu"))._staging_timeline()):
        failures.append("a group without the timeline recorded phases")
    staging_trace(staged)
    staging_trace(recorded)
    return failures, seqs, runs


def test_staged_calls_record_every_phase_nested_in_order_per_chunk():
    results = run_distributed(_timeline_through_the_seam, backend="smddp")
    for failures, _, runs in results:
        assert not failures, failures[:10]
        assert len(runs) == 6
    # One call, one number, on every rank: counted at issue.
    assert results[0][1] == results[1][1] == list(range(results[0][1][0], results[0][1][0] + 6))


# --- bf16, the dtype SMP's scripts reduce in ----------------------------------------------------


def bf16_inputs(n, rank):
    """bf16 values k/8, |k| < 256: exact in bf16, while a sum of 4 needs 10 bits (bf16 has 8)."""
    import torch

    k = (torch.arange(n, dtype=torch.int64) * 37 + rank * 101 + 13) % 511 - 255
    return (k.to(torch.float64) / 8).to(torch.bfloat16)


def bf16_sums_round_once(device="cpu"):
    """Staged bf16 reductions against an fp64 reference, rounded once: what is wrong, as a list.

    Sums of ``bf16_inputs`` over 4 ranks are exact in fp32, so accumulating in fp32 and
    rounding once gives exactly the fp64 sum rounded to bf16; accumulating in bf16 (a partial
    sum rounded before the next rank's value is added) does not, and the check first makes
    sure it would not on these values. ``device``: "cpu" (the staging seam) or "cuda".
    """
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cpu":
        options = SMDDPOptions(stage_cpu=True, staging_chunk_bytes=CHUNK)
    else:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        options = SMDDPOptions(staging_memory="pinned", staging_chunk_bytes=CHUNK)
    staged = dist.new_group(list(range(world)), backend="smddp", pg_options=options)
    failures = []
    for n in (1, 2047, 5000):  # bf16: chunks of 2048 elements
        inputs = [bf16_inputs(n, r) for r in range(world)]
        exact = sum(x.to(torch.float64) for x in inputs)
        partial = inputs[0]
        for x in inputs[1:]:
            partial = (partial.float() + x.float()).to(torch.bfloat16)
        if n > 1000 and torch.equal(partial, exact.to(torch.bfloat16)):
            failures.append(f"n={n}: the data cannot tell bf16 partial sums from fp32 ones")
        for name, op, want in (
            ("SUM", dist.ReduceOp.SUM, exact),
            ("AVG", dist.ReduceOp.AVG, exact / world),
        ):
            got = inputs[rank].to(device, copy=True)
            dist.all_reduce(got, op=op, group=staged)
            bad = (got.cpu() != want.to(torch.bfloat16)).sum().item()
            if bad:
                failures.append(f"all_reduce {name} n={n}: {bad} elements not the rounded sum")
        mine = torch.cat([bf16_inputs(n, world * rank + r) for r in range(world)])
        out = torch.zeros(n, dtype=torch.bfloat16, device=device)
        reduce_scatter_single(out, mine.to(device), group=staged)
        want = sum(bf16_inputs(n, world * r + rank).to(torch.float64) for r in range(world))
        bad = (out.cpu() != want.to(torch.bfloat16)).sum().item()
        if bad:
            failures.append(f"reduce_scatter_tensor n={n}: {bad} elements not the rounded sum")
    if device == "cpu":
        staging_trace(staged)
    return failures


def test_staged_bf16_accumulates_in_fp32_against_an_fp64_reference():
    # 4 ranks: with 2, one addition rounds once whatever the accumulator.
    for failures in run_distributed(bf16_sums_round_once, world_size=4, backend="smddp"):
        assert not failures, failures
