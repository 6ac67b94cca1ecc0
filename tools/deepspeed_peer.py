"""DeepSpeed's CPU shared-memory all-reduce as a peer for the collective benchmark.

DeepSpeed (installed with ``DS_ACCELERATOR=cpu pip install deepspeed``) ships a C++ op,
built on first use by its ``ShareMemCommBuilder`` (about a minute, then cached under
``~/.cache/torch_extensions``), that its TorchBackend calls for ``inference_all_reduce`` on
CPU: ``torch.ops.deepspeed.inference_all_reduce_(t)``, an in-place SUM over every rank for
float32, bfloat16 and float16, all ranks on one host. The benchmark calls that op directly
(no ``deepspeed.init_distributed``, no wrapper), after the op's own ``initialize(world,
rank)``, which maps the other ranks' shared-memory segments. The op has no notion of a
process group: every rank of the world must call it in the same order.

DeepSpeed is imported only when this peer is asked for, so the benchmark runs without it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

INSTALL_HINT = "DS_ACCELERATOR=cpu pip install deepspeed"
OPS = ("all_reduce",)  # the collectives this peer can run


def require() -> None:
    """Checks, without importing it, that DeepSpeed is installed.

    Raises:
        ImportError: DeepSpeed is not installed; the message names the install command.
    """
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"the deepspeed backend needs DeepSpeed: {INSTALL_HINT}")


def _segment_name(rank: int) -> str:
    # The op names rank r's segment
    # deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<r>.
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


class ShmAllReduce:
    """DeepSpeed's shared-memory all-reduce, initialised for this process's rank.

    Args:
        world: number of ranks; all of them must be on this host.
        rank: this process's rank.
        barrier: a collective barrier over the same ranks (any backend), used to know when
            every rank has mapped every segment.

    Raises:
        ImportError: DeepSpeed is not installed.
        RuntimeError: the ranks span hosts, or the CPU lacks the op's float32 kernel (AVX2).
    """

    def __init__(self, world: int, rank: int, barrier: Callable[[], None]):
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) != world:
            raise RuntimeError(
                f"the deepspeed backend needs all ranks on one host "
                f"(world {world}, local world {local})"
            )
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            from deepspeed.accelerator import get_accelerator
        except ImportError as exc:
            raise ImportError(f"the deepspeed backend needs DeepSpeed: {INSTALL_HINT}") from exc
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None:
            raise RuntimeError(
                f"DeepSpeed's accelerator is {get_accelerator().device_name()!r}, "
                f"not cpu: reinstall with {INSTALL_HINT}"
            )
        module = builder.load(verbose=False)
        if module.vector_kernel_level() < 1:
            raise RuntimeError("DeepSpeed's shared-memory reduce needs AVX2 for float32")
        # The op only takes the shared-memory path when LOCAL_SIZE equals the world size;
        # otherwise it has nothing to reduce with.
        os.environ["LOCAL_SIZE"] = str(world)
        module.initialize(world, rank)
        barrier()  # every rank has mapped every segment: the names can go
        try:
            os.unlink(_segment_name(rank))
        except OSError:
            pass
        self._op = torch.ops.deepspeed.inference_all_reduce_.default

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums a contiguous float32/bfloat16/float16 tensor over all ranks, in place."""
        self._op(tensor)
