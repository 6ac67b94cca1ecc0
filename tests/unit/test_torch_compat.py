"""The private PyTorch names the package uses all go through ``torch_sagemaker/_torch_compat``.

1. Every entry of ``PRIVATE_NAMES`` exists on the installed torch (one failure lists all the
   missing ones), so a torch release that drops or renames one fails here, not in a training
   run.
2. No module outside the layer reaches a private torch name itself: read with ``ast``, without
   importing anything. Flagged are imports of a torch module with a private component
   (``torch.distributed.fsdp._common_utils``, ``torch._C``), ``from torch... import _name``,
   and ``X._name`` (or ``getattr(X, "_name")``) where ``X`` is bound by an import from torch or
   by a plain assignment of such a name (``c10d = dist.distributed_c10d``). Attributes of
   objects the analysis cannot trace to torch (``unit._handle`` on a function argument) are
   beyond it; the layer's docstring asks for them all the same.
3. Every private name the layer's own modules use is listed in ``PRIVATE_NAMES``.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torch_sagemaker._torch_compat import PRIVATE_NAMES, STATEFUL_NAMES

PACKAGE = Path(__file__).resolve().parents[2] / "torch_sagemaker"
LAYER = PACKAGE / "_torch_compat"
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --- 1. the registry resolves on this torch --------------------------------------------------


def _import_prefix(parts: list[str]) -> tuple[object, int]:
    """The longest importable prefix of ``parts`` as a module, and how many parts it took."""
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), i
        except ImportError:
            continue
    raise LookupError(f"no module in {'.'.join(parts)!r}")


def _instances() -> Iterator[object]:
    """Objects of the classes whose private attributes PyTorch sets per instance.

    An FSDP1 unit (with its handle and flat parameter) on a one-rank gloo group, an activation
    checkpoint wrapper and a plain module. Built on first use, then kept.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    linear = nn.Linear(2, 2)
    yield linear
    yield CheckpointWrapper(nn.Linear(2, 2))
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        unit = FullyShardedDataParallel(
            nn.Sequential(nn.Linear(2, 2)),
            sharding_strategy=ShardingStrategy.NO_SHARD,  # what one rank gets anyway
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        handle = unit._handle
        yield unit
        yield handle
        if handle is not None:
            yield handle.flat_param
    finally:
        if owned:
            dist.destroy_process_group()


class _Samples:
    def __init__(self) -> None:
        self._built: list[object] | None = None

    def has(self, cls: type, attr: str) -> bool:
        if self._built is None:
            self._built = list(_instances())
        return any(isinstance(obj, cls) and hasattr(obj, attr) for obj in self._built)


def _resolves(name: str, samples: _Samples) -> bool:
    parts = name.split(".")
    try:
        obj, taken = _import_prefix(parts)
    except LookupError:
        return False
    rest = parts[taken:]
    for i, attr in enumerate(rest):
        missing = object()
        value = getattr(obj, attr, missing)
        if value is missing:
            # Set per instance (in __init__): look on an instance of the class.
            return i == len(rest) - 1 and isinstance(obj, type) and samples.has(obj, attr)
        obj = value
    return True


def test_every_private_name_exists_on_this_torch():
    samples = _Samples()
    missing = [name for name in PRIVATE_NAMES if not _resolves(name, samples)]
    assert not missing, (
        f"torch {torch.__version__} lacks {len(missing)} private name(s) that "
        "torch_sagemaker/_torch_compat uses; port the layer's module for them:\n  "
        + "\n  ".join(missing)
    )


def test_every_stateful_name_is_still_set_by_its_module():
    import importlib
    import inspect

    missing = [
        f"{module}: .{attr} ="
        for module, attr in STATEFUL_NAMES
        if f".{attr} =" not in inspect.getsource(importlib.import_module(module))
    ]
    assert not missing, (
        f"torch {torch.__version__} no longer sets these attributes where the layer expects; "
        "port the layer's module for them:\n  " + "\n  ".join(missing)
    )


def test_registry_has_no_duplicates():
    assert len(set(PRIVATE_NAMES)) == len(PRIVATE_NAMES)


# --- 2. no private torch name outside the layer ----------------------------------------------


def _is_torch_module(module: str) -> bool:
    # torch.sagemaker is this package under its alias (_torch_sagemaker_alias.py).
    return (module == "torch" or module.startswith("torch.")) and not (
        module == "torch.sagemaker" or module.startswith("torch.sagemaker.")
    )


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain ``a.b.c`` starts from, if it is one."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _torch_names(tree: ast.Module) -> set[str]:
    """Names bound in the module (any scope) to torch objects."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch_module(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and _is_torch_module(node.module or "")
        ):
            names.update(alias.asname or alias.name for alias in node.names)
    changed = True
    while changed:  # plain assignments of torch names: c10d = dist.distributed_c10d
        changed = False
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, (ast.Name, ast.Attribute))
                and _root(node.value) in names
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id not in names:
                        names.add(target.id)
                        changed = True
    return names


def private_torch_uses(source: str, filename: str = "<string>") -> list[str]:
    """Each private torch name ``source`` reaches itself, as ``line: what``."""
    tree = ast.parse(source, filename)
    torch_names = _torch_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch_module(alias.name) and any(
                    _is_private(p) for p in alias.name.split(".")
                ):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if not _is_torch_module(module):
                continue
            names = [alias.name for alias in node.names]
            if not any(_is_private(p) for p in module.split(".")):
                names = [name for name in names if _is_private(name)]
            if names:
                found.append(f"{node.lineno}: from {module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute):
            if _is_private(node.attr) and _root(node.value) in torch_names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ACCESSORS
            and len(node.args) >= 2
            and _root(node.args[0]) in torch_names
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _package_modules() -> list[Path]:
    """The package's modules outside the layer, the benchmarks, and the simulators and peers
    of tools/ (all once in the package; tools/model_coverage/ never was, and is not held)."""
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "benchmarks").rglob("*.py")]
    files += (root / "tools").glob("*.py")
    return sorted(p for p in files if LAYER not in p.parents)


def test_no_private_torch_name_outside_the_layer():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{use}"
        for path in _package_modules()
        for use in private_torch_uses(path.read_text(), str(path))
    ]
    assert not offenders, (
        "private PyTorch names used outside torch_sagemaker/_torch_compat; add an accessor to "
        "the layer's module for that torch area (and the name to PRIVATE_NAMES):\n  "
        + "\n  ".join(offenders)
    )


@pytest.mark.parametrize(
    "source",
    [
        "from torch.distributed.fsdp._common_utils import _FSDPState",
        "import torch.distributed.fsdp._common_utils as cu",
        "from torch.distributed.tensor import _redistribute",
        "import torch.distributed as dist\ndist._make_nccl_premul_sum(0.5)",
        "from torch.distributed.device_mesh import DeviceMesh\nDeviceMesh._concatenate([])",
        "import torch.distributed as dist\nc10d = dist.distributed_c10d\nc10d._world",
        "import torch\ntorch._C._current_graph_task_id()",
        "import torch\ngetattr(torch.cuda, '_sleep')",
    ],
)
def test_the_scan_flags(source):
    assert private_torch_uses(source)


@pytest.mark.parametrize(
    "source",
    [
        "from torch_sagemaker.checkpoint._group import Participants",
        "from torch_sagemaker import state\nstate._set()",
        "import torch.sagemaker as tsm\ntsm.state._groups",
        "from torch_sagemaker._torch_compat import fsdp1 as fsdp1_compat\nfsdp1_compat.handle(u)",
        "import torch\nclass M(torch.nn.Module):\n    def f(self):\n        return self._x",
        "from torch.distributed.fsdp import FullyShardedDataParallel\n"
        "FullyShardedDataParallel.__init__",
    ],
)
def test_the_scan_leaves_alone(source):
    assert not private_torch_uses(source)


# --- 3. the registry lists what the layer uses -----------------------------------------------


def _layer_private_names(tree: ast.Module) -> list[tuple[int, str, str]]:
    """``(line, what, how to find it in PRIVATE_NAMES)`` for each private name a layer module uses.

    ``how`` is ``"entry:<dotted>"`` (an exact entry or the prefix of one) or ``"last:<name>"``
    (some entry ends with that attribute).
    """
    uses: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if not _is_torch_module(module):
                continue
            for alias in node.names:
                dotted = f"{module}.{alias.name}"
                if any(_is_private(p) for p in dotted.split(".")):
                    uses.append((node.lineno, dotted, f"entry:{dotted}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch_module(alias.name) and any(
                    _is_private(p) for p in alias.name.split(".")
                ):
                    uses.append((node.lineno, alias.name, f"entry:{alias.name}"))
        elif isinstance(node, ast.Attribute):
            if _is_private(node.attr) and _root(node.value) not in {"self", "cls"}:
                uses.append((node.lineno, ast.unparse(node), f"last:{node.attr}"))
        elif isinstance(node, ast.keyword):
            if node.arg and _is_private(node.arg):
                uses.append((getattr(node, "lineno", 0), f"{node.arg}=", f"last:{node.arg}"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.isidentifier()
            and _is_private(node.value)
        ):
            uses.append((node.lineno, repr(node.value), f"last:{node.value}"))
    return uses


def test_the_registry_lists_every_private_name_the_layer_uses():
    entries = set(PRIVATE_NAMES)
    lasts = {name.rsplit(".", 1)[-1] for name in PRIVATE_NAMES}
    lasts |= {attr for _, attr in STATEFUL_NAMES}
    unlisted = []
    for path in sorted(LAYER.glob("*.py")):
        for line, what, how in _layer_private_names(ast.parse(path.read_text(), str(path))):
            kind, _, key = how.partition(":")
            listed = (
                key in entries or any(e.startswith(key + ".") for e in entries)
                if kind == "entry"
                else key in lasts
            )
            if not listed:
                unlisted.append(f"{path.name}:{line}: {what}")
    assert not unlisted, "private torch names missing from PRIVATE_NAMES:\n  " + "\n  ".join(
        unlisted
    )
