"""Registers the native "smddp" collective backend with torch.distributed.

The backend itself is C++ (``csrc/smddp/``, compiled into ``torch_sagemaker._C``); this
module only decides whether it can be used, registers its creator under the name "smddp"
for CPU and CUDA tensors (CUDA tensors are staged through host memory and reduced by the
CPUs, as SMDDP does; docs/gpu.md), and wraps the few introspection entry points. Importing
``torch_sagemaker`` (or the SMP compatibility shim
``smdistributed.dataparallel.torch.torch_smddp``) calls ``register()``.

Ranks on one host communicate through POSIX shared memory; hosts talk over an
authenticated TCP full mesh, with hierarchical collectives (see docs/collectives.md).
Settings (buffer sizes, spin budgets, the socket address, ...) come from a group's
``pg_options`` (:class:`torch_sagemaker.smddp.options.SMDDPOptions`), else from the
``SMDDP_*`` environment variables of the rank, else from their defaults; the table in
docs/collectives.md lists them all.
"""

from __future__ import annotations

import atexit
import warnings

import torch
import torch.distributed as dist

from torch_sagemaker._torch_compat import c10d as c10d_compat

BACKEND_NAME = "smddp"
#: The device types the backend is registered for. "smddp" alone then means
#: "cpu:smddp,cuda:smddp": one backend object serves both, as SMP's scripts expect from
#: ``init_process_group("smddp")`` on GPU instances.
DEVICES = ("cpu", "cuda")


def is_available() -> bool:
    """Whether the native smddp backend was compiled into ``torch_sagemaker._C``."""
    try:
        from torch_sagemaker import _C
    except ImportError:
        return False
    return bool(getattr(_C, "has_smddp_backend", False))


def is_registered() -> bool:
    """Whether "smddp" is a registered torch.distributed backend in this process."""
    return BACKEND_NAME in dist.Backend.backend_list


def register() -> bool:
    """Registers "smddp" with torch.distributed if it is available (idempotent).

    Returns:
        True if the backend is registered after the call.
    """
    if is_registered():
        return True
    if not is_available():
        return False
    from torch_sagemaker import _C

    def create_backend(*args):
        created = _C.create_backend(*args)
        _warn_if_ring_unused(created)
        _warn_if_idle_restarts(created)
        return created

    dist.Backend.register_backend(
        BACKEND_NAME, create_backend, extended_api=True, devices=list(DEVICES)
    )
    # A group destroyed from one of its own future callbacks is released by a thread of its
    # own, which may need the GIL: wait for it before the interpreter finalizes (Note
    # [Shutdown from the group's own thread] in csrc/smddp/backend/backend.cpp).
    atexit.register(_C._wait_for_deferred_releases, 60.0)
    return True


_RING_WARNED = False


def _warn_if_ring_unused(created) -> None:
    """Warns once per process when a group asked for the ring crosses hosts over the mesh.

    A ring needs 3 hosts or more with equal rank counts (Note [Rail rings] and Note [Unequal
    hosts] in csrc/smddp/algorithms); other layouts take the mesh whatever ``net_algo`` says.
    Groups inside one host do not cross hosts and are not warned about.
    """
    global _RING_WARNED
    if _RING_WARNED or created._settings().get("net_algo") != "ring":
        return
    layout = created._layout()
    if layout["hosts"] < 2 or (layout["hosts"] >= 3 and layout["uniform"]):
        return
    _RING_WARNED = True
    sizes = [len(m) for m in layout["members"]]
    warnings.warn(
        f"smddp: net_algo=ring (SMDDP_NET_ALGO or SMDDPOptions) has no effect on a group whose "
        f"hosts have {sizes} ranks: a ring needs 3 hosts or more with equal rank counts, so "
        "this group crosses hosts over the mesh; set net_algo to auto or mesh to say so",
        stacklevel=2,
    )


#: Where Linux says whether TCP restarts a connection's congestion window after an idle gap.
SLOW_START_AFTER_IDLE = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"
_IDLE_WARNED = False


