"""``bench multihost --train``: one rank's training runs, and where each step's time went.

A run is one setup (``SETUPS``) on one (replicas, shard) mesh shape, on every training
backend of the job in turn, in the element type ``--dtype`` asks for:

- ``fsdp2``: ``fully_shard`` per decoder layer and on the root over every rank (a 1-D
  mesh), as torchtitan does; in float32 the run ``--train`` has always timed.
- ``fsdp1_hybrid``: FSDP1 wrapped as SMP's train.py wraps it (transformer auto-wrap on the
  decoder layer class, ``use_orig_params=True``, ``device_id`` cpu, backward prefetch
  BACKWARD_PRE, forward prefetch and ``limit_all_gathers`` on, which are its defaults) and,
  in bfloat16, ``MixedPrecision(param, reduce and buffer dtype bf16)``. Strategy and mesh are
  what torch_sagemaker's plan gives a script that asks for HYBRID_SHARD with
  ``hybrid_shard_degree`` = ranks per host (``sharding_plan.resolve``): HYBRID_SHARD over the
  2-D mesh (replicate across hosts, shard inside a host), or, with one rank per host,
  NO_SHARD over the replicas (PyTorch would turn HYBRID_SHARD over a shard group of one
  into NO_SHARD over that group, and the replicas would never synchronise).
- ``fsdp1_overlap``: ``fsdp1_hybrid`` with FSDP1's all-reduce across replicas run while
  backward computes (``torch_sagemaker.sharding.fsdp1_replicas.FSDP1ReplicaReduction``,
  which ``tsm.init``'s FSDP1 patch attaches to SMP's scripts' models; Note [FSDP1 deferred
  replica reduction]).
- ``fsdp2_hybrid``: ``fully_shard`` over the plan's FSDP2 mesh for that config (the same
  2-D mesh: HSDP) with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` in
  bfloat16.
- ``fsdp2_overlap``: ``fsdp2_hybrid``'s model, policy and ranks, sharded over the mesh's shard
  dimension only, with the output embedding a unit of its own and the replicas' gradients
  averaged while backward computes (``torch_sagemaker.sharding.ReplicaReduction``, what
  ``shard_model(..., overlap_replica_reduction=True)`` sets up; Note [Deferred replica
  reduction]).

Every run builds the model from seed 0 and gives rank r the same batches (seed 1 + r) on
every layout, so a layout's losses can be held against one host's
(``multihost_training_report``). The groups of a mesh are made per backend with
``new_subgroups_by_enumeration`` from the plan's rank arithmetic (``ShardingPlan.dim_ranks``)
and joined with ``DeviceMesh.from_group``: the plan decides the groups, the backend is the
job's (smddp, gloo, or smddp forced to an algorithm across hosts).

Note [Exposed communication]
A step's time is split into compute and exposed communication, measured on each rank's
calling thread. While the step runs, the ``torch.distributed`` functions FSDP calls
(``COLLECTIVES``: ``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``, the list
forms ``all_gather`` and ``reduce_scatter``, the older names) are wrapped, and the time from
entering one to its return is added to its op. On CPU, FSDP1 and FSDP2 call them all
synchronously (``async_op`` left False; their streams and events do nothing on CPU), so a
call returns when its collective is done: its time is communication the step waited for,
exposed. The rest of the step is compute: forward, backward, FSDP's copies and casts, the
optimizer. A step's pace is set by the rank with the most compute (its step time minus its
exposed time); the others also wait in collectives for that rank, and that wait is skew,
not communication. So each step's split is that rank's; the record keeps the medians over
the timed steps beside the step's median (the slowest rank's), and compute + exposed is
close to the step, not equal to it.
Limits: a call with ``async_op=True`` counts only until it returns, without its wait
(``async_calls`` counts such calls; only the ``_overlap`` setups make them: their replicas'
all-reduces, whose wait at backward's end, the reducer's ``wait_seconds``, is added to the
exposed all_reduce); communication that runs while the caller computes is not
exposed, and is not seen otherwise; where the
ranks share cores, compute includes waiting for a core, and a collective's time includes the
CPU its copies and reductions take, which an accelerator and its fabric would not spend.
"""

