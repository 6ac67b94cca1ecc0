"""docs/config.md against the code: every setting it names exists, and every setting exists in it.

The page's tables are parsed (first column: a name in backticks) and compared with what the
code accepts, in both directions:

- the ``tsm.init`` keys with ``SMPConfig`` (names, types, defaults), the ``tsm.state``
  aliases with the ones ``tsm.state`` accepts;
- the ``tsm.transform`` arguments with its signature (names, defaults);
- the ``MoEConfig`` fields with the dataclass (names, types, defaults);
- the environment variables with the reads found in the package's source (``os.environ``
  lookups, ``in os.environ`` tests, ``os.getenv``), module by module;
- every quoted error is produced by the code for the input in the same row.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
from pathlib import Path

import pytest

import torch_sagemaker
from torch_sagemaker import _transform, config
from torch_sagemaker.moe.moe_config import MoEConfig

# The module, not the ``tsm.state`` object the package exports under the same name.
state_module = importlib.import_module("torch_sagemaker.state")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"
PACKAGE = ROOT / "torch_sagemaker"


# ----------------------------------------------------------------------------- the page


def _cells(line: str) -> list[str]:
    """The cells of one table row; a ``|`` inside a code span does not split."""
    cells, current, in_code = [], "", False
    for ch in line.strip()[1:-1]:
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += ch
    cells.append(current.strip())
    return cells


def _tables_by_heading(text: str) -> dict[str, list[list[dict[str, str]]]]:
    """Heading text -> the tables under it (before the next heading), each a list of rows."""
    sections: dict[str, list[list[dict[str, str]]]] = {}
    heading, header, rows = None, None, None
    for line in [*text.splitlines(), ""]:
        is_row = line.startswith("|") and line.rstrip().endswith("|")
        if rows is not None and not is_row:
            sections.setdefault(heading, []).append(rows)
            header, rows = None, None
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif is_row and header is None:
            header = _cells(line)
        elif is_row and rows is None:
            assert set(line.replace("|", "").strip()) <= set("-: "), (
                f"no separator row after {header}"
            )
            rows = []
        elif is_row:
            cells = _cells(line)
            assert len(cells) == len(header), f"row {cells} has {len(cells)} cells, header {header}"
            rows.append(dict(zip(header, cells)))
    return sections


SECTIONS = _tables_by_heading(DOC.read_text(encoding="utf-8"))


def table(heading: str, index: int = 0) -> list[dict[str, str]]:
    tables = SECTIONS.get(heading, [])
    assert len(tables) > index, (
        f"docs/config.md has no table #{index + 1} under the heading {heading!r}"
    )
    return tables[index]


def code(cell: str) -> str:
    """The text of a cell that is one code span."""
    assert len(cell) > 2 and cell[0] == cell[-1] == "`" and "`" not in cell[1:-1], (
        f"expected one `code span` in the cell, got {cell!r}"
    )
    return cell[1:-1]


def names(rows: list[dict[str, str]], column: str) -> list[str]:
    return [code(row[column]) for row in rows]


def same(a, b) -> bool:
    """Equal and of the same type (``True == 1`` but a bool default is not an int one)."""
    return type(a) is type(b) and a == b


def assert_same_names(documented: list[str], in_code, what: str) -> None:
    assert len(documented) == len(set(documented)), f"{what}: documented twice: {documented}"
    missing, extra = set(in_code) - set(documented), set(documented) - set(in_code)
    assert not missing, f"{what} in the code but not in docs/config.md: {sorted(missing)}"
    assert not extra, f"{what} in docs/config.md but not in the code: {sorted(extra)}"


# ------------------------------------------------------------------------- tsm.init


INIT_KEYS = table("`tsm.init` parameters")


def test_init_keys_are_the_config_keys():
    assert_same_names(names(INIT_KEYS, "key"), config.FIELD_NAMES, "tsm.init keys")


@pytest.mark.parametrize("row", INIT_KEYS, ids=lambda r: r["key"].strip("`"))
def test_init_key_type_and_default(row):
    key = code(row["key"])
    if key not in config.FIELD_TYPES:
        pytest.fail(f"{key} is not a config key")  # reported in full by the test above
    assert row["type"] == config.FIELD_TYPES[key].__name__
    default = json.loads(code(row["default"]))  # JSON, as users write config files
    assert same(default, getattr(config.SMPConfig(), key)), (
        f"{key}: docs say {default!r}, SMPConfig says {getattr(config.SMPConfig(), key)!r}"
    )


def test_state_aliases():
    rows = table("Assignments on `tsm.state` before `tsm.init`")
    assert_same_names(names(rows, "name"), state_module._ALIASES, "tsm.state aliases")
    assert {code(r["name"]): code(r["stands for"]) for r in rows} == state_module._ALIASES


@pytest.mark.parametrize("row", table("Errors"), ids=lambda r: r["problem"][1:40])
def test_init_error_examples(row):
    text, source, world = code(row["input"]), row["source"], row["world_size"]
    world_size = None if world == "-" else int(world)
    with pytest.raises(config.ConfigError) as info:
        if source == "dict":
            config.validate(config.load_raw(json.loads(text), environ={}), world_size)
        else:
            assert source == config.ENV_VAR, f"unknown source column {source!r}"
            config.validate(config.load_raw(None, environ={config.ENV_VAR: text}), world_size)
    assert code(row["problem"]) in info.value.problems


# -------------------------------------------------------------------- tsm.transform


def _parameters(fn) -> dict[str, inspect.Parameter] | None:
    """Parameters after ``model``, or None for a ``(*args, **kwargs)`` forwarder."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return {p.name: p for p in params}


