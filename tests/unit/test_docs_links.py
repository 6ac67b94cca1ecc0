"""Every relative link in the Markdown pages (README, CONTRIBUTING, docs/ and docs/log/) leads
somewhere: its file exists, and its ``#anchor`` is a heading of that page.

Pages move and sections are renamed (docs/cost_model.md came out of docs/multi_node.md); a
link into a section that went elsewhere breaks silently on GitHub. Anchors follow GitHub's
rule: the heading in lower case, punctuation other than ``-`` and ``_`` dropped, spaces
turned into ``-``, and ``-1``, ``-2`` ... appended to repeated headings.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, fenced code blocks left out."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """``page``'s relative links whose file or anchor is missing, each with the reason."""
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest}")
        elif (
            fragment
            and dest.suffix == ".md"
            and fragment not in anchors(dest.read_text(encoding="utf-8"))
        ):
            problems.append(f"{target}: no heading with anchor #{fragment} in {dest.name}")
    return problems


def test_anchors_follow_githubs_rule():
    text = "# The cost model\n## At the machine's own rate: bare TCP\n```\n# not a heading\n```\n"
    text += "## Notes\n## Notes\n"
    assert anchors(text) == {
        "the-cost-model",
        "at-the-machines-own-rate-bare-tcp",
        "notes",
        "notes-1",
    }


def test_a_missing_file_or_heading_is_reported(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n## A section\n")
    text = "[a](other.md#a-section) [b](other.md#gone) [c](missing.md) [d](#own) [e](https://x.y)"
    page.write_text(text + "\n# Own\n")
    problems = broken_links(page, page.read_text())
    assert len(problems) == 2, problems
    assert "other.md#gone" in problems[0] and "missing.md" in problems[1]


def test_every_relative_link_resolves():
    problems = [
        f"{page.relative_to(ROOT)}: {problem}"
        for page in PAGES
        for problem in broken_links(page, page.read_text(encoding="utf-8"))
    ]
    assert problems == [], "\n".join(problems)
