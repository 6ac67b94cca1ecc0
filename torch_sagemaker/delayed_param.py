"""Delayed parameter initialization (``torch.sagemaker.delayed_param``).

A model built on the meta device (or under ``accelerate.init_empty_weights()``) has no
parameter storage. ``DelayedParamIniter`` materializes and initializes it module by module,
after sharding decided where each piece lives:

- FSDP1: pass ``get_param_init_fn()`` as ``param_init_fn``; FSDP calls it once per module
  and it touches that module's own tensors only.
- FSDP2 and tensor parallelism: build on meta, apply ``tsm.transform`` / ``fully_shard``,
  then call ``init_model()``; every rank allocates and fills only its local shards.

Note [Layout-independent init]
    Each module is initialized on full-size CPU "shadow" tensors by the Hugging Face model's
    own ``_init_weights`` (or the generic rules below for other models) under a random seed
    derived from (base seed, module name). Each rank then copies the piece it owns: the
    whole tensor for FSDP1 before flattening, the local shard of a DTensor for FSDP2 and TP.
    The values therefore depend on the seed and the module names only, never on the world
    size, the shard or TP degree, or the order FSDP visits modules in. They are not the
    values ``from_config`` would draw (that consumes one global RNG stream), but they follow
    the same distributions, parents' rules for their children included (Note [Rules a
    parent applies to its children]). The cost is one full-size temporary per module at a
    time.

Note [Rules a parent applies to its children]
    Hugging Face calls ``_init_weights`` on every module, children before their parent
    (``PreTrainedModel.initialize_weights``), and a parent's call may write its children's
    tensors: GPT-2's ``GPT2Attention`` and ``GPT2MLP`` draw ``c_proj.weight`` again with std
    ``initializer_range / sqrt(2 * n_layer)``, after ``c_proj``'s own call drew it with
    ``initializer_range``. Initializing each module on its own tensors alone would keep the
    child's draw and lose the parent's rule. So, once, when the initer is built, every
    module's ``_init_weights`` call runs with every tensor of the model replaced by an empty
    meta-device stand-in, and records which stand-ins it touched (any torch function given
    one: ``init.normal_``, ``.data``, indexing, even reading the shape). Touched, not
    written: writes cannot be seen on meta (``trunc_normal_`` and ``orthogonal_`` return
    early for meta tensors, and a write through ``.data`` bumps no version counter), and a
    call that only read a tensor does no harm when it runs again. When a module's tensors
    are initialized, its own call and every other call that touched one of them run on its
    shadows, in Hugging Face's order; the other tensors those calls touch are meta
    stand-ins again, so no call writes into memory another module owns. Each tensor thus
    ends as the last of Hugging Face's calls left it, still one module's tensors at a time,
    under that module's seed: nothing is materialized beyond one module's tensors, and the
    values stay independent of the layout. A tied tensor is decided by the calls that reach
    it through its first holder (the input embedding, whose value ``tie_weights`` keeps, as
    in Hugging Face); the stand-ins are per holder, so a call through another holder is no
    writer of it. Recording costs one call per module, on meta, and a call that touched no
    other module's tensors runs later for its own module only.

Note [Buffers after delayed init]
    Non-persistent buffers (rotary ``inv_freq``) of a meta model have no values, and
    ``to_empty`` leaves garbage in every buffer. Shadow buffers start as NaN (floating point)
    and are recomputed by ``_init_weights``; buffers that had real values before
    ``init_model`` are restored from a snapshot. Anything still NaN afterwards raises, so
    uninitialized memory never reaches training.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from torch_sagemaker._torch_compat import nn as nn_compat
from torch_sagemaker._torch_compat import tensor as tensor_compat
from torch_sagemaker.logger import log_rank0
from torch_sagemaker.utils.module_utils import (
    default_device,
    empty_module_params,
    move_buffers_to_device,
)

_DEFAULT_STD = 0.02
# A module's own parameters or buffers, the dictionary itself.
_OWN_TENSORS: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    "parameter": nn_compat.own_parameters,
    "buffer": nn_compat.own_buffers,
}


# A tensor's place: (id of the module holding it, "parameter" or "buffer", attribute name).
_Slot = tuple[int, str, str]
# The same with the module itself, to reach its dictionaries.
_SlotRef = tuple[nn.Module, str, str]


def _slot(ref: _SlotRef) -> _Slot:
    return id(ref[0]), ref[1], ref[2]


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Every module once, children before their parent: Hugging Face's order of init calls."""
    order: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.setdefault(id(module), module)

    visit(model)
    return list(order.values())


