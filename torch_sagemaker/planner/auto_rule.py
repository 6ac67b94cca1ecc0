"""auto's choice by size and host count, derived from the cost model.

The group's algorithm (the ring or the mesh) that SMDDP_NET_ALGO=auto sends collectives
between hosts by, and the sizes up to which it sends them by smddp's tree or by
halving-doubling instead (kAutoRule in csrc/smddp/algorithms/net_algorithm.cpp): which
algorithm smddp picks, apart from what each algorithm costs (cost_model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch_sagemaker.planner.cost_model import Cluster, Costs, predict

# Note [The auto rule from the model]
# SMDDP_NET_ALGO=auto sends a collective between H hosts of equal rank counts by the
# group's algorithm, the ring or the mesh, except small ones: an all_reduce of at most a size
# set by H takes smddp's tree, and a collective the tree does not take, of at most a size set
# by H and its kind, takes halving-doubling (Note [Auto by size and host count] in
# csrc/smddp/algorithms/net_algorithm.cpp, whose table kAutoRule holds the choices). All of
# it is the model's, at the costs fitted on the recorded runs and on a cluster the report
# names (benchmarks/cost_model_report.py: rule_cluster):
# - the group's algorithm: on 2 hosts the mesh (a ring of two is the mesh's one exchange);
#   from 3, of the ring and the mesh the one predicted faster for the three kinds together
#   at GROUP_BYTES, the size of the calls it is there for (group_algorithm);
# - the sizes: for each H and kind, the largest of RULE_SIZES up to which (from the smallest,
#   or from the first size the tree leaves) the algorithm is predicted faster than each one
#   that would otherwise take the call.
# `bench multihost --fit` prints the table; tests/unit/test_cost_model.py holds the C++ table
# to it, so a refit that moves a choice fails there until the table is rewritten.

# The size the group's algorithm is chosen at: what it takes are the calls the size rules
# leave, and a training step's are of this order (an FSDP unit's gather and reduce-scatter,
# DDP's 25 MiB gradient buckets). At the recorded fit the model picks the same one at 16 MiB,
# 64 MiB and 1 GiB on every host count from 3 to 1024 (tests/unit/test_cost_model.py).
GROUP_BYTES = 64 << 20
# The sizes the rule chooses among: powers of two from 1 KiB to 1 TiB (a range that reaches the
# last is as good as unbounded: no cliff at a size the candidates happen to end at).
RULE_SIZES = tuple(1 << k for k in range(10, 41))
# The kinds of collective, in kAutoRule's order of doubling_max_bytes.
KINDS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


class AutoBySize(NamedTuple):
    """auto's choices on one host count: the group's algorithm, and where it leaves it (0: never).

    Attributes:
        main: The group's algorithm, ``ring`` or ``mesh``: every call the others do not take.
        tree_max_bytes: all_reduces of at most this S take the tree.
        doubling_max_bytes: per kind of KINDS, collectives of at most this S that the tree
            does not take go by halving-doubling.
    """

    main: str
    tree_max_bytes: int
    doubling_max_bytes: tuple[int, int, int]


def group_algorithm(costs: Costs, cluster: Cluster, size: int = GROUP_BYTES) -> str:
    """The group's algorithm under SMDDP_NET_ALGO=auto, for what no size rule takes.

    Args:
        costs: The fitted costs.
        cluster: The hosts (of equal rank counts).
        size: The size to compare at.

    Returns:
        ``mesh`` on fewer than 3 hosts; else whichever of ``ring`` and ``mesh`` is
        predicted faster for one call of each of KINDS of ``size`` bytes (the ring on a tie).
    """
    if cluster.hosts < 3:
        return "mesh"

    def total(algorithm: str) -> float:
        return sum(predict(costs, cluster, op, size, algorithm) for op in KINDS)

    return "ring" if total("ring") <= total("mesh") else "mesh"


def _largest(faster: Callable[[int], bool], sizes: tuple[int, ...]) -> int:
    """The largest of ``sizes`` (ascending) at which, and at each before it, ``faster`` holds."""
    best = 0
    for size in sizes:
        if not faster(size):
            break
        best = size
    return best


def auto_by_size(costs: Costs, cluster: Cluster, sizes: tuple[int, ...] = RULE_SIZES) -> AutoBySize:
    """Where auto should leave the group's algorithm on ``cluster``.

    Args:
        costs: The fitted costs.
        cluster: The hosts.
        sizes: The candidates, ascending.

    Returns:
        The group's algorithm (group_algorithm); the tree's largest all_reduce: the largest
        of ``sizes`` at which, and at every smaller one, the tree is predicted faster than
        both the group's algorithm and halving-doubling; then per kind, among the sizes
        above the tree's (all of them for the other kinds), the largest up to which
        halving-doubling is predicted faster than the group's algorithm. 0 where the first
        candidate fails.
    """
    if cluster.hosts < 2:
        return AutoBySize("mesh", 0, (0, 0, 0))
    other = group_algorithm(costs, cluster)

    def time(op: str, size: int, algorithm: str) -> float:
        return predict(costs, cluster, op, size, algorithm)

    def tree_wins(size: int) -> bool:
        tree = time("all_reduce", size, "tree")
        return tree < min(time("all_reduce", size, other), time("all_reduce", size, "doubling"))

    tree = _largest(tree_wins, sizes)

    def doubling_wins(op: str) -> Callable[[int], bool]:
        return lambda size: time(op, size, "doubling") < time(op, size, other)

    doubling = []
    for op in KINDS:
        left = tuple(s for s in sizes if s > tree) if op == "all_reduce" else sizes
        doubling.append(_largest(doubling_wins(op), left))
    return AutoBySize(other, tree, (doubling[0], doubling[1], doubling[2]))


def auto_rule(
    costs: Costs, cluster_of: Callable[[int], Cluster], max_hosts: int = 1024
) -> list[tuple[int, AutoBySize]]:
    """auto_by_size for 2 to ``max_hosts`` hosts, as (hosts, AutoBySize) entries.

    Args:
        costs: The fitted costs.
        cluster_of: The cluster of a host count (the rule's reference hosts).
        max_hosts: The last host count to derive.

    Returns:
        One entry per run of host counts with the same sizes, in order: from that host count
        up to the next entry's. The last entry holds beyond ``max_hosts``.
    """
    rule: list[tuple[int, AutoBySize]] = []
    for hosts in range(2, max_hosts + 1):
        sizes = auto_by_size(costs, cluster_of(hosts))
        if not rule or rule[-1][1] != sizes:
            rule.append((hosts, sizes))
    return rule
