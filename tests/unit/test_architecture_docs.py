"""docs/architecture.md names real files and functions, so it cannot go stale silently.

Every inline code span of the page that is a repository path (``torch_sagemaker/...``,
``csrc/...``, or a root file such as ``setup.py``), optionally followed by ``:name`` or
``:Class.method``, must exist: the file, and the name as a ``def``/``class`` in a Python file
or as a function or class in a C++ file. Relative Markdown links must point at files.
Fenced blocks (the layer diagram) are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_SPAN = re.compile(r"`([^`\n]+)`")
_REF = re.compile(
    r"^(?P<path>(?:torch_sagemaker|csrc|smdistributed|tests|docs|examples)/[\w./-]+"
    r"|[\w.-]+\.(?:py|pth|md|cpp|h))(?::(?P<name>[\w.]+))?$"
)
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