from __future__ import annotations

import functools
import gc
import inspect
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

SETUPS = ("fsdp2", "fsdp1_hybrid", "fsdp1_overlap", "fsdp2_hybrid", "fsdp2_overlap")
TRAIN_DTYPES = ("float32", "bfloat16")
TRAINING_SEQ = 128
TRAINING_BATCH = 2  # sequences per rank
# The functions of torch.distributed that FSDP1 and FSDP2 call, by the op the table shows.
# FSDP1 gathers CPU tensors with the list form, ``all_gather``.
COLLECTIVES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
}
OPS = ("all_gather", "reduce_scatter", "all_reduce")


class Run(NamedTuple):
    """One setup on one mesh shape: ``replicas`` x ``shard`` ranks (1 x N: full shard)."""

    setup: str
    replicas: int
    shard: int


def runs_for(setups: list[str], hosts: int, local: int) -> list[Run]:
    """The runs of ``setups`` on ``hosts`` hosts of ``local`` ranks.

    ``fsdp2`` shards over every rank; the hybrid setups replicate across the hosts and shard
    inside one (``hybrid_shard_degree`` = ``local``). One host's reference run of a layout
    is the same runs with every rank on one host.
    """
    return [Run(s, 1, hosts * local) if s == "fsdp2" else Run(s, hosts, local) for s in setups]


def training_config(**overrides: Any):
    """The small Llama ``--train`` trains (hidden 256, 4 layers, vocab 8000).

    Args:
        **overrides: ``LlamaConfig`` fields to change (the tests' smaller model).
    """
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=256 * 11 // 4,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=TRAINING_SEQ,
        attn_implementation="sdpa",
    )
    return LlamaConfig(**(fields | overrides))


class Blocked:
    """Seconds and calls inside each collective op on this thread (Note [Exposed communication]).

    ``with blocked:`` wraps ``torch.distributed``'s collective functions until the block
    ends; a collective that another wrapped one calls is counted once, in the outer.
    """

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(OPS, 0.0)
        self.calls = dict.fromkeys(OPS, 0)
        self.async_calls = 0
        self._depth = 0
        self._saved: dict[str, Callable] = {}

    def _timed(self, name: str, fn: Callable) -> Callable:
        op = COLLECTIVES[name]
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            if signature.bind(*args, **kwargs).arguments.get("async_op"):
                self.async_calls += 1
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[op] += time.perf_counter() - start
                self.calls[op] += 1
                self._depth -= 1

        return call

    def __enter__(self) -> Blocked:
        import torch.distributed as dist

        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._timed(name, self._saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()


def summarise(
    run: Run, backend: str, dtype: str, per_rank: list[list[dict]], tokens_per_step: int
) -> dict[str, Any]:
    """One run's record from every rank's steps (Note [Exposed communication]).

    Args:
        run: The setup and mesh shape.
        backend: The job's backend name.
        dtype: The training element type.
        per_rank: For each rank, for each step (the first untimed): ``seconds``,
            ``blocked`` and ``calls`` per op, ``async_calls`` and ``loss``.
        tokens_per_step: Tokens all ranks train on in one step.

    Returns:
        tokens/s and the medians over the timed steps of the step (slowest rank), of the
        pacing rank's compute and of its exposed seconds per op, with its calls per op, the
        async calls of all ranks, and every rank's loss at every step.
    """
    steps, compute, calls = [], [], []
    exposed: dict[str, list[float]] = {op: [] for op in OPS}
    for i in range(1, len(per_rank[0])):
        ranks = [r[i] for r in per_rank]
        pacing = max(ranks, key=lambda s: s["seconds"] - sum(s["blocked"].values()))
        steps.append(max(s["seconds"] for s in ranks))
        compute.append(pacing["seconds"] - sum(pacing["blocked"].values()))
        for op in OPS:
            exposed[op].append(pacing["blocked"][op])
        calls.append(pacing["calls"])
    step = statistics.median(steps)
    return {
        "setup": run.setup,
        "replicas": run.replicas,
        "shard": run.shard,
        "backend": backend,
        "dtype": dtype,
        "tokens_per_s": tokens_per_step / step,
        "step_s": step,
        "compute_s": statistics.median(compute),
        "exposed_s": {op: statistics.median(v) for op, v in exposed.items()},
        "calls": {op: max(c[op] for c in calls) for op in OPS},
        "async_calls": sum(s["async_calls"] for r in per_rank for s in r),
        "losses": [[s["loss"] for s in r] for r in per_rank],
    }


def _plan(run: Run):
    """torch_sagemaker's plan for SMP's config of ``run``: hybrid_shard_degree = its shard."""
    from torch_sagemaker import sharding_plan, topology

    world = run.replicas * run.shard
    layout = topology.resolve(world, hybrid_shard_degree=run.shard)
    return sharding_plan.resolve(layout, ranks_per_host=run.shard)


def _groups(plan, dim: str, kwargs: dict[str, Any]):
    """This rank's group along ``dim`` of ``plan``, every such group made (collective)."""
    import torch.distributed as dist

    world = plan.layout.world_size
    every = sorted({tuple(plan.dim_ranks(dim, r)) for r in range(world)})
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in every], **kwargs)
    return mine


