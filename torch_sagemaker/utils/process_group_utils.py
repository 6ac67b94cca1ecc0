"""Process-group helpers (``torch.sagemaker.utils.process_group_utils``)."""

from __future__ import annotations

import torch.distributed as dist


def get_global_ranks(pg: dist.ProcessGroup | None = None) -> list[int]:
    """Global ranks of the members of ``pg``, in group-rank order.

    Args:
        pg: A process group; ``None`` means the default (world) group.

    Returns:
        The global rank of group rank 0, 1, ... of ``pg``.

    Raises:
        RuntimeError: If torch.distributed is not initialized.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "get_global_ranks needs torch.distributed: call dist.init_process_group() or "
            "torch.sagemaker.init() first."
        )
    return dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)