def _warn_if_idle_restarts(created, path: str = SLOW_START_AFTER_IDLE) -> None:
    """Warns once per host when a job's groups cross hosts whose TCP slows down after idle gaps.

    Note [Slow start after idle]: with ``net.ipv4.tcp_slow_start_after_idle`` at 1 (Linux's
    default), a connection that sent nothing for a retransmission timeout (200 ms or more)
    starts again from a small congestion window, and between collectives a training step's
    compute leaves such gaps. A collective then waits for the slowest flow's ramp. On 2
    simulated hosts of 2 ranks, with the benchmark's calls of other backends between smddp's
    cases, single launches missed 0.9 of the NIC bound in 13 of 66 cells from 16 MiB against 5
    of 66 with the setting at 0 over three sets, but 5 of 36 at either setting in a later set:
    there most slow launches came from the connections' start instead (docs/log/multi_node.md,
    builds 7c7eb68 and b7495c5).
    The setting is the host's, per network namespace; smddp only says so. A process decides
    on the first group it joins that crosses hosts, and warns if it is the first rank of its
    host there: with the default group first, one warning per host, however many subgroups
    follow. Hosts that ``SMDDP_FORCE_LOCAL_SIZE`` simulates on one machine count as hosts:
    their connections (over loopback) restart their windows too.

    Args:
        created: The backend just created (``_C.create_backend``).
        path: Where the setting is read (tests point it elsewhere).
    """
    global _IDLE_WARNED
    if _IDLE_WARNED:
        return
    layout = created._layout()
    if layout["hosts"] < 2:
        return
    _IDLE_WARNED = True
    if layout["local_rank"] != 0:
        return
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:  # not Linux, or /proc hidden: nothing to say
        return
    if value != "1":
        return
    warnings.warn(
        f"smddp: net.ipv4.tcp_slow_start_after_idle is 1 on this host ({path}): TCP restarts "
        "each connection's congestion window after an idle gap of 200 ms or more, such as a "
        "training step's compute between collectives, and collectives across hosts then "
        "wait for the slowest connection to ramp up again; set it to 0 on every host "
        "(sysctl -w net.ipv4.tcp_slow_start_after_idle=0) for steadier collectives between hosts",
        stacklevel=2,
    )


def default_backend(cuda_backend: str = BACKEND_NAME, cuda: bool | None = None) -> str:
    """The backend string ``tsm.init`` uses when it creates the process group itself.

    Note [Backend for CUDA tensors]: "smddp" (both devices on smddp) by default, which is what
    SMP's scripts ask for with ``init_process_group("smddp")``; it also works with several
    ranks sharing one GPU, which NCCL refuses. ``cuda_backend="nccl"`` keeps smddp for CPU
    tensors and gives CUDA tensors to NCCL ("cpu:smddp,cuda:nccl"): within one host on
    NVLink, where SMDDP itself claims no gain, NCCL is expected to be faster (docs/gpu.md
    says how to measure it). Without the native backend: gloo (and nccl for CUDA).

    Args:
        cuda_backend: "smddp" or "nccl" (``env_settings.cuda_backend()`` reads it from
            ``TSM_CUDA_BACKEND``).
        cuda: Whether CUDA is usable here (default: ``torch.cuda.is_available()``).

    Raises:
        ValueError: ``cuda_backend`` is neither "smddp" nor "nccl".
    """
    if cuda_backend not in (BACKEND_NAME, "nccl"):
        raise ValueError(
            f"cuda_backend={cuda_backend!r}: expected 'smddp' or 'nccl' (TSM_CUDA_BACKEND)"
        )
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not register():
        return "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda and cuda_backend == "nccl":
        return f"cpu:{BACKEND_NAME},cuda:nccl"
    return BACKEND_NAME


def kernel_isa() -> str:
    """The instruction set the reduction kernels dispatched to on this CPU.

    Returns:
        "avx512", "avx2", "x86-64" or "generic".
    """
    from torch_sagemaker import _C

    return _C.kernel_isa()


