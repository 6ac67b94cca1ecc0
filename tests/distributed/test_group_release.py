"""Groups the library made are freed, threads and all, once ``tsm.state.reset()`` destroyed them.

``destroy_process_group(group)`` only takes a gloo group out of c10d's registry: its threads
(a TCP loop that wakes every 10 ms and two workers) and its sockets stay until the last
reference to it goes. So any reference the library keeps after the reset, in a cache or a
hook, keeps them running, and a job that calls ``tsm.init`` again and again (a notebook, a
hyper-parameter sweep) gathers them. Each round here does what such a job does between two
resets: ``tsm.init`` with two replicas, a model sharded with its replicas averaged during
backward (``ReplicaReduction``), a step with the gradient norm clipped (``all_reduce_direct``
over the mesh's groups) and a background save (its private gloo group). After every round the
rank runs the threads it ran before the first.
"""

import pytest

from tests.distributed.launcher import run_distributed

ROUNDS = 3


def _threads() -> tuple[int, list[str]]:
    """This rank's threads once garbage is collected: (Python's, the native ones' names).

    Python's threads carry the process's name, as its main thread does; native ones are named
    by their library (gloo's ``gloo_tcp_loop`` and ``pt_gloo_runloop``, the store's
    ``pt_tcpstore_uv``). Collected until a pass finds nothing: freeing garbage (an autograd
    graph's C++ nodes) can make more.
    """
    import gc
    import os

    for _ in range(4):
        if not gc.collect():
            break
    with open("/proc/self/comm") as f:
        main = f.read().strip()
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count(main), sorted(n for n in names if n != main)


def _train_and_save(path: str):
    """One round; returns weak references to what it made that must not outlive the reset."""
    import weakref

    import torch.distributed as dist
    import torch.sagemaker as tsm

    from tests.distributed.hf_models import global_batches, rank_slice, tiny_llama
    from torch_sagemaker.checkpoint.async_utils import maybe_finalize_async_calls
    from torch_sagemaker.checkpoint.state_dict_saver import async_save
    from torch_sagemaker.grad_norm import clip_grad_norm_
    from torch_sagemaker.sharding import shard_model

    tsm.init({"hybrid_shard_degree": 1})  # two replicas of one rank each
    model = shard_model(tiny_llama(), overlap_replica_reduction=True)
    batch = rank_slice(global_batches(1, 4)[0], tsm.state.dp_rank, tsm.state.dp_size)
    model(input_ids=batch, labels=batch).loss.backward()
    clip_grad_norm_(model, 1.0)
    async_save({"step": 1}, checkpoint_id=path)
    maybe_finalize_async_calls(blocking=True)
    refs = {
        "replica reduction": weakref.ref(model.replica_reduction),
        "model": weakref.ref(model),
    }
    for name in ("tp", "cp", "ep", "rep_rank", "fsdp_shard", "fsdp_replicate", "dp"):
        group = getattr(tsm.state, f"{name}_process_group")
        if group is not dist.group.WORLD:  # a mesh axis over every rank may be the default group
            refs[f"{name} group"] = weakref.ref(group)
    return refs


def _rounds(path: str, rounds: int):
    import torch.sagemaker as tsm

    tsm.state.reset()
    before = _threads()
    after, alive = [], []
    for r in range(rounds):
        refs = _train_and_save(f"{path}/round{r}")
        tsm.state.reset()
        after.append(_threads())
        alive.append(sorted(name for name, ref in refs.items() if ref() is not None))
    return before, after, alive


@pytest.mark.distributed
def test_rounds_of_init_train_save_and_reset_keep_no_group_alive(tmp_path):
    for rank, (before, after, alive) in enumerate(
        run_distributed(_rounds, str(tmp_path), ROUNDS, world_size=2, timeout=300)
    ):
        assert alive == [[]] * ROUNDS, (rank, alive)
        for r, (python, native) in enumerate(after):
            assert native == before[1], (rank, r, before, after)  # gloo's threads among them
            # The first background save may start a Python thread that stays; no more.
            assert python == after[0][0], (rank, r, before, after)
