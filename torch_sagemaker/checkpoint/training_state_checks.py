"""What ``TrainingState`` checks across the ranks and against the checkpoint.

Note [Parameters without optimizer state]
-----------------------------------------
Optimizers such as Adam create a parameter's state at its first gradient, so a parameter that
has had none yet (the vision tower of a multimodal model fine-tuned on text only) has no
``optimizer.state.<fqn>.*`` keys in the checkpoint. The template that ``load`` fills, however,
gives a fresh optimizer state for every parameter (``get_state_dict``, or ``init_optim_state``
for the SM-local kind: one step with zero gradients, so ``step`` 1 and zero moments): DCP
would ask for keys that were never saved, and loading that made-up state would change the
parameter's later updates. ``load`` therefore reads the checkpoint's metadata: a parameter
with no state key at all under its name (or index) is left out of the load and ends up
without state, as in the run that saved it; its state is created at its first gradient.
After the read, every such parameter must be one of the saved optimizer's parameters
(``param_groups``), else the optimizer differs from the saved one and ``load`` raises. A
parameter with only some of its state keys, or with another optimizer's, is a mismatch that
the key check reports as before.

Note [A checkpoint that loads is the checkpoint that was saved]
--------------------------------------------------------------
DCP loads what the template asks for and ignores the rest of the checkpoint, and the key
check of ``state_dict_loader.load`` (SMP's function, which SMP's scripts call with part of
a checkpoint: the model first, the optimizer state later) refuses missing keys only. So a
bigger model's checkpoint (a 3-layer model's into a 1-layer one, a model with a head into
one without) loaded silently: the overlap was copied, the rest dropped, and training went
on from a state that was never saved. ``TrainingState`` always asks for the whole model and,
unless ``load_optimizer=False``, the whole optimizer, so ``load`` refuses a checkpoint
whose ``model.*`` or ``optimizer.state.*`` keys are not all requested, before anything is
read (``strict=False`` loads the overlap, with a warning naming what is left behind).
What is not a mismatch, and stays allowed:

- the other items: another rank's ``rng_rank<r>`` (saved by more ranks), ``fp8.*`` (a
  model without FP8 layers warns and skips it), ``lr_scheduler.*`` without a scheduler,
  the optimizer's keys with ``load_optimizer=False`` or no optimizer, and
  ``optimizer.param_groups.*`` (hyper-parameters: a scheduler adds ``initial_lr``, PyTorch
  versions add others; groups are matched to parameters by name when set);
- optimizer state the template lacks because the checkpoint has none for a parameter
  (Note [Parameters without optimizer state]): that is fewer saved keys, not more;
- FSDP1 and FSDP2, DTensor TP and per-TP/EP-rank directories: ``get_state_dict`` names
  the keys of every layout alike, and each per-rank directory holds what that rank's
  template asks for;
- a fresh optimizer over parameters that still hold gradients: ``get_state_dict`` builds
  its template state only when no parameter has a gradient, so the saved state would all
  be left behind (before this check, silently: the optimizer resumed without it); the
  template makes the state itself (``init_optim_state``) instead.

When keys are also missing, the loader's key check raises instead, listing both.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import torch.distributed as dist

from torch_sagemaker._torch_compat import dcp as dcp_compat
from torch_sagemaker.checkpoint import state_dict_utils as sdu
from torch_sagemaker.checkpoint.completeness import (
    NUM_PARTS,
    PARTS_FIX,
    WHOLE_SAVE_ID,
    parts_problem,
)
from torch_sagemaker.checkpoint.location import CheckpointLocation
from torch_sagemaker.checkpoint.marker import CheckpointError
from torch_sagemaker.logger import get_logger

KINDS = ("sharded", "local")
SHOWN = 10  # how many keys an error or warning names


def world_rank() -> int:
    """This rank in the default group, 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_all_gather(mine: Any) -> list[Any]:
    """Every rank's ``mine`` by rank over the default group; ``[mine]`` without one."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    return views


def agree_on_save(part: str, progress: tuple[int, str] | None) -> dict[str, Any]:
    """One all-gather over the world before a save: its whole-save id and number of parts.

    Rank 0 proposes the id; every rank records it in its part's marker (Note [The parts of
    one checkpoint come from one save] in ``completeness``). The number of parts is the
    number of distinct directories the ranks write. The same gather checks that every rank
    saves the same step and data position (``progress``, sharded kind only): a sharded
    checkpoint holds one copy of each, so ranks that disagree would resume from one rank's
    value, silently.

    Args:
        part: The directory this rank writes (its part, or the checkpoint itself).
        progress: ``(step, data position JSON)`` to compare, or ``None``.

    Returns:
        The marker fields ``WHOLE_SAVE_ID`` and ``NUM_PARTS``.

    Raises:
        ValueError: Naming the ranks whose step or data position differs from rank 0's.
    """
    # Compared as values: equal dicts built in another key order on another rank agree.
    compared = None
    if progress is not None:
        compared = (progress[0], json.dumps(json.loads(progress[1]), sort_keys=True))
    mine = (compared, uuid.uuid4().hex, part)
    views = _world_all_gather(mine)
    odd = [r for r, view in enumerate(views) if view[0] != views[0][0]]
    if odd:
        r = odd[0]
        raise ValueError(
            f"TrainingState.save: ranks {odd} save another step or data position than rank "
            f"0 (rank 0: step {views[0][0][0]}, data_position {views[0][0][1]}; rank {r}: "
            f"step {views[r][0][0]}, data_position {views[r][0][1]}). A sharded checkpoint "
            "keeps one copy of each: give every rank the same values (e.g. the global count "
            "of consumed samples), or keep per-rank positions in the model's or your own state."
        )
    return {WHOLE_SAVE_ID: views[0][1], NUM_PARTS: len({view[2] for view in views})}


def agree_on_parts(top: CheckpointLocation, part: CheckpointLocation) -> None:
    """Raises on every rank unless the parts the ranks load come from one save.

    Note [The parts of one checkpoint come from one save] in ``completeness``. Each part is
    loaded by its own group, which compares only its own ranks, so one all-gather over the
    world compares the parts' whole-save ids and counts; rank 0 also checks the step's
    directory itself (parts beside a whole checkpoint, or parts no rank loads). A whole
    checkpoint loaded by every rank needs no gather: the loader's own agreement spans the
    world. Markers without a whole-save id (written before it existed) pass as before.

    Raises:
        CheckpointError: Naming the parts, their save ids and the fix.
    """
    entries = part.marker_entries()
    problem: str | None = None
    if world_rank() == 0 and part is not top:
        try:
            problem = parts_problem(top)
        except Exception as e:  # noqa: BLE001 - sent to every rank in the gather below
            problem = f"could not be listed to compare its parts ({type(e).__name__}: {e})"
    mine = (
        str(part),
        entries.get(WHOLE_SAVE_ID),
        entries.get(NUM_PARTS) if entries else -1,
        problem,
    )
    views = _world_all_gather(mine)
    problem = views[0][3]
    # A part without a readable marker is left to its group's load, which names it.
    parts = {where: (whole_id, count) for where, whole_id, count, _ in views if count != -1}
    ids = {whole_id for whole_id, _ in parts.values()}
    counts = {count for _, count in parts.values()}
    if problem is not None or ids <= {None}:
        pass  # rank 0's finding; or parts written before whole-save ids: loaded as before
    elif len(ids) > 1:
        shown = ", ".join(
            f"{where} (save {whole_id or 'of an older version, without an id'})"
            for where, (whole_id, _) in sorted(parts.items())
        )
        problem = (
            f"holds parts written by different saves ({shown}): a save of this name stopped "
            "after some parts were committed, so the others are an older save's, and loading "
            f"them together would mix the two. {PARTS_FIX}"
        )
    elif len(parts) == len({v[0] for v in views}) and counts != {len(parts)}:
        problem = (
            f"was saved in {sorted(counts, key=str)} parts, but the ranks of this job load "
            f"{len(parts)} ({sorted(parts)}): load it under the layout that saved it."
        )
    if problem is not None:
        raise CheckpointError(f"checkpoint {top} {problem}")


def agree_across_parts(top: CheckpointLocation, failure: BaseException | None) -> None:
    """Raises on every rank if the load of any part failed (one all-gather over the world).

    Each part is loaded by its own group, whose ranks agree among themselves; the ranks of
    the other parts would otherwise return with their parts loaded and wait for the failed
    ones in the job's next collective until the group's timeout.

    Raises:
        BaseException: This rank's own ``failure``.
        CheckpointError: Naming a rank whose part failed, on the others.
    """
    views = _world_all_gather(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(rank, error) for rank, error in enumerate(views) if error is not None]
    if failed:
        rank, error = failed[0]
        raise CheckpointError(
            f"loading checkpoint {top}: the part of rank {rank} failed ({error}), so the parts "
            "loaded here were loaded without it; load the checkpoint again once that is fixed."
        )


def check_kind(kind: object, method: str) -> None:
    """Raises unless ``kind`` is one of ``TrainingState``'s kinds.

    Checked first: every step after it (where the checkpoint is, which ranks take part)
    depends on the kind, and an unknown one would fail there with an error about another
    kind (``kind="full"`` in a multi-rank job without ``tsm.init()`` would be told that
    kind='local' needs it).

    Raises:
        ValueError: Naming the value, the kinds and, for names of other APIs, the fix.
    """
    if kind in KINDS:
        return
    hints = {
        "full": (
            " 'full' is a checkpoint type of SMP's scripts (one torch.save of the gathered "
            "model); for a full model that from_pretrained reads, call save_hf_checkpoint."
        ),
        "sm_local": " 'sm_local' is the kind's name in the checkpoint's marker; pass kind='local'.",
        "hugging_face": " A Hugging Face export is save_hf_checkpoint's, read by from_pretrained.",
    }
    hint = hints.get(kind, "") if isinstance(kind, str) else ""
    raise ValueError(
        f"TrainingState.{method}(kind={kind!r}): kind must be one of {KINDS}: 'sharded' (the "
        "default; reshardable to any layout) or 'local' (SM-local: one directory per shard, "
        f"loads under the same layout only).{hint}"
    )


def refuse_keys_left_behind(
    sd: dict[str, Any], saved: dict[str, Any], path: Any, *, strict: bool
) -> None:
    """Raises if the checkpoint holds model or optimizer-state keys ``sd`` does not request.

    Note [A checkpoint that loads is the checkpoint that was saved].

    Args:
        sd: The template ``load`` fills (``TrainingState._state_dict``).
        saved: The checkpoint's ``state_dict_metadata``.
        path: The checkpoint, for the message.
        strict: Raise; ``False`` logs a warning instead.

    Raises:
        CheckpointError: With ``strict``, naming the keys left behind and the two fixes.
    """
    # DCP's own flattening: the keys compared are exactly those DCP stores.
    flat, _ = dcp_compat.flatten_state_dict(sdu.resolve_stateful(sd))
    if any(key not in saved for key in flat):
        return  # the loader's key check raises, naming the missing keys and these
    checked = ("model.", "optimizer.state.") if "optimizer" in sd else ("model.",)
    left = sorted(k for k in saved if k.startswith(checked) and k not in flat)
    if not left:
        return
    model_keys = sum(k.startswith("model.") for k in left)
    counts = [(model_keys, "model"), (len(left) - model_keys, "optimizer-state")]
    what = " and ".join(f"{n} {name} keys" for n, name in counts if n)
    shown = f"{left[:SHOWN]}{f' and {len(left) - SHOWN} more' if len(left) > SHOWN else ''}"
    if not strict:
        get_logger().warning(
            f"loading {path} with strict=False: {what} of the checkpoint are left behind "
            f"(this model and optimizer have no such keys): {shown}."
        )
        return
    raise CheckpointError(
        f"checkpoint {path} does not match the state being loaded: it holds {what} that this "
        f"model and optimizer do not have: {shown}. A checkpoint loads whole, so that what "
        "loads is what was saved; this one was saved from a bigger or different model, or "
        "another optimizer. Build the model and optimizer as the job that saved it did, or "
        "pass strict=False to load only the keys both have (load_optimizer=False leaves the "
        "optimizer out)."
    )


def drop_state_never_saved(optim_sd: dict[str, Any] | None, saved: dict[str, Any]) -> list[Any]:
    """Removes from ``optim_sd`` the state of parameters that have none in the checkpoint.

    Note [Parameters without optimizer state].

    Args:
        optim_sd: The optimizer part of the template to load (keyed by parameter name, or by
            index for the SM-local kind); ``None`` when the optimizer is not loaded.
        saved: The checkpoint's ``state_dict_metadata``.

    Returns:
        The keys of the parameters whose state was removed.
    """
    if not optim_sd:
        return []
    # Every dotted prefix of ``<key>.<state name>`` in ``optimizer.state.<key>.<state name>``
    # (one pass over the checkpoint's keys; a name may hold dots, a state name may be nested).
    held: set[str] = set()
    for name in saved:
        if name.startswith("optimizer.state."):
            parts = name[len("optimizer.state.") :].split(".")
            held.update(".".join(parts[:n]) for n in range(1, len(parts)))
    dropped = [key for key in optim_sd["state"] if str(key) not in held]
    for key in dropped:
        del optim_sd["state"][key]
    return dropped


def expect_saved_optimizer_params(
    optim_sd: dict[str, Any], stateless: list[Any], path: Any
) -> None:
    """Raises unless the saved optimizer held every parameter that has no state in it.

    ``optim_sd["param_groups"]`` is what the checkpoint holds once loaded (Note [Parameters
    without optimizer state]).

    Raises:
        CheckpointError: Naming the parameters the saved optimizer did not hold.
    """
    held = {p for group in optim_sd["param_groups"] for p in group["params"]}
    foreign = [key for key in stateless if key not in held]
    if foreign:
        raise CheckpointError(
            f"checkpoint {path} does not match the optimizer being loaded: the saved "
            f"optimizer did not hold {len(foreign)} of its parameters, which have no state "
            f"in the checkpoint: {foreign[:20]}. Load it into an optimizer over the same "
            "parameters as the one that saved it."
        )
