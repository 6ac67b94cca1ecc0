"""docs/architecture.md names real files and functions, so it cannot go stale silently.

Every inline code span of the page that is a repository path (``torch_sagemaker/...``,
``csrc/...``, or a root file such as ``setup.py``), optionally followed by ``:name`` or
``:Class.method``, must exist: the file, and the name as a ``def``/``class`` in a Python file
or as a function or class in a C++ file. Relative Markdown links must point at files.
Fenced blocks are left out of that check; the layer diagram (section 2's first fenced block)
is checked against the import graph instead, and the patch table (section 3) against the
patches the source installs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.test_import_graph import import_graph

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_SPAN = re.compile(r"`([^`\n]+)`")
_REF = re.compile(
    r"^(?P<path>(?:torch_sagemaker|csrc|smdistributed|tests|docs|examples)/[\w./-]+"
    r"|[\w.-]+\.(?:py|pth|md|cpp|h))(?::(?P<name>[\w.]+))?$"
)
_SECTION = re.compile(r"\bsections? (\d+)\b")
_LINK = re.compile(r"\]\((?!https?:|#)([^)\s#]+)")


def references(text: str) -> list[tuple[str, str | None]]:
    """(path, name or None) for every code span of ``text`` (outside fences) that is a path."""
    found = []
    for span in _SPAN.findall(_FENCE.sub("", text)):
        m = _REF.match(span.strip())
        if m:
            found.append((m.group("path"), m.group("name")))
    return found


def _python_defines(path: Path, qualname: str) -> bool:
    scope: list[ast.stmt] = ast.parse(path.read_text(), str(path)).body
    for part in qualname.split("."):
        match = [
            n
            for n in scope
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name == part
        ]
        if not match:
            return False
        scope = match[0].body
    return True


def _cpp_defines(path: Path, qualname: str) -> bool:
    text = path.read_text()
    name = re.escape(qualname.split(".")[-1])
    return bool(
        re.search(rf"(?:\bclass|\bstruct)\s+{name}\b", text)
        or re.search(rf"(?:::|\b){name}\s*\(", text)
    )


def problems(text: str, root: Path) -> list[str]:
    """What in ``text`` names a path or a name that does not exist under ``root``."""
    found = []
    for rel, name in references(text):
        path = root / rel
        if not path.exists():
            found.append(f"{rel}: no such file or directory")
        elif name is not None:
            defines = _python_defines if path.suffix == ".py" else _cpp_defines
            if not path.is_file() or not defines(path, name):
                found.append(f"{rel}:{name}: {name} is not defined in {rel}")
    for target in _LINK.findall(_FENCE.sub("", text)):
        if not (root / "docs" / target).exists():
            found.append(f"link ({target}): no such file next to docs/architecture.md")
    sections = set(re.findall(r"^## (\d+)\. ", text, re.MULTILINE))
    for number in sorted(set(_SECTION.findall(text)) - sections):
        found.append(f"section {number}: the page has no such section")
    return found


def test_every_named_file_and_function_exists():
    text = PAGE.read_text()
    refs = references(text)
    # The page is built on these references; a parsing regression must not pass as "nothing to
    # check".
    assert len({p for p, _ in refs}) >= 40, refs
    assert sum(1 for _, n in refs if n) >= 40, refs
    assert problems(text, ROOT) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("`torch_sagemaker/no_such_module.py`", "torch_sagemaker/no_such_module.py: no such file"),
        ("`torch_sagemaker/_init.py:no_such_function`", "no_such_function is not defined"),
        ("`torch_sagemaker/state.py:State.no_such_method`", "State.no_such_method is not defined"),
        (
            "`csrc/smddp/algorithms/comm_algos.cpp:no_such_algorithm`",
            "no_such_algorithm is not defined",
        ),
        ("[gone](no_such_page.md)", "link (no_such_page.md)"),
        ("## 1. One\n(section 4)", "section 4: the page has no such section"),
    ],
)
def test_checker_reports_a_stale_reference(text, expected):
    found = problems(text, ROOT)
    assert len(found) == 1 and expected in found[0], found


def test_checker_accepts_real_references_and_skips_fences():
    text = (
        "`torch_sagemaker/state.py:State.reset` "
        "`csrc/smddp/algorithms/comm_algos.cpp:hier_allgather` "
        "`_torch_sagemaker_alias.py:install`\n```\n`torch_sagemaker/gone.py`\n```\n"
    )
    assert len(references(text)) == 3
    assert problems(text, ROOT) == []


# ------------------------------------------------------------------ the patch table (section 3)
# What counts as a change to an object the library does not own, found in the source with
# ``ast``: (what the statement does, the word the table row must then contain). A row covers
# a site when its "where" cell names the site's file and outermost function.
_CALLS = {
    "atexit.register": "exit handler",
    "torch.cuda.set_device": "set_device",
    "dist.Backend.register_backend": "registered",
    "sys.meta_path.insert": "meta_path",
    "dist.init_process_group": "default process group",
    "init_device_mesh": "DeviceMesh",
    "c10d_compat.new_process_group_helper": "gloo",
    "AttentionInterface.register": "AttentionInterface",
}


def _imported_names(tree: ast.Module) -> set[str]:
    """Names bound at module level to imported objects (``_mod = compat.TORCH_MODULE`` too)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in names:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def patch_sites(root: Path) -> list[tuple[str, str, str]]:
    """(file, outermost function, required word) of every patch the source installs.

    Assignments to an attribute of an imported class or module (``Foo.__init__ = ...``,
    ``torch_module.name = ...``) and the calls in ``_CALLS``; ``uninstall`` functions
    (which restore) are left out. ``benchmarks/`` and ``tools/`` are not the library (and are
    not installed), so they are not scanned.
    """
    sites = []
    files = [root / "_torch_sagemaker_alias.py", *sorted((root / "torch_sagemaker").rglob("*.py"))]
    for path in files:
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), rel)
        imported = _imported_names(tree)
        for top in tree.body:
            if not isinstance(top, (ast.FunctionDef, ast.ClassDef)) or top.name == "uninstall":
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        base = target
                        while isinstance(base, ast.Attribute):
                            base = base.value
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(base, ast.Name)
                            and base.id in imported
                        ):
                            word = target.attr
                            if word == "__init__" and isinstance(target.value, ast.Attribute):
                                word = f"{target.value.attr}.__init__"
                            elif word == "__init__":
                                word = f"{ast.unparse(target.value)}.__init__"
                            sites.append((rel, top.name, word))
                elif isinstance(node, ast.Call) and ast.unparse(node.func) in _CALLS:
                    sites.append((rel, top.name, _CALLS[ast.unparse(node.func)]))
                elif (
                    isinstance(node, ast.Call)
                    and ast.unparse(node.func) == "setattr"
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in imported
                ):
                    sites.append((rel, top.name, node.args[0].id))
    return sites


