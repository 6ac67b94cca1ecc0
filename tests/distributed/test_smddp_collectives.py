"""smddp collectives against directly computed references, on shared memory and on the
inter-host paths (TCP mesh and ring) forced on one machine."""

import pytest

from tests.distributed import smddp_checks as checks
from tests.distributed import smddp_rank_helpers as rank_helpers
from tests.distributed import smddp_reference as reference
from tests.distributed.launcher import run_distributed
from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker.smddp import backend

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
    assert counts["net_algorithm"] == "none"
    assert counts["all_reduce"] == sum(
        len(reference.ops_for(d)) for d in reference.ALL_DTYPES
    ) * len(reference.SIZES)


def test_three_ranks_small_buffers_force_chunking():
    # 4 KiB buffers: every size above a few hundred elements runs many pipelined steps.
    _run(3, env={"SMDDP_BUFFER_BYTES": "4096", "SMDDP_ONESHOT_BYTES": "1024"}, quick=True)


def test_three_ranks_every_output_copy_streaming():
    # Streaming (non-temporal) stores normally start at outputs of several MiB; a 1-byte
    # threshold sends every copy into an output through them, odd sizes and offsets included.
    _run(3, env={"SMDDP_STREAM_BYTES": "1"}, quick=True)


def test_four_ranks_two_forced_hosts():
    # Two "hosts" of two ranks: shm reduce-scatter, TCP rail exchange, shm all-gather.
    counts = _run(4, env={"SMDDP_FORCE_LOCAL_SIZE": "2"}, quick=True)
    assert counts["net_algorithm"] == "mesh"  # two hosts: a ring would be the same exchange


@pytest.mark.parametrize("algo", ["ring", "auto", "mesh"])
def test_three_forced_hosts(algo):
    # Three "hosts" of one rank, in 4 KiB network messages so parts cross in several of them.
    # Asked for, every collective across them goes around a ring (Note [Rail rings] in
    # net_ring.cpp); under auto too, but for the all_reduces the tree takes (Note [Auto by
    # size and host count]); the references know each algorithm's order of hosts
    # (ring_across_hosts, tree_takes), and the ring's differs from the mesh's on this data.
    counts = _run(
        3,
        env={
            "SMDDP_FORCE_LOCAL_SIZE": "1",
            "SMDDP_NET_ALGO": algo,
            "SMDDP_NET_CHUNK_BYTES": "4096",
        },
        quick=True,
    )
    assert counts["net_algorithm"] == ("mesh" if algo == "mesh" else "ring")


@pytest.mark.parametrize("local", [1, 2], ids=["4x1", "4x2"])
def test_four_forced_hosts_auto_sends_small_collectives_by_halving_doubling(local):
    # Four "hosts": under auto the ring, with the tree for the smallest all_reduces and
    # halving-doubling for the small collectives the tree leaves (Note [Auto by size and
    # host count] in net_algorithm.cpp). The references sum in each call's own order
    # (tree_takes, doubling_takes), bit for bit.
    counts = _run(
        4 * local,
        env={"SMDDP_FORCE_LOCAL_SIZE": str(local), "SMDDP_NET_CHUNK_BYTES": "4096"},
        quick=True,
    )
    assert counts["net_algorithm"] == "ring"
    ops = counts["net_ops"]
    assert ops["halving_doubling"] > 0 and ops["tree"] > 0 and ops["ring"] > 0, ops
    # all_reduces and reduce_scatters each checked in halving-doubling's order.
    taken = counts["doubling_taken"]
    assert taken.get("all_reduce", 0) > 0 and taken.get("reduce_scatter", 0) > 0, taken


def test_two_ranks_one_per_forced_host():
    _run(2, env={"SMDDP_FORCE_LOCAL_SIZE": "1", "SMDDP_BUFFER_BYTES": "8192"}, quick=True)


def _unequal_hosts_run_all():
    """The whole check suite on hosts of unequal rank counts, with the layout it ran on."""
    return rank_helpers.host_layout(), checks.run_all(quick=True)


