"""Two of the package's own switches in the environment: not SMP config keys.

``TSM_CUDA_BACKEND`` and ``TSM_OVERLAP_REPLICA_REDUCTION``. (``TSM_LOG_LEVEL`` is read by
``logger.py``, which every layer imports.)

SMP's config (``tsm.init``'s argument and ``SM_HP_MP_PARAMETERS``) is read by
``config_input.py`` and judged by ``config.py``. The variables here choose how the
package does something SMP does not configure: which backend CUDA tensors get, and
when FSDP1's reduction across replicas runs. Each reader takes an optional ``environ``
mapping (tests pass their own) and raises ``ConfigError`` naming the value and the
accepted ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch_sagemaker.config_input import ConfigError

#: Which collective backend ``tsm.init`` gives CUDA tensors when it creates the process group.
CUDA_BACKEND_ENV_VAR = "TSM_CUDA_BACKEND"
CUDA_BACKENDS = ("smddp", "nccl")


def cuda_backend(environ: Mapping[str, str] | None = None) -> str:
    """The backend for CUDA tensors ``tsm.init`` asks for: ``TSM_CUDA_BACKEND``, else "smddp".

    "smddp" stages CUDA tensors through host memory and reduces on the CPUs
    (docs/gpu.md); "nccl" reduces on the GPUs, with smddp kept for CPU tensors.

    Args:
        environ: Environment to read (default ``os.environ``).

    Raises:
        ConfigError: The variable holds another value.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(CUDA_BACKEND_ENV_VAR, "").strip().lower() or "smddp"
    if value not in CUDA_BACKENDS:
        raise ConfigError(
            [
                f"{CUDA_BACKEND_ENV_VAR}={environ[CUDA_BACKEND_ENV_VAR]!r} is not a backend for "
                f"CUDA tensors; expected one of {', '.join(CUDA_BACKENDS)} (or unset: smddp)"
            ],
            f"environment variable {CUDA_BACKEND_ENV_VAR}",
        )
    return value


#: ``1``: FSDP1's all-reduce across replicas runs during backward; ``0``: PyTorch's synchronous
#: call; unset: during backward when the job spans several hosts (sharding/fsdp1_replicas.py).
OVERLAP_REPLICA_REDUCTION_ENV_VAR = "TSM_OVERLAP_REPLICA_REDUCTION"


def overlap_replica_reduction(environ: Mapping[str, str] | None = None) -> bool | None:
    """``TSM_OVERLAP_REPLICA_REDUCTION``: True (``1``), False (``0``) or None (unset).

    Args:
        environ: Environment to read (default ``os.environ``).

    Raises:
        ConfigError: The variable holds another value.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(OVERLAP_REPLICA_REDUCTION_ENV_VAR, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise ConfigError(
            [
                f"{OVERLAP_REPLICA_REDUCTION_ENV_VAR}={value[:40]!r}: expected 0 (FSDP1's "
                "synchronous all-reduce across replicas) or 1 (run it while backward "
                "computes, also on one host); unset, it runs during backward when the job "
                "spans several hosts"
            ],
            f"environment variable {OVERLAP_REPLICA_REDUCTION_ENV_VAR}",
        )
    return value == "1"
