"""Everything a training job needs to resume, in one checkpoint.

``TrainingState`` bundles the model, optimizer, LR scheduler, step, data position and every
rank's RNG states. It is a DCP ``Stateful`` and adds ``save`` / ``load`` with the
checkpoint kinds of ``state_dict_utils``:

checkpoint keys (sharded kind)      | what
------------------------------------|-----------------------------------------------------
``model.<fqn>``                     | DTensor shards from ``get_state_dict`` (HF names)
``optimizer.state.<fqn>.<name>``    | optimizer state keyed by parameter name (reshardable)
``optimizer.param_groups``          | hyper-parameters
``lr_scheduler.*``                  | ``lr_scheduler.state_dict()``
``step``, ``data_position``         | int, JSON text (the data position must be JSON-able)
``rng_rank<r>``                     | JSON text: torch (CPU and CUDA), Python, NumPy states
``fp8.<layer>.amax_history``, ``.scale`` | FP8 layers' delayed-scaling state, when there is some
                                    | (``torch_sagemaker/fp8/scaling_state.py``)

RNG states are per rank. After a resume on more ranks the new ranks keep their current RNG
(a warning says so); parity of dropout-free models does not depend on it.

Note [Saving creates no optimizer state]
---------------------------------------
An optimizer that has not stepped yet has no state. Building a state dict with one makes
it (``get_state_dict`` and ``init_optim_state`` run one step at learning rate 0), which
leaves the parameters as they are but not the training: Adam's ``step`` becomes 1 with zero
moments, so the first real step is bias-corrected as the second, and a save between
gradient accumulations would add the gradients so far to the moments. A save (a checkpoint
at step 0, or after a resume before stepping) must not change the run, so ``state_dict``
gives such an optimizer's ``param_groups`` and no per-parameter state, and drops what
``get_state_dict`` made; loading it leaves every parameter without state, as in the run that
saved it (Note [Parameters without optimizer state]). Only ``load``'s template creates state.

The checks against the checkpoint and across ranks are in ``training_state_checks``.
"""

from __future__ import annotations

import json
import random
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torch_sagemaker.checkpoint import state_dict_utils as sdu
from torch_sagemaker.checkpoint import training_state_checks as checks
from torch_sagemaker.checkpoint._group import Participants
from torch_sagemaker.checkpoint.async_utils import AsyncCallsQueue
from torch_sagemaker.checkpoint.completeness import (
    parts_problem,
)
from torch_sagemaker.checkpoint.location import (
    CheckpointId,
    CheckpointLocation,
    checkpoint_location,
)
from torch_sagemaker.checkpoint.marker import CheckpointError
from torch_sagemaker.checkpoint.retention import prune_beside
from torch_sagemaker.checkpoint.state_dict_loader import (
    agree_to_load,
    load,
    raise_if_replaced,
    read_metadata,
)
from torch_sagemaker.checkpoint.state_dict_saver import async_save, save
from torch_sagemaker.fp8 import scaling_state as fp8_state
from torch_sagemaker.logger import warn_once
from torch_sagemaker.state import state as smp_state  # (``state`` names RNG states here)


def _data_position_json(data_position: Any, *, check: bool) -> str:
    """``data_position`` as the JSON text a checkpoint keeps.

    Args:
        data_position: The position in the data.
        check: Refuse a value that would not load back equal (a save).

    Raises:
        ValueError: If ``check`` and JSON cannot hold ``data_position`` as it is: not
            serializable, or changed by the round trip (integer keys come back as strings,
            tuples as lists), so a loop indexing it by the same keys would fail after a resume.
    """
    try:
        text = json.dumps(data_position)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"data_position={data_position!r} cannot be saved: {e}. It is kept as JSON: use "
            "numbers, strings, bools, None, lists and dicts with string keys."
        ) from None
    if check and json.loads(text) != data_position:
        raise ValueError(
            f"data_position={data_position!r} would load back as {json.loads(text)!r}: it is "
            "kept as JSON, which has only string keys and lists. Use string keys and lists, "
            "so that a resumed run reads the position it saved."
        )
    return text


def rng_state_json() -> str:
    """This process's RNG states (torch CPU/CUDA, Python, NumPy) as JSON text."""
    state: dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        # The global legacy generator (MT19937) gives the tuple form, never the dict one.
        legacy = cast(tuple[str, Any, int, int, float], np.random.get_state())
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    except ImportError:
        pass
    return json.dumps(state)


def set_rng_state_json(text: str) -> None:
    """Restores the RNG states written by ``rng_state_json``."""
    state = json.loads(text)
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