def test_transform_arguments():
    rows = table("`tsm.transform` arguments")
    for fn in (_transform.transform, torch_sagemaker.transform):
        params = _parameters(fn)
        if params is None:  # the public forwarder; the implementation was checked
            continue
        assert_same_names(names(rows, "argument"), params, f"{fn.__module__}.transform arguments")
        for row in rows:
            name = code(row["argument"])
            default = ast.literal_eval(code(row["default"]))
            assert same(default, params[name].default), (
                f"transform({name}=...): docs say {default!r}, the code {params[name].default!r}"
            )


# --------------------------------------------------------------------------- MoEConfig


def test_moe_config_fields():
    rows = table("`MoEConfig` fields")
    fields = {f.name: f for f in dataclasses.fields(MoEConfig)}
    assert_same_names(names(rows, "field"), fields, "MoEConfig fields")
    for row in rows:
        f = fields[code(row["field"])]
        assert row["type"] == f.type, f"{f.name}: docs say {row['type']}, the dataclass {f.type}"
        assert same(ast.literal_eval(code(row["default"])), f.default), f"{f.name} default"


@pytest.mark.parametrize("row", table("`MoEConfig` fields", 1), ids=lambda r: r["fields"])
def test_moe_config_error_examples(row):
    with pytest.raises(ValueError) as info:
        MoEConfig(**json.loads(code(row["fields"])))
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid MoEConfig:" and f"  {code(row['problem'])}" in lines[1:]


# ------------------------------------------------------------------ environment variables


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, or a mapping named ``environ`` (``config.load_raw`` takes one)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv") or (
        isinstance(node, ast.Name) and node.id == "getenv"
    )


def _read_keys(tree: ast.AST):
    """The key expressions of every environment read (writes are not reads)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if _is_getenv(func) or (
                isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)
            ):
                yield node.args[0]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and _is_environ(node.value)
        ):
            yield node.slice
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if isinstance(op, (ast.In, ast.NotIn)) and _is_environ(operands[i + 1]):
                    yield operands[i]


def _constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = "X"`` and ``NAME = ("X", "Y")`` constants."""
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        elif isinstance(stmt, ast.AnnAssign):
            target = stmt.target
        else:
            continue
        if isinstance(target, ast.Name) and stmt.value is not None:
            values = _strings(stmt.value)
            if values is not None:
                out[target.id] = values
    return out


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]
    return None


def _resolve(key: ast.AST, parents: dict, constants: dict[str, list[str]]) -> list[str] | None:
    """The variable names a key expression stands for: a string, a module constant, or the
    loop variable of an enclosing ``for``/comprehension over one."""
    values = _strings(key)
    if values is not None or not isinstance(key, ast.Name):
        return values
    node = key
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loops = node.generators
        elif isinstance(node, ast.For):
            loops = [node]
        else:
            continue
        for loop in loops:
            if isinstance(loop.target, ast.Name) and loop.target.id == key.id:
                return _resolve(loop.iter, parents, constants)
    return constants.get(key.id)


def environment_reads(
    source: str, path: str, reads: dict[str, set[str]], unresolved: list[str]
) -> None:
    """Adds the variables ``source`` reads to ``reads`` (name -> paths) or ``unresolved``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    constants = _constants(tree)
    for key in _read_keys(tree):
        values = _resolve(key, parents, constants)
        if values is None:
            unresolved.append(f"{path}:{key.lineno}")
        for name in values or ():
            reads.setdefault(name, set()).add(path)


def package_environment_reads() -> tuple[dict[str, set[str]], list[str]]:
    """What the library reads, and the benchmarks and lab tools of the checkout (the page
    documents theirs too)."""
    reads: dict[str, set[str]] = {}
    unresolved: list[str] = []
    files = [f for d in (PACKAGE, ROOT / "benchmarks", ROOT / "tools") for f in d.rglob("*.py")]
    for file in sorted(files):
        path = file.relative_to(ROOT).as_posix()
        environment_reads(file.read_text(encoding="utf-8"), path, reads, unresolved)
    return reads, unresolved


def test_environment_scan_finds_every_kind_of_read():
    source = """
import os
from os import environ, getenv
NAME = "A"
PAIR = ("B", "C")
os.environ.get(NAME)
os.environ["D"]
missing = [v for v in PAIR if v not in os.environ]
"E" in environ
getenv("F")
os.getenv("G", "x")
for w in ("H",):
    environ.get(w)
os.environ["NOT_A_READ"] = "1"
os.environ.update(ALSO_NOT="1")
os.environ.get(f"SMDDP_{NAME}")
"""
    reads, unresolved = {}, []
    environment_reads(source, "m.py", reads, unresolved)
    assert sorted(reads) == ["A", "B", "C", "D", "E", "F", "G", "H"]
    assert unresolved == ["m.py:16"]


def test_environment_variables_are_the_ones_read():
    reads, unresolved = package_environment_reads()
    assert not unresolved, (
        f"environment reads whose variable cannot be named statically: {unresolved}; "
        "read a string literal or a module-level constant so that the docs "
        "can be checked"
    )
    rows = table("Environment variables")
    assert_same_names(
        names(rows, "variable"), reads, "environment variables read by torch_sagemaker"
    )
    documented = {
        code(r["variable"]): {code(c.strip()) for c in r["read by"].split(",")} for r in rows
    }
    assert documented == reads, (
        "the 'read by' column differs from the modules that read each variable"
    )