def test_three_ranks_on_unequal_forced_hosts():
    # Hosts {0, 1} and {2} keep their hierarchy (Note [Unequal hosts] in comm_hier.cpp):
    # shared memory inside the first, the mesh between them. The reference sums in that
    # order, and every rank's digest (fp32 avg, bf16 sum) must be the same bits.
    res = run_distributed(
        _unequal_hosts_run_all,
        world_size=3,
        backend="smddp",
        env={"SMDDP_FORCE_LOCAL_SIZE": "2", "SMDDP_NET_CHUNK_BYTES": "4096"},
        timeout=300,
    )
    assert all(layout == [[0, 1], [2]] for layout, _ in res), [layout for layout, _ in res]
    digests = [counts.pop("digest") for _, counts in res]
    assert all(d == digests[0] for d in digests), "ranks got different bits"
    assert all(counts == res[0][1] for _, counts in res)


def _reductions_on_unequal_subgroup():
    """all_reduce and reduce_scatter in fp32 and bf16 on the group of global ranks 0, 2, 3
    over forced hosts {0, 1}, {2, 3}: its hosts are [[0], [1, 2]], so the backend sums
    x0 + (x1 + x2), which rank order (x0 + x1) + x2 would not give bit for bit. Returns the
    layout, how many cases the two orders told apart, and every result's bits."""
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import backend as smddp_backend

    group = dist.new_group([0, 2, 3])
    if dist.get_rank() == 1:
        return None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hosts = smddp_backend.group_layout(group)["members"]
    flat = [[r] for r in range(world)]
    bits: list[list[int]] = []
    told_apart = 0
    for dtype in (torch.float32, torch.bfloat16):
        as_int = torch.int32 if dtype == torch.float32 else torch.int16
        for op in ("SUM", "AVG", "PREMUL_SUM"):
            for n in (1, 17, 1031, 40003):
                salt = reference.salt_for("unequal", str(dtype), op)
                xs = [reference.make_input(r, n, dtype, salt, op) for r in range(world)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=reference.redop(op), group=group)
                want = reference.reference_reduce(xs, op, hosts)
                assert reference.same(t, want), f"all_reduce {dtype} {op} n={n}"
                told_apart += not reference.same(want, reference.reference_reduce(xs, op, flat))
                bits.append(t.view(as_int).tolist())
                xs = [reference.make_input(r, n * world, dtype, salt, op) for r in range(world)]
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, xs[rank], op=reference.redop(op), group=group)
                full = reference.reference_reduce(xs, op, hosts, scatter=True)
                assert reference.same(out, full[rank * n : (rank + 1) * n]), f"reduce_scatter {n}"
                # Every rank's part, all-gathered: the same bits on every rank.
                parts = torch.empty(n * world, dtype=dtype)
                dist.all_gather_into_tensor(parts, out, group=group)
                assert reference.same(parts, full), f"all_gather of reduce_scatter {dtype} {op}"
                bits.append(parts.view(as_int).tolist())
    return hosts, told_apart, bits


def test_unequal_hosts_reduce_in_host_order_with_the_same_bits_everywhere():
    res = [
        r
        for r in run_distributed(
            _reductions_on_unequal_subgroup,
            world_size=4,
            backend="smddp",
            env={"SMDDP_FORCE_LOCAL_SIZE": "2"},
            timeout=300,
        )
        if r is not None
    ]
    assert len(res) == 3
    assert all(hosts == [[0], [1, 2]] for hosts, _, _ in res)
    # The test can tell the hierarchy's order from rank order.
    assert res[0][1] > 0
    assert all(bits == res[0][2] for _, _, bits in res), "ranks got different bits"


def _layout_and_async():
    import torch.distributed as dist

    layout = rank_helpers.host_layout()
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


