"""auto's tree rule, derived from the cost model (Note [The tree rule from the model]).

The sizes up to which SMDDP_NET_ALGO=auto sends an all_reduce between hosts by smddp's tree
(kTreeRule in csrc/smddp/algorithms/net_algorithm.cpp): which algorithm smddp picks, apart
from what each algorithm costs (cost_model).
"""

from __future__ import annotations

from collections.abc import Callable

from torch_sagemaker.planner.cost_model import Cluster, Costs, predict

# Note [The tree rule from the model]
# SMDDP_NET_ALGO=auto sends an all_reduce between H hosts of equal rank counts by smddp's
# tree when it is at most a size set by H, and by the group's algorithm otherwise (Note
# [When the tree runs] in csrc/smddp/algorithms/net_algorithm.cpp, whose table kTreeRule
# holds the sizes). The sizes are the model's: for each H, the largest of TREE_RULE_SIZES up
# to which the tree is predicted faster than auto's algorithm at every one of them, at the
# costs fitted on the recorded runs and on a cluster the report names
# (benchmarks/cost_model_report.py: tree_rule_cluster). `bench multihost --fit` prints the
# table; tests/unit/test_cost_model.py holds the C++ table to it, so a refit that moves a
# crossover fails there until the table is rewritten.

# Where auto's ring ends (kAutoRingMaxHosts in net_algorithm.cpp).
AUTO_RING_MAX_HOSTS = 32
# The sizes the rule chooses among: powers of two from 1 KiB to 256 MiB.
TREE_RULE_SIZES = tuple(1 << k for k in range(10, 29))


def auto_algorithm(hosts: int) -> str:
    """What SMDDP_NET_ALGO=auto sends a collective by when the tree does not take it.

    On ``hosts`` hosts of equal rank counts: the ring from 3 to 32 hosts, else the mesh.
    """
    return "ring" if 3 <= hosts <= AUTO_RING_MAX_HOSTS else "mesh"


def tree_max_bytes(costs: Costs, cluster: Cluster, sizes: tuple[int, ...] = TREE_RULE_SIZES) -> int:
    """The largest all_reduce auto should send by the tree on ``cluster`` (0: none).

    Args:
        costs: The fitted costs.
        cluster: The hosts.
        sizes: The candidates, ascending.

    Returns:
        The largest of ``sizes`` at which, and at every smaller one, the tree is predicted
        faster than auto_algorithm(cluster.hosts); 0 when it is not at the smallest.
    """
    best = 0
    other = auto_algorithm(cluster.hosts)
    for size in sizes:
        tree = predict(costs, cluster, "all_reduce", size, "tree")
        if tree >= predict(costs, cluster, "all_reduce", size, other):
            break
        best = size
    return best


def tree_rule(
    costs: Costs, cluster_of: Callable[[int], Cluster], max_hosts: int = 1024
) -> list[tuple[int, int]]:
    """The sizes of auto's tree rule for 2 to ``max_hosts`` hosts, as (hosts, bytes) entries.

    Args:
        costs: The fitted costs.
        cluster_of: The cluster of a host count (the rule's reference hosts).
        max_hosts: The last host count to derive.

    Returns:
        One entry per run of host counts with the same tree_max_bytes, in order: from that
        host count up to the next entry's, all_reduces of at most that many bytes take the
        tree. The last entry holds beyond ``max_hosts``.
    """
    rule: list[tuple[int, int]] = []
    for hosts in range(2, max_hosts + 1):
        size = tree_max_bytes(costs, cluster_of(hosts))
        if not rule or rule[-1][1] != size:
            rule.append((hosts, size))
    return rule
