"""The prefetch policy of activation offloading: pure Python, no tensors, no streams.

A *unit* is one call of a wrapped layer during one forward pass, numbered in forward order
(a layer called twice is two units). Backward visits units in the reverse order, so the
policy predicts "next in backward" as "the highest-numbered unit that has not run its
backward yet". ``PrefetchSchedule`` turns the events the engine observes (forward ended,
a unit's backward started, a unit's backward ended, backward finished, a new forward
began) into decisions: which units to bring back to the compute device and which to
release. The engine carries the decisions out; the tests drive this class with plain
integers.

Residency rule (``horizon`` = h): while unit ``u`` computes its backward, the resident
units are ``u`` itself plus at most h units ahead of it in backward order. At the end of
forward, the last h units are requested so the first backward layers do not wait.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class UnitState(enum.Enum):
    """Where one unit's offloaded activations are, from the policy's point of view."""

    IDLE = "idle"  # on the host only (after forward, or after a finished backward)
    REQUESTED = "requested"  # copy to the device issued, backward not started
    ACTIVE = "active"  # its backward is running; resident
    DONE = "done"  # its backward ended in the current backward pass; released


@dataclass(frozen=True)
class StartDecision:
    """What to do when a unit's backward starts.

    Attributes:
        fetch: Units to bring back now, in the order to issue the copies. Contains the
            starting unit itself first when it was not requested in time (a demand fetch).
        release: Units to release now (earlier units that have no end signal of their own).
        demand: Whether the starting unit had not been requested before its backward.
        lead: Units ahead of this one (in backward order) that are resident or in flight
            once ``fetch`` is issued.
        new_start: False when the unit was already active (a repeated unpack), in which
            case every other field is empty.
    """

    fetch: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    demand: bool = False
    lead: int = 0
    new_start: bool = False


@dataclass
class PrefetchSchedule:
    """Prefetch and release decisions for the units of one forward pass.

    Args:
        horizon: Maximum number of units kept resident ahead of the unit whose backward is
            running (``activation_loading_horizon``). Must be >= 0; 0 fetches on demand.

    Example:
        >>> s = PrefetchSchedule(horizon=1)
        >>> [s.add_unit() for _ in range(3)]
        [0, 1, 2]
        >>> s.on_forward_end()
        (2,)
        >>> s.on_backward_start(2).fetch
        (1,)
    """

    horizon: int
    _states: list[UnitState] = field(default_factory=list)
    _end_signal: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.horizon < 0:
            raise ValueError(
                f"horizon={self.horizon}: the prefetch horizon counts layers and must be >= 0; "
                "use activation_loading_horizon >= 1 (0 fetches each layer only when needed)."
            )

    # ------------------------------------------------------------------ forward
    def add_unit(self, has_end_signal: bool = True) -> int:
        """Registers the next unit of the forward pass and returns its index.

        Args:
            has_end_signal: Whether the engine will report the end of this unit's backward.
                Units without one are released when a lower-numbered unit starts its
                backward, or when the backward pass finishes.
        """
        self._states.append(UnitState.IDLE)
        self._end_signal.append(has_end_signal)
        return len(self._states) - 1

    @property
    def num_units(self) -> int:
        """Number of units registered so far."""
        return len(self._states)

    def state(self, unit: int) -> UnitState:
        """The policy state of ``unit``."""
        return self._states[unit]

    def on_forward_end(self) -> tuple[int, ...]:
        """Requests the last ``horizon`` idle units; returns them, last unit first."""
        return self._request(self._window(below=self.num_units))

    def on_new_forward(self) -> tuple[int, ...]:
        """Another forward pass begins while this one waits for its backward.

        Units requested at the end of this pass's forward would sit on the device during
        the other pass's forward and backward; they go back to idle (their host copies
        stay) and are fetched again when this pass's backward starts. Returns them.
        """
        return self._set_all(UnitState.REQUESTED, UnitState.IDLE)

    # ----------------------------------------------------------------- backward
    def on_backward_start(self, unit: int) -> StartDecision:
        """The first saved tensor of ``unit`` is being unpacked by the backward pass."""
        state = self._states[unit]
        if state is UnitState.ACTIVE:
            return StartDecision()
        demand = state is not UnitState.REQUESTED
        self._states[unit] = UnitState.ACTIVE
        release = tuple(
            u
            for u in range(unit + 1, self.num_units)
            if self._states[u] is UnitState.ACTIVE and not self._end_signal[u]
        )
        for u in release:
            self._states[u] = UnitState.DONE
        ahead = self._window(below=unit)
        fetch = ((unit,) if demand else ()) + self._request(ahead)
        lead = len(ahead)
        return StartDecision(fetch=fetch, release=release, demand=demand, lead=lead, new_start=True)

    def on_backward_end(self, unit: int) -> tuple[int, ...]:
        """The gradient of ``unit``'s input is complete; returns the units to release."""
        if self._states[unit] is not UnitState.ACTIVE:
            return ()
        self._states[unit] = UnitState.DONE
        return (unit,)

    def on_backward_finished(self) -> tuple[int, ...]:
        """The backward pass (one ``backward()`` call) finished; returns units to release.

        Units still active are released, and every done unit becomes idle again so that a
        later backward over a retained graph fetches it anew.
        """
        released = self._set_all(UnitState.ACTIVE, UnitState.DONE)
        self._set_all(UnitState.DONE, UnitState.IDLE)
        return released

    # ------------------------------------------------------------------ helpers
    def _window(self, below: int) -> list[int]:
        """The next ``horizon`` units below ``below`` in predicted backward order.

        Done units are skipped; an active unit below ``below`` (a backward running out of
        order) is resident, so it takes a place in the window.
        """
        window: list[int] = []
        for u in range(below - 1, -1, -1):
            if len(window) == self.horizon:
                break
            if self._states[u] is not UnitState.DONE:
                window.append(u)
        return window

    def _request(self, units: list[int]) -> tuple[int, ...]:
        """Marks the idle units among ``units`` as requested and returns them, in order."""
        fetch = tuple(u for u in units if self._states[u] is UnitState.IDLE)
        for u in fetch:
            self._states[u] = UnitState.REQUESTED
        return fetch

    def _set_all(self, old: UnitState, new: UnitState) -> tuple[int, ...]:
        changed = tuple(u for u, s in enumerate(self._states) if s is old)
        for u in changed:
            self._states[u] = new
        return changed
