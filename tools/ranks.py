"""What every spawner of local ranks needs: a free port for their store, and their variables.

Benchmarks (``benchmarks.run_ranks``), the test launcher (``tests/distributed/launcher.py``),
the model-coverage runner and the local S3 server start processes on this host that meet
at a port on 127.0.0.1; they take it, and the ranks' torchrun variables, from here.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port that was free on every local address a moment ago.

    Probed on the wildcard address, as c10d's TCPStore binds it: a port free on 127.0.0.1
    can still be held on another address (an smddp listener binds an ephemeral port on the
    host's own address), and the store's wildcard bind then fails with EADDRINUSE. Another
    process may still take the port before the caller binds it; callers that start a store
    on it retry with a new port when the bind fails.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def set_rank_environment(rank: int, world: int, port: int, log_level: str = "WARNING") -> None:
    """Sets torchrun's variables for a rank spawned on this host (store at ``127.0.0.1:port``).

    Args:
        rank: The rank (also its local rank: every rank is on this host).
        world: Ranks in all.
        port: The store's port (``free_port``).
        log_level: The package's log level in the rank (``TSM_LOG_LEVEL``).
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TSM_LOG_LEVEL=log_level,
    )