def _stand_in(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """An empty meta-device tensor of ``tensor``'s global shape and dtype (a Parameter for one)."""
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(empty, requires_grad=False) if kind == "parameter" else empty


class _Touches(TorchFunctionMode):
    """Records which of the watched tensors any torch function is given while it is active."""

    def __init__(self, watched: dict[int, _SlotRef]) -> None:
        super().__init__()
        self._watched = watched
        self.touched: dict[_Slot, _SlotRef] = {}  # in the order first touched

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._note(args)
        self._note(kwargs.values())
        return func(*args, **kwargs)

    def _note(self, values: Any) -> None:
        for value in values:
            if isinstance(value, (list, tuple)):
                self._note(value)
            elif isinstance(value, dict):
                self._note(value.values())
            else:
                ref = self._watched.get(id(value))
                if ref is not None:
                    self.touched.setdefault(_slot(ref), ref)


@contextlib.contextmanager
def _installed(tensors: dict[_SlotRef, torch.Tensor]) -> Iterator[None]:
    """Puts each tensor in its slot for the block, then puts back what was there."""
    saved = []
    try:
        for (module, kind, name), tensor in tensors.items():
            own = _OWN_TENSORS[kind](module)
            # An entry FSDP1 removed since (a flattened unit's) is left alone: a call that
            # reaches it then fails on the missing attribute instead of writing into it.
            if name in own:
                saved.append((own, name, own[name]))
                own[name] = tensor
        yield
    finally:
        for own, name, old in reversed(saved):
            own[name] = old


def _module_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed from the base seed and a module name, stable across processes."""
    digest = hashlib.sha256(f"{base_seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _generic_init(module: nn.Module, std: float) -> None:
    """The generic Hugging Face rules, for models without an ``_init_weights``."""
    name = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif (
        isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "LayerNorm" in name or "RMSNorm" in name
    ):
        if getattr(module, "weight", None) is not None:
            nn.init.ones_(cast(torch.Tensor, module.weight))
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(cast(torch.Tensor, module.bias))
    elif hasattr(module, "reset_parameters"):
        cast(Callable[[], None], module.reset_parameters)()


def _local_piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` on ``like``'s device, as a DTensor with ``like``'s sharding when it has one."""
    if isinstance(like, DTensor):
        # src_data_rank=None: every rank cuts its own shard out of its identical full copy,
        # no communication (Note [Layout-independent init]).
        return distribute_tensor(
            full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
        )
    return full.to(like.device)


class DelayedParamIniter:
    """Materializes and initializes the parameters of a meta-device model, module by module.

    Args:
        model: The model, built on the meta device or under ``init_empty_weights``.
        init_method_using_config: Optional ``fn(module)`` replacing the default init; it must
            materialize and fill the module's own tensors (``empty_module_params``, init by
            type, ``move_buffers_to_device``). It runs under the per-module seed, once per
            module: rules a parent applies to its children are then the fn's to apply.
        verbose: Log every initialized module on rank 0.
        device: Where to materialize; default the current CUDA device, else CPU.
        seed: Base seed; default ``torch.initial_seed()`` (the last ``torch.manual_seed``).

    Raises:
        RuntimeError: If the model's ``_init_weights`` fails on meta-device stand-ins, which
            the initer runs it on to learn which tensors each call writes (Note [Rules a
            parent applies to its children]).

    Example:
        >>> with torch.device("meta"):
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> initer = DelayedParamIniter(model)
        >>> with initer.validate_params_and_buffers_inited():
        ...     model = FSDP(model, param_init_fn=initer.get_param_init_fn(), ...)
    """

    def __init__(
        self,
        model: nn.Module,
        init_method_using_config: Callable | None = None,
        verbose: bool = False,
        *,
        device: torch.device | str | None = None,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.init_method_using_config = init_method_using_config
        self.verbose = verbose
        self.device = torch.device(device) if device is not None else default_device()
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self._names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        # A tied parameter belongs to the first module holding it (the input embedding
        # before the output head), whichever module FSDP happens to visit first.
        self._canonical_owner: dict[int, nn.Module] = {}
        for _, m in model.named_modules():
            for p in m.parameters(recurse=False):
                self._canonical_owner.setdefault(id(p), m)
        self._init_owner = self._find_init_owners(model)
        # Note [Rules a parent applies to its children]: what each init call touches, and
        # the calls besides a slot's own module's that touch it. A custom init function
        # replaces the model's init calls, so nothing is recorded for it.
        self._order = {id(m): i for i, m in enumerate(_post_order(model))}
        self._touched: dict[int, dict[_Slot, _SlotRef]] = {}
        self._writers: dict[_Slot, list[nn.Module]] = {}
        self._stand_ins: dict[_Slot, torch.Tensor] = {}
        if init_method_using_config is None:
            self._record_init_calls(model)
        self._total_numel = sum(p.numel() for p in self._unique_params(model))
        self._materialized: dict[int, nn.Parameter] = {}  # id(meta param) -> its replacement
        self._done_modules: set[int] = set()
        self._inited_params: set[int] = set()
        self._inited_numel = 0

    # ------------------------------------------------------------ bookkeeping
    @staticmethod
    def _unique_params(module: nn.Module, recurse: bool = True) -> list[nn.Parameter]:
        return list({id(p): p for p in module.parameters(recurse=recurse)}.values())

    @staticmethod
    def _find_init_owners(model: nn.Module) -> dict[int, nn.Module | None]:
        """Maps each module to the nearest enclosing module that defines ``_init_weights``."""
        owners: dict[int, nn.Module | None] = {}

        def visit(module: nn.Module, owner: nn.Module | None) -> None:
            if hasattr(module, "_init_weights") and hasattr(module, "config"):
                owner = module
            owners.setdefault(id(module), owner)
            for child in module.children():
                visit(child, owner)

        visit(model, None)
        return owners

    def _record_init_calls(self, model: nn.Module) -> None:
        """Runs every module's init call once on meta stand-ins, recording what it touches.

        See Note [Rules a parent applies to its children].

        Raises:
            RuntimeError: Naming the module, if its init call fails on the stand-ins.
        """
        refs: list[_SlotRef] = [
            (m, kind, n)
            for m in model.modules()
            for kind, own in _OWN_TENSORS.items()
            for n, t in own(m).items()
            if t is not None
        ]
        stand_ins = {
            _slot(ref): _stand_in(_OWN_TENSORS[ref[1]](ref[0])[ref[2]], ref[1]) for ref in refs
        }
        watched = {id(stand_ins[_slot(ref)]): ref for ref in refs}
        with _installed({ref: stand_ins[_slot(ref)] for ref in refs}):
            for module in _post_order(model):
                owner = self._init_owner.get(id(module))
                if owner is None:
                    continue
                recorder = _Touches(watched)
                try:
                    with torch.random.fork_rng(devices=[]), torch.no_grad(), recorder:
                        cast(Callable[[nn.Module], None], owner._init_weights)(module)
                except Exception as e:
                    name = self._names.get(id(module), type(module).__name__)
                    raise RuntimeError(
                        f"delayed init could not run {type(owner).__name__}._init_weights on "
                        f"module {name!r} ({type(module).__name__}) with meta-device stand-ins "
                        f"for its tensors ({type(e).__name__}: {e}), which it does to find the "
                        "tensors each call writes (Note [Rules a parent applies to its "
                        "children]). Pass DelayedParamIniter(model, init_method_using_config="
                        "fn) with an fn that initializes each module's own tensors."
                    ) from e
                self._touched[id(module)] = recorder.touched
                for slot in recorder.touched:
                    self._stand_ins[slot] = stand_ins[slot]
                    if slot[0] != id(module):
                        self._writers.setdefault(slot, []).append(module)

    def _run_init_calls(self, module: nn.Module, shadowed: list[_Slot]) -> list[nn.Module]:
        """Runs the init calls that decide ``module``'s shadowed tensors, in Hugging Face's order.

        ``module``'s shadows are in place; every other tensor a call touches is a meta
        stand-in during that call (Note [Rules a parent applies to its children]).

        Returns:
            The modules whose calls ran besides ``module``'s own.
        """
        calls = {id(module): module}
        for slot in shadowed:
            calls.update({id(m): m for m in self._writers.get(slot, ())})
        mine = set(shadowed)
        for caller in sorted(calls.values(), key=lambda m: self._order.get(id(m), -1)):
            owner = cast(nn.Module, self._init_owner[id(caller)])
            touched = self._touched.get(id(caller), {})
            stand_ins = {ref: self._stand_ins[s] for s, ref in touched.items() if s not in mine}
            with _installed(stand_ins):
                cast(Callable[[nn.Module], None], owner._init_weights)(caller)
        return [m for m in calls.values() if m is not module]

    def count_num_params(self, module: nn.Module, *args: object) -> int:
        """Number of elements in ``module``'s own parameters (each tied tensor once).

        Args:
            module: The module to count.
            *args: Ignored (kept for SMP's signature).
        """
        return sum(p.numel() for p in self._unique_params(module, recurse=False))

    def _std(self, owner: nn.Module | None) -> float:
        config = getattr(owner if owner is not None else self.model, "config", None)
        return float(getattr(config, "initializer_range", None) or _DEFAULT_STD)

    # ------------------------------------------------------------- public API
    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """The ``param_init_fn`` for FSDP1: materializes and initializes a module's own tensors."""
        return lambda module: self._init_module(module, force=False, snapshot=None)

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """A function that re-ties weights (``module.tie_weights()``) once init is done."""

        def post_param_init_fn(module: nn.Module) -> None:
            tie = getattr(module, "tie_weights", None)
            if callable(tie):
                tie()

        return post_param_init_fn

    def init_model(self) -> nn.Module:
        """Materializes and initializes the whole model in place (FSDP2 and TP path).

        Call it after ``tsm.transform`` and ``fully_shard``: parameters are then DTensors on
        the meta device and each rank allocates and fills only its local shards. Every
        parameter is (re)initialized; load pretrained weights afterwards if you have them.

        Returns:
            The model.
        """
        # Buffers that hold real values now (init_empty_weights keeps buffers on CPU) would
        # become garbage in to_empty; keep a copy (Note [Buffers after delayed init]).
        snapshot = {
            (id(m), n): b.detach().clone()
            for m in self.model.modules()
            for n, b in nn_compat.own_buffers(m).items()
            if b is not None and not b.is_meta
        }
        self.model.to_empty(device=self.device)
        for module in self.model.modules():
            self._init_module(module, force=True, snapshot=snapshot)
        self.get_post_param_init_fn()(self.model)
        return self.model

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """Checks, on exit, that every parameter was initialized and nothing is left on meta.

        Wrap the FSDP constructor (or ``init_model``) in it.

        Args:
            enabled: ``False`` turns the check off.

        Raises:
            AssertionError: Naming the tensors still on the meta device, or the counts of
                initialized and total parameters when they differ.
        """
        yield
        if not enabled:
            return
        on_meta = [
            n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta
        ]
        if on_meta:
            raise AssertionError(
                f"delayed init left {len(on_meta)} tensors on the meta device: {on_meta[:10]}. "
                "Pass initer.get_param_init_fn() to FSDP (or call initer.init_model())."
            )
        if self._inited_numel != self._total_numel:
            raise AssertionError(
                f"delayed init initialized {self._inited_numel} parameter elements of "
                f"{self._total_numel}; some modules were never given to the init function."
            )

    # -------------------------------------------------------------- internals
    def _init_module(
        self,
        module: nn.Module,
        *,
        force: bool,
        snapshot: dict[tuple[int, str], torch.Tensor] | None,
    ) -> None:
        """Initializes ``module``'s own parameters and buffers once (see the module notes)."""
        if id(module) in self._done_modules:
            return
        self._done_modules.add(id(module))
        # Tied parameters: initialized through their canonical owner, then shared.
        params = nn_compat.own_parameters(module)
        for name, p in list(params.items()):
            if p is None:
                continue
            owner = self._canonical_owner.get(id(p), module)
            if owner is not module:
                self._init_module(owner, force=force, snapshot=snapshot)
                params[name] = self._materialized.get(id(p), p)
        pending = [
            n
            for n, p in params.items()
            if p is not None and id(p) not in self._inited_params and (force or p.is_meta)
        ]
        meta_ids = {n: id(p) for n, p in params.items() if p is not None and p.is_meta}
        name = self._names.get(id(module), type(module).__name__)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_module_seed(self.seed, name))
            if self.init_method_using_config is not None:
                self.init_method_using_config(module)
            else:
                self._default_init(module, name, pending, force, snapshot)
        params = nn_compat.own_parameters(module)  # as the init left them
        for n, old_id in meta_ids.items():
            self._materialized[old_id] = cast(nn.Parameter, params[n])  # not None
        for n in pending:
            p = cast(nn.Parameter, params[n])  # pending names only non-None ones
            if id(p) not in self._inited_params:
                self._inited_params.add(id(p))
                self._inited_numel += p.numel()
        if self.verbose and pending:
            log_rank0(f"delayed init: {name} ({type(module).__name__}) {pending}")

    def _default_init(
        self,
        module: nn.Module,
        name: str,
        pending: list[str],
        force: bool,
        snapshot: dict[tuple[int, str], torch.Tensor] | None,
    ) -> None:
        empty_module_params(module, self.device)
        buffers = [
            n
            for n, b in nn_compat.own_buffers(module).items()
            if b is not None and (force or b.is_meta)
        ]
        move_buffers_to_device(module, self.device)
        if not pending and not buffers:
            return
        real: dict[str, dict[str, Any]] = {  # tensors only: both lists skip None entries
            "parameter": {n: nn_compat.own_parameters(module)[n] for n in pending},
            "buffer": {n: nn_compat.own_buffers(module)[n] for n in buffers},
        }
        shadows: dict[str, dict[str, torch.Tensor]] = {"parameter": {}, "buffer": {}}
        checked: list[tuple[str, torch.Tensor]] = []
        # Integer and bool tensors have no NaN to tell "never written": their writes are
        # counted instead (a causal mask made on the meta device must be made again).
        counted: list[tuple[str, torch.Tensor, int]] = []
        for kind, tensors in real.items():
            for n, t in tensors.items():
                saved = snapshot.get((id(module), n)) if snapshot and kind == "buffer" else None
                if saved is not None:
                    shadow = saved.clone()
                else:
                    shadow = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    if shadow.is_floating_point() or shadow.is_complex():
                        shadow.fill_(float("nan"))
                        checked.append((f"{kind} {n}", shadow))
                    else:
                        shadow.zero_()
                        if kind == "buffer":
                            counted.append(
                                (f"buffer {n}", shadow, tensor_compat.write_count(shadow))
                            )
                if kind == "parameter":
                    shadow = nn.Parameter(shadow, requires_grad=False)
                shadows[kind][n] = shadow
        owner = self._init_owner.get(id(module))
        parents: list[nn.Module] = []
        try:
            for kind in shadows:
                _OWN_TENSORS[kind](module).update(shadows[kind])
            with torch.no_grad():
                if owner is not None:
                    shadowed = [(id(module), kind, n) for kind in shadows for n in shadows[kind]]
                    parents = self._run_init_calls(module, shadowed)
                else:
                    _generic_init(module, self._std(None))
        finally:
            for kind in real:
                _OWN_TENSORS[kind](module).update(real[kind])
        if self.verbose and parents:
            log_rank0(
                f"delayed init: {name} also by the init calls of "
                f"{[self._names.get(id(m), type(m).__name__) for m in parents]}"
            )
        bad = [what for what, s in checked if torch.isnan(s).any()]
        bad += [what for what, s, v in counted if tensor_compat.write_count(s) == v]
        if bad:
            raise RuntimeError(
                f"delayed init of module {name!r} ({type(module).__name__}) left {bad} "
                "uninitialized: the model's _init_weights does not set them. Pass "
                "DelayedParamIniter(model, init_method_using_config=fn) with an fn that fills them."
            )
        with torch.no_grad():
            for kind in real:
                for n, t in real[kind].items():
                    t.copy_(_local_piece(shadows[kind][n].detach(), t))


__all__ = ["DelayedParamIniter"]
