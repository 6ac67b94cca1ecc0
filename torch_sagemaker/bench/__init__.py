"""Benchmarks: ``python -m torch_sagemaker.bench <name> [options]``.

Each benchmark is a module of this package with a ``main(argv)`` function; the
dispatcher in ``__main__`` imports it only when asked for, so one benchmark's
dependencies never slow down or break another.
"""

from __future__ import annotations

# name -> (module, one-line description). Add a benchmark by adding a line here.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "collectives": ("torch_sagemaker.bench.collectives",
                    "nccl-tests style sweep of the smddp and gloo collectives"),
    "training": ("torch_sagemaker.bench.training",
                 "training-step time: FSDP2 and DDP over smddp and gloo"),
    "offload": ("torch_sagemaker.bench.offload", "activation offload step times"),
}
