"""The end of a save: collect the checksums, commit on the coordinator, agree on the outcome.

Note [Commit outcome]
    After every rank has written its files (DCP's ``save`` returned), the participants
      A. gather every rank's file checksums on the coordinator (Note [Checkpoint checksums]),
      B. the coordinator commits (Note [Checkpoint commit protocol]) and posts the outcome
         ("committed", or why not) under the save's id in the c10d store,
      C. the coordinator broadcasts the outcome; every rank reports it.
    Every rank runs A and C even when one of them failed on it, so that a surviving peer is
    never left waiting for a collective nobody else joins.

    A rank can die anywhere in A-C, and then the collectives fail on the others with the
    backend's error. That error says nothing about the checkpoint, which may well be
    complete: the commit needs no peer once A is done. So each rank reports what happened:
    - the coordinator knows: committed (``CheckpointError`` with ``committed=True``: the
      checkpoint is complete and loadable, a rank failed after the commit) or not;
    - another rank whose A or C failed asks the store for the outcome posted in B, polling
      for up to ``OUTCOME_WAIT_S`` (the commit itself is a few renames and fsyncs), and also
      looks at the directory: a marker carrying this save's id means committed. If neither
      answers (the coordinator died first) it reports that it cannot tell, and what the
      directory holds now.
    The save's id is made by the coordinator when it prepares the staging directory and
    reaches every rank with that step's broadcast, so it costs no extra collective; the
    store key is deleted once the outcome reached every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch_sagemaker._torch_compat import c10d as c10d_compat
from torch_sagemaker.checkpoint import integrity
from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.location import CheckpointLocation
from torch_sagemaker.checkpoint.marker import CheckpointError

#: How long a rank that lost its peers waits for the coordinator's outcome.
OUTCOME_WAIT_S = 60.0
COMMITTED = "committed"
_POLL_S = 0.05


def _key(save_id: str) -> str:
    return f"tsm_checkpoint_outcome/{save_id}"


def _store() -> Any:
    try:
        return c10d_compat.default_store()
    except Exception:  # noqa: BLE001 - no store (no process group): nothing to post
        return None


def _post(save_id: str, outcome: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(_key(save_id), outcome)
        except Exception:  # noqa: BLE001 - the store went away with its host; C still reports
            pass


def _clear(save_id: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.delete_key(_key(save_id))
        except Exception:  # noqa: BLE001 - only tidiness
            pass


def _await_outcome(path: CheckpointLocation, save_id: str) -> str | None:
    """The coordinator's outcome from the store or the directory; ``None`` if unknown in time."""
    store = _store()
    deadline = time.monotonic() + OUTCOME_WAIT_S
    while True:
        if path.marker_save_id() == save_id:
            return COMMITTED
        if store is not None:
            try:
                if store.check([_key(save_id)]):
                    return store.get(_key(save_id)).decode()
            except Exception:  # noqa: BLE001 - the store's host died: only the directory is left
                store = None
        if store is None or time.monotonic() > deadline:
            return COMMITTED if path.marker_save_id() == save_id else None
        time.sleep(_POLL_S)


def _holds(path: CheckpointLocation) -> str:
    """``path.where()``, or why it could not be told: an error's own message must not fail."""
    try:
        return path.where()
    except Exception as e:  # noqa: BLE001 - the storage that failed the commit may fail this too
        return f"what {path} holds could not be read ({type(e).__name__}: {e})"


def _report(
    path: CheckpointLocation, coordinator: int, outcome: str | None, failure: BaseException
) -> CheckpointError:
    cause = f"{type(failure).__name__}: {failure}"
    if outcome == COMMITTED:
        return CheckpointError(
            f"checkpoint {path} was saved and is complete and loadable (rank {coordinator} "
            f"committed it), but a rank of the group failed right after the commit: {cause}. "
            "The checkpoint is not affected: resume from it.",
            committed=True,
        )
    if outcome is not None:
        return CheckpointError(
            f"checkpoint {path} was not saved: rank {coordinator} reported '{outcome}', and the "
            f"group failed: {cause}. Now {_holds(path)}."
        )
    return CheckpointError(
        f"checkpoint {path}: a rank of the group failed after writing ({cause}) and rank "
        f"{coordinator}, which commits, did not report within {OUTCOME_WAIT_S:.0f} s whether "
        f"it committed; this save is not in {path}. Now {_holds(path)}."
    )


def publish(
    participants: Participants,
    path: CheckpointLocation,
    save_id: str,
    records: integrity.Written | None,
    commit: Callable[[integrity.Written | None], None],
    after_commit: Callable[[], None],
) -> None:
    """Steps A-C of Note [Commit outcome], on every participant.

    Args:
        participants: The saving ranks.
        path: The checkpoint's location.
        save_id: This save's id (written into the marker by ``commit``).
        records: This rank's ``integrity.Recorder.records()`` (``None``: not followed).
        commit: Commits the save given every rank's records (coordinator).
        after_commit: Runs on the coordinator after a commit, once the outcome is out.

    Raises:
        CheckpointError: If the save was not committed, or it was but a rank failed
            meanwhile (``committed=True``), or the outcome could not be learned.
    """
    failure: BaseException | None = None
    try:
        gathered = participants.gather(records)
    except Exception as e:  # noqa: BLE001 - reported below with what is known of the commit
        failure, gathered = e, None
    outcome = None
    if participants.is_coordinator:
        if failure is not None:
            outcome = f"not committed: collecting the checksums failed ({type(failure).__name__})"
        else:
            try:
                commit(integrity.merge(gathered or []))
                outcome = COMMITTED
            except Exception as e:  # noqa: BLE001 - forwarded to every rank
                if not participants.distributed:
                    raise
                outcome = f"not committed: {type(e).__name__}: {e}"
        if participants.distributed:
            _post(save_id, outcome)
    known = participants.is_coordinator
    try:
        outcome = participants.broadcast(outcome)
        known = True
    except Exception as e:  # noqa: BLE001
        failure = failure or e
    if participants.is_coordinator and outcome == COMMITTED:
        after_commit()
    if failure is None:
        if participants.is_coordinator and participants.distributed:
            _clear(save_id)
        if outcome != COMMITTED:
            raise CheckpointError(
                f"rank {participants.coordinator} failed to finish the "
                f"checkpoint {path}: {outcome}. Now {_holds(path)}."
            )
        return
    if not known:
        outcome = _await_outcome(path, save_id)
    raise _report(path, participants.coordinator, outcome, failure) from failure


__all__ = ["COMMITTED", "OUTCOME_WAIT_S", "publish"]