def _smddp_backend(group: dist.ProcessGroup | None):
    group = group or dist.group.WORLD
    assert group is not None, "the default process group is not initialized"
    backend = c10d_compat.backend_of(group, torch.device("cpu"))
    if not hasattr(backend, "_layout"):
        raise ValueError(f"group {group} does not use the smddp backend for CPU tensors")
    return backend


def pool_stats(group: dist.ProcessGroup | None = None) -> dict:
    """The shared-memory tensor pool of ``group``'s smddp backend on this rank.

    Tensors from ``backend.allocate_tensor`` (what FSDP2 uses after
    ``set_allocate_memory_from_process_group_for_comm(True)``) live in this pool, and
    all-gathers and reduce-scatters whose operands are there on every rank read them in
    place instead of through staging copies. ``SMDDP_POOL_BYTES`` sizes the pool (default
    1 GiB of address space, committed as it is used; 0 turns it off); in a group that spans
    several hosts, a host of one rank has none, and the ranks of a larger host read each
    other's pooled operands (all-gather outputs, reduce-scatter and all-reduce inputs) in
    their pools (Note [Read from the pool] in csrc/smddp/algorithms/shm_algos.h).

    Args:
        group: A process group whose CPU backend is smddp (default: the default group).

    Returns:
        ``{"pool_bytes", "in_use", "zero_copy_ops", "pool_reduce_reads",
        "pool_gather_reads"}``: the pool's size, the bytes held by live tensors, how many
        collectives on one host ran zero-copy so far, and how many times the steps of
        reduce-scatters and of all-gathers read a local peer's operand in its pool (once per
        peer and step).

    Raises:
        ValueError: If the group's CPU backend is not smddp.
    """
    return _smddp_backend(group)._pool_stats()


def group_layout(group: dist.ProcessGroup | None = None) -> dict:
    """How the smddp backend of ``group`` sees the hosts.

    Args:
        group: A process group whose CPU backend is smddp (default: the default group).

    Returns:
        ``{"hosts", "local_size", "host", "local_rank", "members", "forced", "uniform",
        "net_algorithm", "net_tree_max_bytes", "net_doubling_max_bytes", "net_ops",
        "machine_oversubscribed"}``:
        ``members`` lists the group ranks of each host; ``local_size``
        is the rank count of this rank's host; ``forced`` is true when
        ``SMDDP_FORCE_LOCAL_SIZE`` shaped the layout; ``uniform`` is false when hosts have
        unequal rank counts (they keep their hierarchy, and cross hosts over the mesh only);
        ``net_algorithm`` is how collectives cross hosts, ``"mesh"``, ``"ring"`` or
        ``"halving_doubling"`` (the
        layout and the group's ``net_algo``, from ``SMDDPOptions`` or ``SMDDP_NET_ALGO``,
        decide it), or ``"none"`` on one host, but for the all_reduces of at most
        ``net_tree_max_bytes`` bytes, which cross by the tree, and the collectives of at most
        ``net_doubling_max_bytes[kind]`` bytes (``"all_reduce"``, ``"reduce_scatter"``,
        ``"all_gather"``; nccl-tests' sizes) the tree does not take, which cross by
        halving-doubling (0: none; chosen per call, Note [Auto by size and host count] in
        csrc/smddp/algorithms/net_algorithm.cpp); ``net_ops`` counts
        the collectives that crossed hosts so far by each algorithm (``"mesh"``, ``"ring"``,
        ``"halving_doubling"``, ``"tree"``); ``machine_oversubscribed`` is true when the
        group's ranks on this machine, of this host and of hosts that are containers or
        namespaces of the same machine, outnumber the CPUs they may run on (their waits
        then yield rather than spin).

    Raises:
        ValueError: If the group's CPU backend is not smddp.
    """
    return _smddp_backend(group)._layout()


def group_settings(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """The settings ``group``'s smddp backend resolved at creation (options over environment).

    Args:
        group: A process group whose CPU backend is smddp (default: the default group).

    Returns:
        ``{field: value}`` for every setting of the table in docs/collectives.md, as text
        ("auto" and "" where the backend decides or nothing is set).

    Raises:
        ValueError: If the group's CPU backend is not smddp.
    """
    return _smddp_backend(group)._settings()
