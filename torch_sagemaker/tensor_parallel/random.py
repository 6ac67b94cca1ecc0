"""Random streams for tensor parallel regions (``tsm.state.get_rng_state_tracker()``).

Two kinds of randomness exist in a tensor parallel model:

- *Outside* TP regions (embedding and residual dropout), every TP rank computes on the
  same (or the same but sequence-sharded) activations, so every TP rank must draw the same
  numbers. They use the ordinary default generator, which all ranks of a TP group seed
  alike; a TP model then draws exactly what the untransformed model draws.
- *Inside* TP regions (attention-probability dropout on this rank's heads), each TP rank
  holds different heads and must draw different numbers, or every head slice would get
  the same mask. These draws come from a separate stream per TP rank, seeded
  ``random_seed + tp_rank``, entered with ``tracker.fork()``. Forking swaps that stream in
  and out of the default generator, so the draws inside never advance the shared stream.

This is the tracker Megatron-style code expects: ``fork(name)``, ``add(name, seed)``,
``get_states()``, ``set_states(states)`` and ``reset()``; Transformer Engine's
``checkpoint(get_rng_state_tracker=...)`` uses exactly these.

Note [TP-region RNG and activation checkpointing]: recomputing a forked region during
backward must replay the same numbers. Transformer Engine's checkpoint saves and restores
the tracker's states itself. ``torch.utils.checkpoint`` only restores the default
generators, so pass ``context_fn=tracker.checkpoint_context_fn`` (non-reentrant mode) when a
TP region draws random numbers (attention dropout > 0) under activation checkpointing.

Note [Unreplayed TP-region draws]: without that (reentrant ``torch.utils.checkpoint``, the
``CheckpointImpl.REENTRANT`` of SMP's scripts, or non-reentrant without ``context_fn``), the
recompute drew other dropout masks than the forward, and the gradients were silently wrong
(a tiny Llama at tp 2 with attention dropout 0.3: 0.25 off). A forked region that draws while
a backward pass runs is a recompute. It is replayed when it runs inside
``checkpoint_context_fn``'s recompute context, or when someone else set the tracker's states
during that backward (Transformer Engine's checkpoint does, before each recompute);
otherwise the backward raises. When the region ends by an exception (non-reentrant
checkpointing stops a recompute early by raising once it has what it needs, possibly inside
the region), the error is raised when the backward pass ends instead, through the engine's
final callback. Regions that draw nothing (dropout 0, the usual setting) are not affected.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from torch_sagemaker._torch_compat import autograd as autograd_compat

#: Name of the stream of tensor-parallel regions (Megatron's name for the same thing).
MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device_type() -> str:
    """The device whose default generator dropout uses: ``cuda`` when present, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named random-generator states that can be forked into the default generator.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``: whose default generator ``fork`` swaps.
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type or _device_type()
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        # Note [Unreplayed TP-region draws]: the backward pass during which a caller other
        # than checkpoint_context_fn set the states, and how many of its recompute contexts
        # are open.
        self._states_set_in = -1
        self._replaying = 0

    @classmethod
    def for_state(cls, state: Any) -> RNGStatesTracker:
        """The tracker of an initialized ``tsm.state``: one stream seeded ``random_seed + tp_rank``.

        Args:
            state: ``tsm.state`` after ``tsm.init`` (its ``random_seed``, ``tp_rank`` and
                ``device_type``: the stream swaps the generator of the mesh's device).

        Returns:
            A tracker holding the ``model-parallel-rng`` stream of this rank.
        """
        tracker = cls(state.device_type)  # TP regions run on the mesh's device
        tracker.add(MODEL_PARALLEL_RNG, state.random_seed + state.tp_rank)
        return tracker

    def reset(self) -> None:
        """Forgets every stream."""
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the generator state of every stream (for checkpoint replay)."""
        return {name: s.clone() for name, s in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces the stream states with ``states`` (from ``get_states``)."""
        self._states = {name: s.clone() for name, s in states.items()}
        self._states_set_in = autograd_compat.current_graph_task_id()

    def _restore(self, states: dict[str, torch.Tensor]) -> None:
        """``set_states`` for the tracker's own replay (it does not mark the backward pass)."""
        self._states = {name: s.clone() for name, s in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Creates the stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: If ``name`` exists or ``seed`` is used by another stream (two equal
                streams would draw correlated numbers).
        """
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first.")
        if seed in self._seeds:
            raise ValueError(
                f"seed {seed} is already used by another RNG stream; pick another seed."
            )
        saved = _get_rng_state(self.device_type)
        torch.manual_seed(seed) if self.device_type == "cpu" else torch.cuda.manual_seed(seed)
        self._states[name] = _get_rng_state(self.device_type)
        _set_rng_state(saved, self.device_type)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draws from stream ``name`` inside the block; the default stream is left untouched.

        Raises:
            KeyError: If ``name`` was never added.
        """
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} does not exist; known: {sorted(self._states)}.")
        saved = _get_rng_state(self.device_type)
        before = self._states[name]
        _set_rng_state(before, self.device_type)
        completed = False
        try:
            yield
            completed = True
        finally:
            after = _get_rng_state(self.device_type)
            self._states[name] = after
            _set_rng_state(saved, self.device_type)
            problem = self._unreplayed(name, before, after)
            if problem is not None and not completed:
                # Possibly a recompute stopped early: say it when the backward pass ends.
                autograd_compat.queue_callback(functools.partial(_raise, problem))
        if problem is not None:
            raise RuntimeError(problem)

    def _unreplayed(self, name: str, before: torch.Tensor, after: torch.Tensor) -> str | None:
        """Why the region's draws cannot be the forward's, or None (Note [Unreplayed ...])."""
        task = autograd_compat.current_graph_task_id()
        if task == -1 or self._replaying or task == self._states_set_in:
            return None
        if torch.equal(before, after):
            return None
        return (
            f"A tensor parallel region drew random numbers from the {name!r} stream while "
            "backward recomputed it (activation checkpointing), without replaying the "
            "stream: its dropout masks would differ from the forward's and the gradients "
            "would be wrong. Checkpoint with torch.utils.checkpoint(..., use_reentrant=False, "
            "context_fn=tsm.state.get_rng_state_tracker().checkpoint_context_fn), or "
            "torch_sagemaker's checkpoint_transformer_layers(model), or set the attention "
            "dropout to 0 (Note [Unreplayed TP-region draws] in tensor_parallel/random.py)."
        )

    def checkpoint_context_fn(
        self,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for non-reentrant ``torch.utils.checkpoint`` that replays TP-region draws.

        See Note [TP-region RNG and activation checkpointing]. The forward context records
        the stream states when the checkpointed block starts; the recompute context replays
        from them and then puts back the states the real forward left.
        """
        recorded: dict[str, torch.Tensor] = {}
        return _Recording(self, recorded), _Replay(self, recorded)


def _raise(message: str) -> None:
    raise RuntimeError(message)


class _Recording:
    """The forward context of ``checkpoint_context_fn``: records the states at the start."""

    def __init__(self, tracker: RNGStatesTracker, recorded: dict[str, torch.Tensor]) -> None:
        self.tracker, self.recorded = tracker, recorded

    def __enter__(self) -> None:
        self.recorded.update(self.tracker.get_states())

    def __exit__(self, *exc: Any) -> None:
        return None


class _Replay:
    """The recompute context of ``checkpoint_context_fn``: replays from the recorded states.

    Entered once per recompute, so as often as the block is recomputed (a second backward
    through a retained graph, or a gradient of a gradient): a one-shot generator context
    failed the second time.
    """

    def __init__(self, tracker: RNGStatesTracker, recorded: dict[str, torch.Tensor]) -> None:
        self.tracker, self.recorded = tracker, recorded
        self.after_forward: list[dict[str, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.after_forward.append(self.tracker.get_states())
        self.tracker._restore(self.recorded)
        self.tracker._replaying += 1

    def __exit__(self, *exc: Any) -> None:
        self.tracker._replaying -= 1
        self.tracker._restore(self.after_forward.pop())


__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker"]
