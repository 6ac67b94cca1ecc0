"""Inputs and expected results of smddp's collectives, for the rank-side checks.

Every input is built deterministically from its rank and a salt, so every rank can compute
the expected result of a collective directly, in the backend's documented reduction order:
local ranks in order inside a host, then hosts in the order of the algorithm that crossed
them (the ring's, halving-doubling's or the tree's, which the predicates below recognise).
``tree_takes`` and ``doubling_takes`` ask the live backend (a group must exist), and
``doubling_takes`` counts the calls it says yes to in ``DOUBLING_TAKEN``, which
``smddp_checks.run_all`` clears first and reports.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

from tests.distributed.smddp_rank_helpers import cpu_backend

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]
SIZES = [0, 1, 7, 17, 257, 1031, 65537]
PREMUL = 0.37


def salt_for(*parts: str) -> int:
    """A seed that is the same in every process (unlike hash())."""
    return zlib.crc32("/".join(parts).encode()) % 997


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PREMUL_SUM", "MIN", "MAX", "PRODUCT"]
    if dtype == torch.bool:
        return ["SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"]
    return ["SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"]


def redop(name: str):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL)
    return getattr(dist.ReduceOp, name)


def make_input(rank: int, n: int, dtype: torch.dtype, salt: int, op: str = "SUM") -> torch.Tensor:
    """A deterministic input of rank `rank` (any rank can compute any rank's input)."""
    g = torch.Generator().manual_seed(1000003 * salt + 7919 * rank + n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        if op == "PRODUCT":
            return (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        # Drawn in float32 rather than float64: half the generator's time, which on 8 ranks
        # each drawing every rank's inputs was most of a check's CPU.
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (torch.randn(n, generator=g, dtype=wide) * 3).to(dtype)
    lo, hi = (1, 3) if op == "PRODUCT" else ((0, 10) if dtype == torch.uint8 else (-5, 6))
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _combine(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    if a.dtype == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return a | b
        if op in ("PRODUCT", "MIN", "BAND"):
            return a & b
        return a ^ b
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        return a + b
    if op == "PRODUCT":
        return a * b
    if op == "MIN":
        return torch.minimum(a, b)
    if op == "MAX":
        return torch.maximum(a, b)
    return {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op](a, b)


def ring_across_hosts(hosts: list[list[int]]) -> bool:
    """Whether collectives across ``hosts`` pass partials around a ring (Note [Rail rings]
    in net_ring.cpp), which sums each part in its own host order: 3 hosts or more of equal
    rank counts, with SMDDP_NET_ALGO=ring, or auto (unset), whose group algorithm is the ring
    from 3 hosts (Note [The group's algorithm under auto]). Hosts of unequal
    rank counts always take the mesh (Note [Unequal hosts]); SMDDP_NET_ALGO=halving_doubling
    takes neither (its order is modelled in test_smddp_halving_doubling.py). The all_reduces
    the tree takes (``tree_takes``) sum in its own order, and so do the small collectives
    auto sends by halving-doubling (``doubling_takes``)."""
    equal = len({len(members) for members in hosts}) == 1
    algo = os.environ.get("SMDDP_NET_ALGO", "auto").strip().lower() or "auto"
    if not equal or len(hosts) < 3:
        return False
    return algo in ("ring", "auto")


def tree_takes(t: torch.Tensor, group=None) -> bool:
    """Whether an all_reduce of ``t`` on ``group`` (default: the world) crosses hosts by the
    tree (Note [Auto by size and host count] in net_algorithm.cpp): the backend says up to
    which size."""
    limit = cpu_backend(group)._layout()["net_tree_max_bytes"]
    return limit > 0 and t.numel() * t.element_size() <= limit


# The calls whose reference summed in halving-doubling's order, by kind (tests assert that
# the path they mean to check was taken).
DOUBLING_TAKEN: dict[str, int] = {}


def doubling_takes(t: torch.Tensor, kind: str, group=None) -> bool:
    """Whether a collective of kind ``kind`` (``"all_reduce"``, ``"reduce_scatter"``) whose
    S is ``t``'s bytes (an all_reduce's tensor, a reduce_scatter's or a rooted reduce's
    input) crosses hosts by halving-doubling under auto (Note [Auto by size and host count]
    in net_algorithm.cpp; an all_reduce the tree takes does not)."""
    layout = cpu_backend(group)._layout()
    limit = layout["net_doubling_max_bytes"][kind]
    nbytes = t.numel() * t.element_size()
    if kind == "all_reduce" and tree_takes(t, group):
        return False
    taken = limit > 0 and nbytes <= limit
    DOUBLING_TAKEN[kind] = DOUBLING_TAKEN.get(kind, 0) + taken
    return taken


def _doubling_order(partials: list[torch.Tensor], op: str, leaves) -> list[torch.Tensor]:
    """Halving-doubling's sums (Note [Halving and doubling between hosts] in
    net_halving_doubling.cpp), for every element: core c < P (the largest power of two <= H)
    adds its extra c + P's partial, rounded to the wire type, to its own, then at d = P/2,
    ..., 1 its partner c ^ d's running sum, rounded, its own first. Host h's parts are core
    h % P's."""
    hosts = len(partials)
    cores = 1 << (hosts.bit_length() - 1)
    run = []
    for c in range(cores):
        mine = partials[c].clone()
        run.append(_combine(mine, leaves(partials[c + cores]), op) if c + cores < hosts else mine)
    d = cores // 2
    while d >= 1:
        run = [_combine(run[c], leaves(run[c ^ d]), op) for c in range(cores)]
        d //= 2
    return [run[h % cores] for h in range(hosts)]


def _tree_order(partials: list[torch.Tensor], op: str, leaves) -> torch.Tensor:
    """The tree's sum (Note [A tree for small all-reduces] in net_tree.cpp), the same for
    every element: core c < P (the largest power of two <= H) adds its extra c + P's partial,
    rounded to the wire type, to its own; then at d = 1, 2, ..., P/2 cores c and c ^ d add
    their running sums, each rounded to the wire type, lower core first."""
    hosts = len(partials)
    cores = 1 << (hosts.bit_length() - 1)
    run = []
    for c in range(cores):
        mine = partials[c]
        if c + cores < hosts:
            mine = _combine(mine, leaves(partials[c + cores]), op)
        run.append(leaves(mine))
    d = 1
    while d < cores:
        run = [_combine(run[min(c, c ^ d)], run[max(c, c ^ d)], op) for c in range(cores)]
        if 2 * d < cores:
            run = [leaves(v) for v in run]
        d *= 2
    return run[0]


def partition(n: int, parts: int, i: int, align: int) -> tuple[int, int]:
    """Elements [begin, end) of part ``i`` of ``n`` in blocks of ``align``, as the backend
    cuts an all_reduce (smddp::partition in common.cpp)."""
    blocks = (n + align - 1) // align
    base, extra = divmod(blocks, parts)
    b0 = i * base + min(i, extra)
    nb = base + (1 if i < extra else 0)
    return min(b0 * align, n), min((b0 + nb) * align, n)


def reference_reduce(
    xs: list[torch.Tensor],
    op: str,
    hosts: list[list[int]],
    scatter: bool | list[int] = False,
    tree: bool = False,
    doubling: bool = False,
) -> torch.Tensor:
    """Reduces per-rank tensors like the backend: inside each host in rank order, then hosts.

    Hosts in order, or, in a ring (``ring_across_hosts``), part p from the host after its
    owner's round to its owner's, or, for an all_reduce the tree takes (``tree``, from
    ``tree_takes``), in the tree's order, or, for a collective auto sends by
    halving-doubling (``doubling``, from ``doubling_takes``), in its order. The parts are
    the reduce_scatter's equal ones when ``scatter`` is True, the given part sizes in rank
    order when it is a list (the list form of reduce_scatter with parts of different sizes),
    else the all_reduce's (``partition``).
    """
    dtype, shape = xs[0].dtype, xs[0].shape
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if op == "PREMUL_SUM":
        xs = [x * PREMUL for x in xs]  # scaled in the element type, as the backend does
    partials = []
    for members in hosts:
        part = None
        for r in members:
            v = xs[r].reshape(-1).to(acc)
            part = v.clone() if part is None else _combine(part, v, op)
        partials.append(part)
    # Note [Half precision on the wire] (net_algorithm.h): bf16/fp16 partials leave their host
    # rounded to the element type (unless SMDDP_NET_REDUCE_DTYPE=fp32), the owner's own stays
    # in fp32, and a ring's running sum is rounded where it goes on.
    fp32_wire = os.environ.get("SMDDP_NET_REDUCE_DTYPE", "auto").strip().lower() == "fp32"
    wire = acc if fp32_wire else dtype

    def leaves(v: torch.Tensor) -> torch.Tensor:
        return v.to(wire).to(acc)

    if tree and not scatter and len(hosts) > 1:
        total = _tree_order(partials, op, leaves)
    else:
        by_host = _doubling_order(partials, op, leaves) if doubling and len(hosts) > 1 else None
        total = _part_by_part(partials, op, hosts, scatter, xs[0].element_size(), leaves, by_host)
    if op == "AVG":
        total = total / len(xs)
    return total.to(dtype).reshape(shape)


def _part_by_part(
    partials: list[torch.Tensor],
    op: str,
    hosts: list[list[int]],
    scatter: bool | list[int],
    esz: int,
    leaves,
    by_host: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each part summed over the hosts by its owner (the mesh) or around a ring, or, given
    each host's sums of every element (``by_host``, halving-doubling's), taken from its
    owner's host."""
    world, n = sum(len(m) for m in hosts), partials[0].numel()
    host_of = {r: h for h, members in enumerate(hosts) for r in members}
    ring = ring_across_hosts(hosts)
    total = torch.empty_like(partials[0])
    for p in range(world):
        if isinstance(scatter, list):
            b = sum(scatter[:p])
            e = b + scatter[p]
        elif scatter:
            b, e = p * (n // world), (p + 1) * (n // world)
        else:
            b, e = partition(n, world, p, max(1, 64 // esz))
        owner = host_of[p]
        if by_host is not None:
            total[b:e] = by_host[owner][b:e]
            continue
        if ring:  # from the host after the owner's, round to the owner's
            order = [(owner + 1 + k) % len(hosts) for k in range(len(hosts))]
            sum_p = leaves(partials[order[0]][b:e])
            for k, h in enumerate(order[1:], start=1):
                sum_p = _combine(sum_p, partials[h][b:e], op)
                if k < len(order) - 1:
                    sum_p = leaves(sum_p)
        else:  # hosts in order, the owner's partial unrounded
            sum_p = None
            for h, part in enumerate(partials):
                v = part[b:e] if h == owner else leaves(part[b:e])
                sum_p = v.clone() if sum_p is None else _combine(sum_p, v, op)
        total[b:e] = sum_p
    return total


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, dtype-strict)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        return torch.equal(
            a.view(
                torch.uint8
                if a.element_size() == 1
                else {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            ),
            b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()]),
        )
    return torch.equal(a, b)