class TrainingState:
    """Model, optimizer, LR scheduler, step, data position and RNG states of a training job.

    Args:
        model: The (sharded) model.
        optimizer: Optional optimizer over the model's parameters.
        lr_scheduler: Optional LR scheduler (anything with ``state_dict``/``load_state_dict``).
        step: Number of optimizer steps taken.
        data_position: JSON-serializable position in the data (e.g. consumed samples); the
            same on every rank (it is saved once).
        save_rng: Save and restore every rank's RNG states.

    Example:
        >>> ts = TrainingState(model, optim, sched, step=step, data_position={"samples": n})
        >>> ts.save(f"{ckpt_dir}/step{step}", num_kept=2)      # or use_async=True
        >>> ts.load(f"{ckpt_dir}/step{step}")                  # in a new job; ts.step restored
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        step: int = 0,
        data_position: Any = None,
        save_rng: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.step = step
        self.data_position = data_position
        self.save_rng = save_rng

    # ------------------------------------------------------------ Stateful
    def state_dict(self, kind: str = "sharded") -> dict[str, Any]:
        """The checkpoint content (see the module docstring); tensors are not copied."""
        return self._state_dict(kind, with_optimizer=True, template=False)

    def _state_dict(self, kind: str, *, with_optimizer: bool, template: bool) -> dict[str, Any]:
        """``state_dict``, without the optimizer's part (nor creating its state) if asked.

        ``template``: the state dict ``load`` fills, with optimizer state for every
        parameter; otherwise the state as it is, and an optimizer that has none yet gets none
        (Note [Saving creates no optimizer state]).
        """
        checks.check_kind(kind, "state_dict")
        sd: dict[str, Any] = {
            "step": self.step,
            "data_position": _data_position_json(self.data_position, check=not template),
        }
        optimizer = self.optimizer if with_optimizer else None
        fresh = optimizer is not None and not optimizer.state
        if kind == "local":
            sd["model"] = sdu.local_state_dict(self.model)
            if optimizer is not None:
                if template:
                    sdu.init_optim_state(optimizer)
                sd["optimizer"] = sdu.local_optim_state_dict(optimizer)
        else:
            if optimizer is not None and template and fresh and _holds_gradients(optimizer):
                # get_state_dict creates the template's state only when no parameter holds a
                # gradient; without state the saved one would not be loaded at all.
                sdu.init_optim_state(optimizer, skip_empty_param=False)
            optims = [optimizer] if optimizer is not None else []
            model_sd, optim_sd = get_state_dict(
                _unwrap_root(self.model), optims, options=StateDictOptions()
            )
            sd["model"] = model_sd
            if optimizer is not None:
                if fresh and not template:
                    # get_state_dict made state (one step at learning rate 0): drop it.
                    optimizer.state.clear()
                    optim_sd["state"] = {}
                sd["optimizer"] = optim_sd
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = self.lr_scheduler.state_dict()
        fp8 = fp8_state.scaling_state_dict(_unwrap_root(self.model))
        if fp8:
            sd[fp8_state.ITEM] = fp8
        if self.save_rng:
            sd[f"rng_rank{checks.world_rank()}"] = rng_state_json()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], kind: str = "sharded") -> None:
        """Applies a (loaded) ``state_dict()`` to the model, optimizer, scheduler and RNG.

        Raises:
            ValueError: If ``kind`` is not ``"sharded"`` or ``"local"``.
        """
        checks.check_kind(kind, "load_state_dict")
        if kind == "local":
            sdu.load_local_state_dict(self.model, state_dict["model"])
            if self.optimizer is not None and "optimizer" in state_dict:
                sdu.load_local_optim_state_dict(self.optimizer, state_dict["optimizer"])
        else:
            model = _unwrap_root(self.model)
            if self.optimizer is not None and "optimizer" in state_dict:
                # Not strict: parameters that had no state when saved stay without state
                # (Note [Parameters without optimizer state]); ``load`` checked the rest.
                set_optimizer_state_dict(
                    model,
                    self.optimizer,
                    state_dict["optimizer"],
                    options=StateDictOptions(strict=False),
                )
            set_model_state_dict(model, state_dict["model"])
        if self.lr_scheduler is not None and "lr_scheduler" in state_dict:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.step = int(state_dict["step"])
        self.data_position = json.loads(state_dict["data_position"])
        rng = state_dict.get(f"rng_rank{checks.world_rank()}")
        if rng is not None:
            set_rng_state_json(rng)
        if fp8_state.ITEM in state_dict:
            fp8_state.load_scaling_state_dict(_unwrap_root(self.model), state_dict[fp8_state.ITEM])

    # -------------------------------------------------------- save / load
    def _location(self, path: CheckpointLocation, kind: str) -> tuple[CheckpointLocation, Any, int]:
        """Location, process group and coordinator of this rank's part of checkpoint ``path``."""
        if kind == "sharded":
            if not _fsdp1_per_rank(self.model):
                return path, None, 0
            # Note [FSDP1 sharded state dict layout] (sharding/fsdp1_layout.py): FSDP1 shards of
            # TP and EP models hold TP-/EP-local tensors, so one directory per TP and EP rank,
            # written by the data-parallel ranks that hold that shard, as SMP's scripts do.
            if smp_state.cp_size > 1:
                raise NotImplementedError(
                    "TrainingState of an FSDP1 model with context parallelism and tensor or expert "
                    "parallelism is not supported: shard the model with FSDP2 "
                    "(torch_sagemaker.sharding.shard_model) for reshardable checkpoints."
                )
            if smp_state.ep_size > 1:
                if smp_state.layout.edp_replicate > 1:
                    raise NotImplementedError(
                        "TrainingState of an FSDP1 expert-parallel model whose experts are also "
                        f"replicated ({smp_state.layout.edp_replicate} replicas per EP rank) "
                        "is not "
                        "supported: use FSDP2 (torch_sagemaker.sharding.shard_model) or SM-local "
                        "checkpoints (kind='local')."
                    )
                group = (
                    smp_state.fsdp_shard_process_group
                )  # the ranks holding this EP rank's experts
                path = path.child(f"ep{smp_state.ep_size}-{smp_state.ep_rank}")
            else:
                group = smp_state.dp_process_group
                path = path.child(f"tp{smp_state.tp_size}-{smp_state.tp_rank}")
            return path, group, min(dist.get_process_group_ranks(group))

        if (
            not smp_state.initialized
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            # Without tsm's layout there are no replication groups to write each shard's
            # directory once; every rank would coordinate a save of the whole world.
            raise ValueError(
                f"TrainingState kind='local' in a job of {dist.get_world_size()} ranks needs "
                "torch.sagemaker.init() first: SM-local checkpoints are laid out by its "
                "shards and replicas. Call tsm.init() first, or use kind='sharded'."
            )
        # The ranks writing one ``tp{r}_ep{r}_fsdp{r}`` directory: the replicas that hold the
        # same shard *and the same experts* (with expert parallelism, replicas of different EP
        # ranks hold different experts; without it this is the whole replicate group).
        group = (
            smp_state.expert_fsdp_mesh["edp_replicate"].get_group()
            if smp_state.initialized
            else None
        )
        ranks = dist.get_process_group_ranks(group) if group is not None else [checks.world_rank()]
        return path.child(sdu.local_subdir()), group, min(ranks)

    def save(
        self,
        checkpoint_id: CheckpointId,
        *,
        kind: str = "sharded",
        use_async: bool = False,
        queue: AsyncCallsQueue | None = None,
        num_kept: int | None = None,
        regex: str | None = None,
    ) -> None:
        """Saves the training state to the directory ``checkpoint_id`` (all ranks call it).

        Args:
            checkpoint_id: The checkpoint directory (one per step, e.g. ``.../step300``), an
                ``s3://`` URI (credentials and endpoint from the AWS variables), or a
                ``checkpoint_location`` (S3 region and client options, checksums).
            kind: ``"sharded"`` (reshardable) or ``"local"`` (SM-local: one directory per
                shard ``tp{r}_ep{r}_fsdp{r}``, written by one rank of each replication group).
            use_async: Write in the background (see ``async_save``).
            queue: Queue for ``use_async``; default the global one.
            num_kept: After the save, keep only this many checkpoints in the parent
                directory (sharded kind; see ``limit_num_subdirs``); never this one, nor the
                newest complete one (Note [What retention keeps] in ``retention``).
            regex: Which sibling directories count for ``num_kept`` (default: every
                complete training checkpoint; never a Hugging Face export).

        Raises:
            ValueError: If ``kind`` is not ``"sharded"`` or ``"local"``, or ``num_kept`` is
                given with ``kind="local"``: its shard directories are committed by separate
                groups, none of which knows when the step is whole.
        """
        checks.check_kind(kind, "save")
        if num_kept is not None and kind == "local":
            raise ValueError(
                f"TrainingState.save(kind='local', num_kept={num_kept}): retention runs for "
                "the sharded kind only (an SM-local step's shard directories are committed "
                "by separate groups). Pass num_kept=None, and after every rank's save (a "
                "barrier) call torch.sagemaker.checkpoint.utils.limit_num_subdirs(parent, "
                f"{num_kept}) on one rank."
            )
        top = checkpoint_location(checkpoint_id)
        path, group, coordinator = self._location(top, kind)

        def retain() -> None:
            prune_beside(top, num_kept, regex=regex)

        # Per-TP-rank directories (FSDP1 + TP) commit separately; one of them prunes.
        per_rank_dirs = path is not top and kind == "sharded"
        prunes = kind == "sharded" and (not per_rank_dirs or _first_shard_dir())
        on_commit = retain if (num_kept is not None and prunes) else None
        sd = self.state_dict(kind)
        # Before any part is written (Note [The parts of one checkpoint come from one save]).
        progress = (sd["step"], sd["data_position"]) if kind == "sharded" else None
        marker_info = checks.agree_on_save(str(path), progress)
        if use_async:
            async_save(
                sd,
                checkpoint_id=path,
                process_group=group,
                coordinator_rank=coordinator,
                queue=queue,
                on_commit=on_commit,
                marker_info=marker_info,
            )
        else:
            save(
                sd,
                checkpoint_id=path,
                process_group=group,
                coordinator_rank=coordinator,
                on_commit=on_commit,
                marker_info=marker_info,
            )

    def load(
        self,
        checkpoint_id: CheckpointId,
        *,
        kind: str = "sharded",
        load_optimizer: bool = True,
        strict: bool = True,
    ) -> None:
        """Loads a checkpoint written by ``save``, resharding to this job's layout (sharded kind).

        Args:
            checkpoint_id: The checkpoint directory, ``s3://`` URI or ``checkpoint_location``.
            kind: The kind it was saved with.
            load_optimizer: Also restore the optimizer (and its step counts). Without it
                the optimizer is left as it is (a fresh one keeps no state).
            strict: Refuse a checkpoint holding model or optimizer-state keys that this
                model or optimizer does not have (a bigger model's, another optimizer's).
                ``False`` loads the keys both have and leaves the others behind, with a
                warning naming them; keys this model asks for must be in the checkpoint
                either way (Note [A checkpoint that loads is the checkpoint that was saved]).

        Parameters without optimizer state in the checkpoint (no gradient yet when it was
        saved) end up without state (Note [Parameters without optimizer state]).

        Raises:
            ValueError: If ``kind`` is not ``"sharded"`` or ``"local"``.
            CheckpointError: If the checkpoint is missing, incomplete, corrupt, in parts
                that different saves wrote (or beside a whole checkpoint; Note [The parts of
                one checkpoint come from one save]), or does not
                match the model (the message names the keys and shapes), holds model or
                optimizer-state keys this one does not request (with ``strict``; checked
                before anything is read), or its optimizer did not hold a parameter of this
                one, or another save committed over it during the load, or (in parts) the
                load of another part failed (all found after the read, which has filled the
                model's and the optimizer's tensors in place: after these errors, build them
                anew rather than train on).
        """
        checks.check_kind(kind, "load")
        top = checkpoint_location(checkpoint_id)
        path, group, coordinator = self._location(top, kind)
        # Without the optimizer, its template is not even built: building it creates state
        # (one step with zero gradients) that a fresh optimizer must not carry on, so it is
        # dropped again when the load fails.
        fresh = load_optimizer and self.optimizer is not None and not self.optimizer.state
        failure: Exception | None = None
        sd: dict[str, Any] = {}
        try:
            sd = self._read(top, path, group, coordinator, kind, load_optimizer, strict)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank of the parts
            failure = e
        try:
            if path is not top:
                # Each part's group agreed within itself; the other parts' ranks must learn.
                checks.agree_across_parts(top, failure)
            elif failure is not None:
                raise failure
        except Exception:
            if fresh and self.optimizer is not None:
                self.optimizer.state.clear()
            raise
        self.load_state_dict(sd, kind)

    def _read(
        self,
        top: CheckpointLocation,
        path: CheckpointLocation,
        group: Any,
        coordinator: int,
        kind: str,
        load_optimizer: bool,
        strict: bool,
    ) -> dict[str, Any]:
        """Reads this rank's part ``path`` of checkpoint ``top`` into a new template (``load``).

        Every rank of ``group`` raises together: the checks are agreed before the read, and
        the read is checked to be of one save.
        """
        participants = Participants(group)
        # Before the first read: the metadata read here and the data ``load`` reads must be
        # of one save (Note [A save that replaces a checkpoint being loaded]).
        save_id = path.marker_save_id()
        # Built on every rank before any check can fail on one: it may take collectives.
        sd = self._state_dict(kind, with_optimizer=load_optimizer, template=True)
        failure: Exception | None = None
        stateless: Any = None
        try:
            stateless = self._check_before_load(top, path, sd, strict)
        except Exception as e:  # noqa: BLE001 - every rank learns of it first (below)
            failure = e
        # One rank's failure (a transient read error, a save committing between the ranks'
        # reads) raises on every rank here, rather than leaving the others in ``load``'s
        # first collective until the group's timeout.
        agree_to_load(path, participants, failure, save_id, path.marker_entries().get("kind"))
        # Ranks may differ in the RNG key only, so the key-set agreement check is skipped.
        load(
            sd,
            checkpoint_id=path,
            process_group=group,
            coordinator_rank=coordinator,
            check_keys_matched=False,
        )
        raise_if_replaced(path, save_id, participants)
        if stateless:
            checks.expect_saved_optimizer_params(sd["optimizer"], stateless, path)
        return sd

    def _check_before_load(
        self, top: CheckpointLocation, path: CheckpointLocation, sd: dict[str, Any], strict: bool
    ) -> Any:
        """``load``'s checks of checkpoint ``path`` (in ``top``) against template ``sd``.

        Drops from ``sd`` what the checkpoint does not hold and need not (state of
        parameters that never had any, this rank's RNG state when fewer ranks saved) and
        sizes its FP8 item as saved.

        Returns:
            The optimizer's parameters that were saved without state
            (``checks.drop_state_never_saved``).

        Raises:
            CheckpointError: Parts of different saves, a checkpoint that cannot be read, or
                keys left behind (with ``strict``).
        """
        if path is not top:
            checks.agree_on_parts(top, path)  # in parts: each group's load compares only its own
        elif (problem := parts_problem(top)) is not None:
            # Parts of another save beside the whole checkpoint: every rank lists the same
            # directory, so every rank raises (one listing; markers read only if parts exist).
            raise CheckpointError(f"checkpoint {top} {problem}")
        saved = read_metadata(path).state_dict_metadata
        stateless = checks.drop_state_never_saved(sd.get("optimizer"), saved)
        self._expect_saved_fp8_state(sd, saved, path)
        rng_key = f"rng_rank{checks.world_rank()}"
        if rng_key in sd and rng_key not in saved:
            warn_once(
                f"checkpoint {path} has no RNG state for rank {checks.world_rank()} (it was "
                "saved by fewer ranks); ranks without one keep their current RNG state."
            )
            sd.pop(rng_key)
        checks.refuse_keys_left_behind(sd, saved, path, strict=strict)
        return stateless

    def _expect_saved_fp8_state(self, sd: dict[str, Any], saved: Any, path: Any) -> None:
        """Makes ``sd``'s FP8 item what the checkpoint holds, allocated to the saved sizes.

        Before its first FP8 step a layer has no state to load into, and the saved history
        may be longer or shorter than the current one.
        """
        sd.pop(fp8_state.ITEM, None)
        prefix = fp8_state.ITEM + "."
        sizes = {k[len(prefix) :]: m.size for k, m in saved.items() if k.startswith(prefix)}
        if not sizes:
            return
        if not fp8_state.has_fp8_layers(self.model):
            warn_once(
                f"checkpoint {path} holds FP8 scaling state but the model has no FP8 layers; "
                "it is not loaded."
            )
            return
        sd[fp8_state.ITEM] = fp8_state.empty_like_saved(sizes)


def _holds_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a parameter of ``optimizer`` holds a gradient."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _unwrap_root(model: nn.Module) -> nn.Module:
    """The model under root-level activation wrappers (``offload_wrapper``, ``checkpoint_wrapper``).

    Their state-dict keys are the wrapped module's, but DCP's ``get_state_dict`` maps optimizer
    parameters to names by walking the module tree and mistakes an FSDP1 root under such a
    wrapper for a plain attribute (it keeps ``_fsdp_wrapped_module`` in the names), so that
    ``set_state_dict`` then misses the optimizer state of every root parameter.
    """
    from torch_sagemaker._torch_compat import checkpoint_wrapper as cw_compat

    while isinstance(model, cw_compat.ActivationWrapper):
        model = cw_compat.wrapped_module(model)
    return model


def _first_shard_dir() -> bool:
    """Whether this rank writes the first per-TP/EP-rank directory (whose group prunes)."""
    return not smp_state.initialized or (smp_state.tp_rank == 0 and smp_state.ep_rank == 0)


def _fsdp1_per_rank(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP1-wrapped with tensor- or expert-parallel parameters inside."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return (
        smp_state.initialized
        and (smp_state.tp_size > 1 or smp_state.ep_size > 1)
        and any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    )


__all__ = ["TrainingState", "rng_state_json", "set_rng_state_json"]