def _complex_reductions():
    """Complex tensors through every reducing entry point that torch passes them to as they
    are (Note [Complex reductions]), on smddp and on gloo: each result, by case."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
        for dtype in (torch.complex64, torch.complex128):
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(world * 6, dtype=dtype, generator=g)
            for opname, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
                if name == "gloo" and opname == "avg":
                    continue  # gloo has no AVG; compared with SUM / world below
                key = (name, str(dtype), opname)
                o = torch.empty(6, dtype=dtype)
                c10d_compat.reduce_scatter_single(o, x.clone(), op=op, group=group)
                outs = [torch.empty(6, dtype=dtype)]
                dist.reduce_scatter(outs[0], list(x.clone().chunk(world)), op=op, group=group)
                r = x.clone()
                dist.reduce(r, dst=1, op=op, group=group)
                out[key] = (o, outs[0], r if rank == 1 else None)
            out[(name, str(dtype), "functional")] = funcol.all_reduce(x, "sum", group).wait()
            with dist._coalescing_manager(group=group):
                a, b = x[:5].clone(), x[5:].clone()
                dist.all_reduce(a, group=group)
                dist.all_reduce(b, group=group)
            out[(name, str(dtype), "coalesced")] = torch.cat([a, b])
            # An async Work reports the caller's complex tensors, in result() and its future,
            # as gloo's reduce does (gloo's reduce-scatter Works implement neither).
            c = x.clone()
            w = dist.reduce(c, dst=0, group=group, async_op=True)
            got = w.get_future().wait()[0]
            w.wait()  # result() needs the Work complete, which may follow its future
            out[(name, str(dtype), "async")] = (got.dtype, got.shape, w.result()[0].dtype)
            if rank == 0:
                out[(name, str(dtype), "async_values")] = got
            if name == "smddp":
                o, lo = torch.empty(6, dtype=dtype), torch.empty(6, dtype=dtype)
                ws = [
                    c10d_compat.reduce_scatter_single(o, x.clone(), group=group, async_op=True),
                    dist.reduce_scatter(
                        lo, list(x.clone().chunk(world)), group=group, async_op=True
                    ),
                ]
                got = [(w.get_future().wait()[0], w.wait() and w.result()[0]) for w in ws]
                out[("smddp", str(dtype), "async_scatters")] = (
                    [(f.dtype, r.dtype) for f, r in got],
                    [f.data_ptr() == t.data_ptr() for (f, _), t in zip(got, (o, lo))],
                )
    try:
        c10d_compat.reduce_scatter_single(
            torch.empty(6, dtype=torch.complex64),
            torch.ones(world * 6, dtype=torch.complex64),
            op=dist.ReduceOp.MAX,
        )
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return out, refused, world


def test_complex_reductions_equal_gloos():
    # Before: reduce_scatter_tensor, reduce_scatter and reduce raised TypeError on complex
    # tensors, which gloo reduces.
    import torch

    for out, refused, world in run_distributed(
        _complex_reductions, world_size=3, backend="smddp", timeout=300
    ):
        assert "complex" in refused and "SUM, AVG or PREMUL_SUM" in refused, refused
        for dtype in ("torch.complex64", "torch.complex128"):
            sums = out[("gloo", dtype, "sum")]
            for op in ("sum", "avg"):
                for got, want in zip(out[("smddp", dtype, op)], sums):
                    if want is None:
                        assert got is None
                        continue
                    want = want / world if op == "avg" else want
                    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (dtype, op)
            assert out[("smddp", dtype, "async")] == out[("gloo", dtype, "async")], dtype
            scatters = out[("smddp", dtype, "async_scatters")]
            assert scatters == ([(getattr(torch, dtype[6:]),) * 2] * 2, [True, True]), scatters
            cases = ("functional", "coalesced", "async_values")
            for case in (c for c in cases if ("gloo", dtype, c) in out):  # values: root only
                assert torch.allclose(
                    out[("smddp", dtype, case)], out[("gloo", dtype, case)], rtol=1e-5, atol=1e-6
                ), (dtype, case)


def _reduce_scatter_unequal_parts():
    """The list form of reduce_scatter with parts of different sizes: input_list[p] is the
    part rank p receives, shaped like rank p's output, so outputs differ between ranks and
    some are empty. Every op on fp32, bf16, int32 and bool, against the reference bit for bit
    (random data), and against gloo on integer-valued data, whose every reduction is exact
    in any order, so gloo's results must be the same bits. Returns the failures and the
    number of calls checked."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    hosts = rank_helpers.host_layout()
    # Part shapes by destination rank; the last case crosses several 512 KiB steps.
    cases = [
        [(5,), (0,), (1031,)],
        [(0,), (0,), (1,)],
        [(2, 3), (0, 3), (4, 3)],
        [(1,), (150001,), (7,)],
    ]
    failures, checked = [], 0
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.bool):
        for op in reference.ops_for(dtype):
            for k, shapes in enumerate(cases):
                sizes = [torch.Size(s).numel() for s in shapes]
                salt = reference.salt_for("rs_unequal", str(dtype), op, str(k))
                xs = [reference.make_input(r, sum(sizes), dtype, salt, op) for r in range(world)]
                ins = [p.reshape(s) for p, s in zip(xs[rank].split(sizes), shapes)]
                out = torch.empty(shapes[rank], dtype=dtype)
                if k == 2:  # a non-contiguous output
                    out = torch.empty(tuple(reversed(shapes[rank])), dtype=dtype).t()
                dist.reduce_scatter(out, ins, op=reference.redop(op))
                begin = sum(sizes[:rank])
                full = reference.reference_reduce(xs, op, hosts, scatter=sizes)
                want = full[begin : begin + sizes[rank]].reshape(shapes[rank])
                if not reference.same(out, want):
                    failures.append(f"{dtype} {op} parts {sizes}: not the reference")
                checked += 1
                if op in ("AVG", "PREMUL_SUM"):
                    continue  # gloo has neither
                # Integer values in [-3, 3] (1 to 3 for PRODUCT): exact sums and products.
                g = torch.Generator().manual_seed(salt + 31 * rank)
                lo, hi = (1, 4) if op == "PRODUCT" else (-3, 4)
                ints = [torch.randint(lo, hi, s, generator=g).to(dtype) for s in shapes]
                # Contiguous outputs: gloo writes a non-contiguous one in storage order.
                got = torch.empty(shapes[rank], dtype=dtype)
                ref = torch.empty(shapes[rank], dtype=dtype)
                dist.reduce_scatter(got, [t.clone() for t in ints], op=reference.redop(op))
                dist.reduce_scatter(
                    ref, [t.clone() for t in ints], op=reference.redop(op), group=gloo
                )
                if not reference.same(got, ref):
                    failures.append(f"{dtype} {op} parts {sizes}: not gloo's")
                checked += 1
    # Async, with this rank's input as its output (in place).
    ins = [torch.full((2 + 3 * p,), float(rank + p)) for p in range(world)]
    work = dist.reduce_scatter(ins[rank], ins, async_op=True)
    work.wait()
    want = torch.full((2 + 3 * rank,), float(sum(r + rank for r in range(world))))
    if not torch.equal(ins[rank], want):
        failures.append(f"async in place: {ins[rank]} != {want}")
    # Parts whose bytes add up past 64 bits (expand()ed views cost nothing): refused on
    # every rank before anything is allocated or sent.
    huge = torch.empty(1).expand(2**62)
    ins = [torch.empty(1)] + [huge] * (world - 1)
    try:
        dist.reduce_scatter(ins[rank], ins)
        failures.append("parts of 2^62 elements: no error")
    except ValueError as e:
        if "more bytes than a tensor can hold" not in str(e):
            failures.append(f"parts of 2^62 elements: {e}")
    return failures, checked


def test_reduce_scatter_list_with_unequal_parts_equals_reference_and_gloo():
    # Before: "smddp: reduce_scatter: every input must have N elements like the output".
    for failures, checked in run_distributed(
        _reduce_scatter_unequal_parts, world_size=3, backend="smddp", timeout=300
    ):
        assert not failures, failures[:10]
        assert checked == 4 * (6 + 6 + 7 + 7) + 4 * (4 + 4 + 7 + 7), checked
