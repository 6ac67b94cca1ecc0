"""SMP's ``torch.sagemaker.context_parallel.utils`` (used by SageMaker HyperPod's adapter)."""

from __future__ import annotations

from typing import Any


def setup_transformer_engine_cp_groups(model: Any, ranks: Any, pg: Any) -> None:
    """Not implemented: SMP wires Transformer Engine attention of a non-SMP model to a CP group.

    Models here get context parallelism from ``tsm.transform`` instead, which needs no
    Transformer Engine: set ``context_parallel_degree`` and call ``tsm.transform(model,
    cp_comm_type="p2p" | "all_gather")`` (docs/context_parallel.md).

    Raises:
        NotImplementedError: Always, naming what to use instead.
    """
    raise NotImplementedError(
        "torch.sagemaker.context_parallel.utils.setup_transformer_engine_cp_groups "
        "wires Transformer "
        "Engine attention modules to a context parallel group, which this library does not use: "
        "set context_parallel_degree in the SMP config and call tsm.transform(model, "
        "cp_comm_type='p2p' or 'all_gather') (see docs/context_parallel.md)."
    )


__all__ = ["setup_transformer_engine_cp_groups"]