def patch_rows(text: str) -> list[str]:
    """The rows of section 3's first table (changes to objects the library does not own)."""
    section = text.split("## 3.", 1)[1].split("Changes to the user's own objects", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]


def missing_patches(text: str, root: Path) -> list[str]:
    """The patch sites no row of the table names (file:function) together with their word."""
    rows = patch_rows(text)
    missing = []
    for rel, function, word in patch_sites(root):
        where = f"`{rel}:{function}`"
        if not any(where in row.split(" | ")[1] and word in row for row in rows):
            missing.append(f"{rel}:{function} ({word})")
    return sorted(set(missing))


def test_patch_table_lists_every_patch_installed():
    sites = patch_sites(ROOT)
    # The scan must keep finding the known patches (a regression must not pass as "none").
    assert len(sites) >= 12, sites
    assert any(word == "FullyShardedDataParallel.__init__" for _, _, word in sites), sites
    assert missing_patches(PAGE.read_text(), ROOT) == []


def test_patch_table_check_reports_a_missing_row():
    text = PAGE.read_text()
    rows = [row for row in patch_rows(text) if "set_device" in row]
    assert len(rows) == 1
    assert missing_patches(text.replace(rows[0], ""), ROOT) == [
        "torch_sagemaker/_init.py:_set_cuda_device (set_device)"
    ]


# ------------------------------------------------------------------ the layer diagram (section 2)
# Imported from every layer, and so left out of the diagram (the page says so).
_EVERYWHERE = {"logger", "_version", "_torch_compat"}


def _part_name(text: str) -> str:
    """``sharding/`` -> ``sharding``, ``state.py`` -> ``state``, ``a/b/`` -> ``a.b``."""
    text = text.strip()
    if text == "torch_sagemaker/__init__.py":
        return "__init__"
    return text.removesuffix(".py").rstrip("/").replace("/", ".")


def diagram(text: str) -> list[tuple[str, set[str]]]:
    """(part, the parts it imports) for each line of section 2's first fenced block."""
    section = text.split("## 2. Layers", 1)[1]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if not line.strip():
            continue
        left, _, right = line.partition("->")
        targets = re.split(r"\s{2,}|;", right.strip(), maxsplit=1)[0]
        lines.append((_part_name(left), {t.strip() for t in targets.split(",") if t.strip()}))
    return lines


def part_edges() -> dict[str, set[str]]:
    """Part -> parts it imports at module level (``tests/unit/test_import_graph.py``'s graph)."""

    def part(module: str) -> str:
        names = module.split(".")[1:]
        return names[0] if names else "__init__"

    edges: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        edges.setdefault(part(module), set())
        for target in targets:
            if part(target) != part(module):
                edges[part(module)].add(part(target))
    return edges


def diagram_problems(lines: list[tuple[str, set[str]]], edges: dict[str, set[str]]) -> list[str]:
    """Where the diagram and the import graph disagree."""
    found = []
    order = {part: i for i, (part, _) in enumerate(lines)}
    for part in sorted(set(edges) - _EVERYWHERE - set(order)):
        found.append(f"{part}: not in the diagram")
    for part, listed in lines:
        actual = edges.get(part, set()) - _EVERYWHERE
        for target in sorted(actual - listed):
            found.append(f"{part} -> {target}: imported but not in the diagram")
        for target in sorted(listed - actual):
            found.append(f"{part} -> {target}: in the diagram but not imported")
        for target in sorted(actual & set(order)):
            if order[target] <= order[part]:
                found.append(f"{part} -> {target}: goes up the diagram")
    return found


def test_layer_diagram_matches_the_import_graph():
    lines = diagram(PAGE.read_text())
    assert len(lines) >= 15 and lines[0][0] == "__init__", lines
    assert diagram_problems(lines, part_edges()) == []


def test_layer_diagram_check_reports_each_kind_of_problem():
    lines = [("a", {"b"}), ("b", set()), ("c", {"a"})]
    edges = {"a": {"b", "c", "logger"}, "b": set(), "c": set(), "d": {"a"}}
    assert diagram_problems(lines, edges) == [
        "d: not in the diagram",
        "a -> c: imported but not in the diagram",
        "c -> a: in the diagram but not imported",
    ]
    assert diagram_problems([("a", set()), ("b", {"a"})], {"b": {"a"}}) == [
        "b -> a: goes up the diagram"
    ]
