"""Rank-side helpers of the smddp tests: ordering events across ranks through the store,
collecting errors with the time they took, and the backend's host layout."""

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
