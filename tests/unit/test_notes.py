"""Every ``Note [Name]`` the code and docs point to is written somewhere.

Long reasoning lives in named Notes (CONTRIBUTING): a comment or doc says "Note [Two workers,
one of them for ranks]" and the Note itself starts a comment block of its own, ``# Note
[Name]`` or ``// Note [Name]`` (alone on its line or followed by ``:``), or a docstring's
first line. A Note renamed or deleted leaves its readers pointing nowhere; this test names
them. A reference may be cut short with ``...`` (``Note [Tensors are released in ...]``):
it must then be the start of exactly one Note's name.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".py", ".pyi", ".cpp", ".h", ".md", ".sh")
# A Note's own first line: a comment marker (or a docstring's quotes), the name, then nothing
# or a colon.
DEFINITION = re.compile(r'^\s*(?:#+|//+|/\*+|\*|"""|-)?\s*Note \[([^\]]+)\](?::.*)?\s*$')
REFERENCE = re.compile(r"Note \[([^\]]+)\]")
# A line break inside a comment, with the next line's comment marker (``#``, ``#:``, ``//``,
# ``*``), or between two string literals Python joins: names wrap across them.
WRAP = re.compile(r'"?\s*\n\s*(?:#+:?|//+|\*|f?")?\s*')


def tracked_files() -> list[Path]:
    """The repository's source and documentation files that git tracks."""
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    this = Path(__file__).resolve()  # its own samples name Notes that do not exist
    paths = [
        ROOT / name
        for name in out.splitlines()
        if name.endswith(SUFFIXES) or Path(name).name == "Makefile"
    ]
    return [p for p in paths if p.resolve() != this]


def definitions(text: str) -> list[str]:
    """The names of the Notes a file writes."""
    return [m.group(1) for line in text.splitlines() if (m := DEFINITION.match(line))]


def references(text: str) -> list[str]:
    """The names a file points to, a name wrapped over comment lines joined again."""
    return [" ".join(m.group(1).split()) for m in REFERENCE.finditer(WRAP.sub(" ", text))]


def unresolved(names: set[str], refs: dict[str, list[str]]) -> list[str]:
    """References to no Note, each with where it stands."""
    problems = []
    for name, places in sorted(refs.items()):
        if name in names:
            continue
        if name.endswith("..."):
            prefix = name[:-3].rstrip()
            if sum(n.startswith(prefix) for n in names) == 1:
                continue
        problems.append(f"Note [{name}] at {', '.join(places[:3])}")
    return problems


def test_definitions_references_and_abbreviations():
    text = (
        "# Note [Two workers]: why.\n"
        "// Note [A C++ note]\n"
        "x = 1  # see Note [Two workers] and Note [Gone]\n"
        "# (Note [A C++\n"
        "#: note]) wraps; Note [A C++ ...] is cut short\n"
        'msg = ("see Note [Two "\n'
        '       "workers]")\n'
    )
    assert definitions(text) == ["Two workers", "A C++ note"]
    refs = {name: ["f:1"] for name in references(text)}
    assert set(refs) == {"Two workers", "A C++ note", "Gone", "A C++ ..."}
    assert unresolved({"Two workers", "A C++ note"}, refs) == ["Note [Gone] at f:1"]


def test_every_note_referenced_is_written():
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout: the files it reads are the ones git tracks")
    names: set[str] = set()
    refs: dict[str, list[str]] = defaultdict(list)
    for path in tracked_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        names.update(definitions(text))
        for name in references(text):
            refs[name].append(str(path.relative_to(ROOT)))
    assert len(names) > 100, len(names)  # the parser still finds the Notes
    assert unresolved(names, refs) == []