def meshes(run: Run, group, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The meshes the plan of ``run`` names, on the job's backend (collective).

    Args:
        run: The setup and shape; ``fsdp2`` gets the 1-D mesh over ``group``.
        group: The backend's group over every rank.
        kwargs: ``new_subgroups_by_enumeration``'s backend and options for that backend.

    Returns:
        ``fsdp_shard_mesh`` for full shard; else ``fsdp_mesh`` (replicate x shard) and
        ``replicate_mesh``, named as ``sharding_plan.MESHES`` names their dimensions.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from torch_sagemaker.sharding_plan import MESHES

    if run.setup == "fsdp2":
        return {"fsdp_shard_mesh": DeviceMesh.from_group(group, "cpu")}
    plan = _plan(run)
    replicate = _groups(plan, "dp_replicate", kwargs)
    shard = _groups(plan, "dp_shard_cp", kwargs)
    ranks = torch.arange(plan.layout.world_size).view(run.replicas, run.shard)
    rank = torch.distributed.get_rank()
    # The plan's rank arithmetic and the row-major grid agree (hosts hold consecutive ranks).
    assert plan.mesh_ranks("fsdp_mesh", rank) == [
        ranks[:, rank % run.shard].tolist(),
        ranks[rank // run.shard].tolist(),
    ]
    names = MESHES["fsdp_mesh"]
    return {
        "fsdp_mesh": DeviceMesh.from_group(
            [replicate, shard], "cpu", mesh=ranks, mesh_dim_names=names
        ),
        "replicate_mesh": DeviceMesh.from_group(
            replicate, "cpu", mesh_dim_names=MESHES["replicate_mesh"]
        ),
    }


def wrap(model, run: Run, mesh_of: dict[str, Any], dtype: str):
    """``model`` wrapped by ``run``'s setup in ``dtype`` (this module's docstring).

    Returns:
        The wrapped model and a line saying which strategy on which mesh.
    """
    import torch
    from torch.distributed.fsdp import (
        MixedPrecision,
        MixedPrecisionPolicy,
        ShardingStrategy,
        fully_shard,
    )

    from benchmarks.smp_fsdp1 import wrap_as_smp
    from torch_sagemaker.policies import transformer_layer_classes
    from torch_sagemaker.sharding import ReplicaReduction
    from torch_sagemaker.sharding.fsdp1_replicas import FSDP1ReplicaReduction

    layer_classes = transformer_layer_classes(model)
    half = getattr(torch, dtype) if dtype != "float32" else None
    if run.setup in ("fsdp1_hybrid", "fsdp1_overlap"):
        placement = _plan(run).fsdp1(ShardingStrategy.HYBRID_SHARD)
        mesh = mesh_of[placement.mesh]
        mixed = MixedPrecision(param_dtype=half, reduce_dtype=half, buffer_dtype=half)
        wrapped = wrap_as_smp(model, placement.strategy, mixed if half else None, device_mesh=mesh)
        line = f"FSDP1 {placement.strategy.name} on {tuple(mesh.shape)}"
        if run.setup == "fsdp1_overlap":
            wrapped.replica_reduction = FSDP1ReplicaReduction(wrapped)  # type: ignore[assignment]
            line += ", replicas' all-reduce during backward"
        return wrapped, line
    name = "fsdp_shard_mesh" if run.setup == "fsdp2" else _plan(run).fsdp2_dense
    mesh = mesh_of[name]
    overlap = run.setup == "fsdp2_overlap" and mesh.ndim == 2
    if overlap:
        replicas, mesh = mesh.get_group(0), mesh[mesh.mesh_dim_names[1]]
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)
    for layer in [m for m in model.modules() if isinstance(m, layer_classes)]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if overlap:
        fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    if overlap:
        model.replica_reduction = ReplicaReduction(model, replicas, reduce_dtype=half)
        return model, f"FSDP2 on {tuple(mesh.shape)}, replicas averaged during backward"
    return model, f"FSDP2 on {tuple(mesh.shape)}"


def train(run: Run, backend: str, group, mesh_of: dict[str, Any], spec: dict[str, Any]) -> dict:
    """Trains ``run`` on ``group``'s ranks; every rank returns the run's record.

    Args:
        run: The setup and shape.
        backend: The backend's name in the job.
        group: The backend's group over every rank.
        mesh_of: ``meshes(run, ...)`` on that backend.
        spec: The job's spec: ``train_steps``, ``train_dtype``, ``train_model`` (config
            overrides and ``seq``).

    Returns:
        ``summarise``'s record, with ``wrapped``: the strategy and mesh shape.
    """
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    overrides = dict(spec.get("train_model") or {})
    seq = overrides.pop("seq", TRAINING_SEQ)
    overrides.setdefault("max_position_embeddings", max(seq, TRAINING_SEQ))
    dtype = spec.get("train_dtype", "float32")
    config = training_config(**overrides)
    torch.manual_seed(0)
    model, wrapped = wrap(LlamaForCausalLM(config).float(), run, mesh_of, dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(1 + rank)
    mine = []
    for _ in range(1 + spec["train_steps"]):
        ids = torch.randint(0, config.vocab_size, (TRAINING_BATCH, seq), generator=gen)
        dist.barrier(group)
        with Blocked() as blocked:
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - start
        reducer = getattr(model, "replica_reduction", None)
        if reducer is not None:  # its wait at backward's end is exposed communication
            blocked.seconds["all_reduce"] += reducer.wait_seconds
        mine.append(
            {
                "seconds": seconds,
                "blocked": blocked.seconds,
                "calls": blocked.calls,
                "async_calls": blocked.async_calls,
                "loss": loss.item(),
            }
        )
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    del model, optim
    gc.collect()  # the FSDP units' reference cycles, before the next run allocates its own
    tokens = dist.get_world_size(group) * TRAINING_BATCH * seq
    return dict(summarise(run, backend, dtype, every, tokens), wrapped=wrapped)


def train_all(spec: dict[str, Any], groups: dict, group_kwargs: dict[str, dict]) -> list[dict]:
    """Every run of ``spec["train_runs"]`` on every backend of ``spec["train_backends"]``.

    Each run takes the backends in turn, so its rows ran close in time. Meshes are made
    once per backend and shape, in the same order on every rank.

    Args:
        spec: The job's spec.
        groups: Each backend's group over every rank.
        group_kwargs: Each backend's ``new_subgroups_by_enumeration`` keywords.

    Returns:
        The records, in the order they ran.
    """
    made: dict[tuple, dict[str, Any]] = {}
    records = []
    for run in (Run(*r) for r in spec.get("train_runs", [])):
        for backend in spec.get("train_backends", []):
            key = (backend, run.setup == "fsdp2", run.replicas, run.shard)
            if key not in made:
                made[key] = meshes(run, groups[backend], group_kwargs[backend])
            records.append(train(run, backend, groups[backend], made[key], spec))
    return records
