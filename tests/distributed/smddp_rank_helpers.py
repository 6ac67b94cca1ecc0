"""Helpers of the smddp tests, rank-side (and ``rank_failure`` for the test side): ordering
events across ranks through the store, collecting errors with the time they took, the
backend's host layout, and a store that records what it carried (as a reader of the store
could)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def cpu_backend(group=None):
    """The CPU backend of `group` (default: the world): smddp's ProcessGroupSMDDP."""
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def tell(key: str) -> None:
    """Sets ``key`` in the default store: the rank that waits for it (``await_told``) goes on.

    For the tests that need events in an order across ranks: a key says the event happened,
    where a sleep would only make it likely (and wait longer than needed).
    """
    dist.distributed_c10d._get_default_store().set(key, "1")


def await_told(key: str, timeout_s: float = 60.0) -> bool:
    """Waits until some rank ``tell``s ``key``, then deletes it (the rank processes serve the
    next test too). False if ``timeout_s`` ran out first: a test whose check would otherwise
    hang (the other rank never tells) goes on and fails on its own assertions instead."""
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError, a RuntimeError: the timeout ran out
        return False
    store.delete_key(key)
    return True


def runtime_errors(cases) -> list[str | None]:
    """Runs each callable; returns the text of the RuntimeError it raised, or None."""
    messages = []
    for case in cases:
        try:
            case()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e))
    return messages


def raise_with_elapsed(fn) -> str:
    """Runs ``fn``; re-raises its RuntimeError with the seconds it took appended ("[after X s]")."""
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        raise RuntimeError(f"{e} [after {time.monotonic() - start:.2f} s]") from None
    return "no error"


def rank_failure(text: str, rank: int) -> tuple[str, float]:
    """The section of a DistributedTestError's text for ``rank``, and the seconds that
    raise_with_elapsed appended to it."""
    section = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
    assert "[after " in section, section
    return section, float(section.rsplit("[after ", 1)[1].split(" s]")[0])


def host_layout() -> list[list[int]]:
    """The host layout the backend uses for the default group (from its introspection)."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend._layout()["members"]


class RecordingStore:
    """A store that forwards to a TCPStore and remembers every key it set or read, as a reader
    of the store could; ``create`` makes one."""

    @staticmethod
    def create(host, port, world_size, is_master, block_on=None):
        from datetime import timedelta

        import torch.distributed as dist

        class Recording(dist.Store):
            def __init__(self):
                super().__init__()
                self.inner = dist.TCPStore(
                    host, port, world_size, is_master, timeout=timedelta(seconds=60)
                )
                self.seen = {}

            def set(self, key, value):
                self.inner.set(key, value)
                self.seen[key] = bytes(value) if not isinstance(value, str) else value.encode()
                if block_on and key.endswith(block_on[0]):
                    block_on[1]()

            def get(self, key):
                value = self.inner.get(key)
                self.seen[key] = bytes(value)
                return value

            def add(self, key, n):
                return self.inner.add(key, n)

            def check(self, keys):
                return self.inner.check(keys)

            def wait(self, keys, *args):
                return self.inner.wait(keys, *args)

            def delete_key(self, key):
                return self.inner.delete_key(key)

            deleteKey = delete_key  # noqa: N815  (the name torch's Python-store binding calls)

            def compare_set(self, key, expected, desired):
                return self.inner.compare_set(key, expected, desired)

            def num_keys(self):
                return self.inner.num_keys()

            def set_timeout(self, timeout):
                return self.inner.set_timeout(timeout)

        return Recording()
