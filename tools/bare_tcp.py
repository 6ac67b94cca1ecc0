"""The ring's flows as bare TCP streams: what the simulated hosts carry with no other work.

``bench multihost --backends ...,bare-tcp`` times, next to the real backends, a pseudo
collective that sends each rank's share of the bytes a ring collective puts on its host's
NIC straight to the same local rank of the next host, and receives as much from the previous
one: the flows smddp's ring uses (Note [Rail rings] in csrc/smddp/algorithms/net_ring.cpp),
with no reduction, no shared memory, no step waiting for another and one send and receive
buffer reused. It is not a collective; nothing arrives where a collective would put it.

Note [The bare-TCP ceiling]
All simulated hosts share this machine's cores, and so do the kernel's work for their
sockets, the bridge and the token buckets. Where those cores are the limit, no backend
can reach the NIC bound, and the fraction of the bound tells nothing about how close a
backend comes to what the machine allows. The bare streams give that ceiling: the same bytes
on the same flows at the same rate, the least CPU any backend could spend on them.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from tools import netns

BARE_TCP = "bare-tcp"  # its name among bench multihost's backends
_BUFFER_BYTES = 4 << 20  # what one send or receive call offers the kernel at most
_TIMEOUT_S = 30.0  # for connecting, and for each send or receive call


def ring_bytes(op: str, size: int, hosts: int, local: int) -> int:
    """Bytes one rank sends (and receives) in a ring collective of ``size`` bytes.

    Args:
        op: ``all_reduce``, ``all_gather_into_tensor`` or ``reduce_scatter_tensor``.
        size: The nccl-tests size: the all_reduce tensor, the all_gather output, the
            reduce_scatter input.
        hosts: H, the hosts.
        local: L, ranks per host (they split the host's share).

    Returns:
        ``k·(H−1)/H·size/L``, with k = 2 for all_reduce and 1 otherwise.
    """
    k = 2 if op == "all_reduce" else 1
    return k * (hosts - 1) * size // (hosts * local)


class BareRing:
    """One rank's two streams: to the same local rank of the next host, from the previous one.

    Args:
        rank: This rank, ``host * local + local_rank`` (as multihost.py numbers ranks).
        hosts: H.
        local: L.
        exchange: Gathers one object from every rank, in rank order (an all_gather_object).
    """

    def __init__(
        self, rank: int, hosts: int, local: int, exchange: Callable[[object], list]
    ) -> None:
        self.hosts, self.local = hosts, local
        host, local_rank = divmod(rank, local)
        listener = socket.create_server((netns.HOST_ADDRESS.format(host + 1), 0))
        listener.settimeout(_TIMEOUT_S)
        ports = exchange(listener.getsockname()[1])
        nxt = (host + 1) % hosts
        self._out = socket.create_connection(
            (netns.HOST_ADDRESS.format(nxt + 1), ports[nxt * local + local_rank]),
            timeout=_TIMEOUT_S,
        )
        self._in, _ = listener.accept()
        listener.close()
        for s in (self._out, self._in):
            s.settimeout(_TIMEOUT_S)
            # As smddp's sockets (tcp_wire.h): a message's tail is not held back.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pattern = rank % 251 + 1
        prev = (host - 1) % hosts * local + local_rank
        self._expect = prev % 251 + 1
        self._send = bytearray([self._pattern]) * _BUFFER_BYTES
        self._recv = bytearray(_BUFFER_BYTES)

    def case(self, op: str, size: int) -> tuple[Callable[[], None], Callable[[], bool]]:
        """(run, check) for the bytes of ``op`` at ``size``, as ``make_case`` returns them."""
        n = ring_bytes(op, size, self.hosts, self.local)

        def run() -> None:
            self._move(n)

        return run, lambda: self._move(n)

    def _move(self, n: int) -> bool:
        """Sends ``n`` bytes and receives ``n``, at once; whether what came is the peer's."""
        failure: list[BaseException] = []

        def send() -> None:
            view, left = memoryview(self._send), n
            try:
                while left:
                    step = min(left, len(view))
                    self._out.sendall(view[:step])
                    left -= step
            except BaseException as e:  # raised again by the caller
                failure.append(e)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        view, left, ok = memoryview(self._recv), n, True
        while left:
            got = self._in.recv_into(view, min(left, len(view)))
            if not got:
                raise ConnectionError(f"bare-tcp: the previous host closed with {left} bytes due")
            ok = ok and self._recv[got - 1] == self._expect and self._recv[0] == self._expect
            left -= got
        sender.join()
        if failure:
            raise failure[0]
        return ok

    def close(self) -> None:
        """Closes both streams."""
        self._out.close()
        self._in.close()
