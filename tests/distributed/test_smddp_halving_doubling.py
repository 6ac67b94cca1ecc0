"""Recursive halving-doubling across simulated hosts, asked for with ``net_algo``.

Note [Halving and doubling between hosts] in csrc/smddp/algorithms/net_halving_doubling.cpp:
on 4 hosts (a power of two) and 3 (host 2 folded into host 0), every rank of one rank per
host must hold the bits of a model of the algorithm's reduction order (fp32 running sums,
each rounded to the wire type where it leaves), the same bits on every rank, and bf16 results
within the Note's bound against an fp64 reference; reduce_scatter_tensor and
all_gather_into_tensor must match too. One launch of 4 ranks checks all of it.
"""

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend
from torch_sagemaker.smddp.options import SMDDPOptions

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

N = 4099  # not a multiple of the parts' alignment: the last part is shorter
UNIT_BF16 = 2.0**-8


def _inputs(rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    return (torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g))).to(dtype)


def _model(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The algorithm's result for every element, one rank per host (its partial is its input).

    Core c < P (the largest power of two <= H) first adds its extra c + P's partial, rounded
    to the wire type; then at d = P/2, ..., 1 it adds core c ^ d's running sum, rounded; the
    result of host q's part is core q % P's last sum, rounded once to the dtype.
    """
    dtype, hosts = xs[0].dtype, len(xs)
    cores = 1 << (hosts.bit_length() - 1)

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b if op == "SUM" else torch.maximum(a, b)

    def leaves(v: torch.Tensor) -> torch.Tensor:
        return v.to(dtype).float()

    run = []
    for c in range(cores):
        mine = xs[c].float()
        run.append(combine(mine, leaves(xs[c + cores].float())) if c + cores < hosts else mine)
    d = cores // 2
    while d >= 1:
        run = [combine(run[c], leaves(run[c ^ d])) for c in range(cores)]
        d //= 2
    return run


def _result(run: list[torch.Tensor], spans: list[tuple[int, int]], dtype) -> torch.Tensor:
    out = torch.empty(sum(e - b for b, e in spans), dtype=dtype)
    for q, (b, e) in enumerate(spans):
        out[b:e] = run[q % len(run)][b:e].to(dtype)
    return out


def _allreduce_spans(n: int, world: int, esz: int) -> list[tuple[int, int]]:
    from tests.distributed.smddp_reference import partition

    return [partition(n, world, p, 64 // esz) for p in range(world)]


def _same_everywhere(t: torch.Tensor, group) -> bool:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t, group=group)
    as_int = torch.int16 if t.element_size() == 2 else torch.int32
    return all(torch.equal(e.view(as_int), every[0].view(as_int)) for e in every)


def _check_group(ranks: list[int]) -> dict:
    from torch_sagemaker.smddp.backend import group_layout

    hd = SMDDPOptions(net_algo="halving_doubling")
    group = dist.new_group(ranks, backend="smddp", pg_options=hd)
    if dist.get_rank() not in ranks:
        return {}
    world, me = len(ranks), ranks.index(dist.get_rank())
    out: dict = {"algorithm": group_layout(group)["net_algorithm"], "failures": []}
    fail = out["failures"].append
    for dtype in (torch.float32, torch.bfloat16):
        for op, red in (("SUM", dist.ReduceOp.SUM), ("MAX", dist.ReduceOp.MAX)):
            xs = [_inputs(r, dtype, 1) for r in range(world)]
            got = xs[me].clone()
            dist.all_reduce(got, op=red, group=group)
            spans = _allreduce_spans(N, world, got.element_size())
            want = _result(_model(xs, op), spans, dtype)
            if not torch.equal(got, want):
                differ = int((got != want).sum())
                fail(f"all_reduce {dtype} {op}: {differ} elements differ from the model")
            if not _same_everywhere(got, group):
                fail(f"all_reduce {dtype} {op}: ranks hold different bits")
            if dtype == torch.bfloat16 and op == "SUM":
                # Note's bound: u |r| + u ceil(log2 H) sum |P_h| + the fp32 sums (2x), 5% over.
                xs64 = [x.double() for x in xs]
                exact = sum(xs64)
                spread = sum(x.abs() for x in xs64)
                bound = exact.abs() * UNIT_BF16 + math.ceil(math.log2(world)) * UNIT_BF16 * spread
                bound = 1.05 * (bound + 2 * world * 2.0**-24 * spread)
                over = int(((got.double() - exact).abs() > bound).sum())
                if over:
                    fail(f"all_reduce bf16: {over} elements beyond the Note's bound")
        # reduce_scatter_tensor: equal parts of n // world.
        per = 1001
        xs = [_inputs(r, dtype, 2)[: per * world] for r in range(world)]
        got = torch.empty(per, dtype=dtype)
        dist.reduce_scatter_tensor(got, xs[me].clone(), group=group)
        run = _model(xs, "SUM")
        want = run[me % len(run)][me * per : (me + 1) * per].to(dtype)
        if not torch.equal(got, want):
            fail(f"reduce_scatter_tensor {dtype}: {(got != want).sum()} elements differ")
    # all_gather_into_tensor, of an odd byte count.
    mine = torch.arange(333, dtype=torch.int32) * (me + 3)
    gathered = torch.empty(333 * world, dtype=torch.int32)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    want = torch.cat([torch.arange(333, dtype=torch.int32) * (r + 3) for r in range(world)])
    if not torch.equal(gathered, want):
        fail("all_gather_into_tensor differs")
    return out


def _both() -> dict:
    return {"4 hosts": _check_group([0, 1, 2, 3]), "3 hosts": _check_group([0, 1, 2])}


def test_halving_doubling_matches_its_model_on_3_and_4_hosts():
    results = run_distributed(
        _both, world_size=4, backend="smddp", env={"SMDDP_FORCE_LOCAL_SIZE": "1"}
    )
    for rank, by_group in enumerate(results):
        for name, r in by_group.items():
            if not r:
                continue  # not a member
            assert r["algorithm"] == "halving_doubling", (rank, name, r)
            assert not r["failures"], (rank, name, r["failures"])
    assert results[3]["3 hosts"] == {}
