"""The front door stays usable: a short README, links that resolve, one complete method table, and no
pointers to files that are not in the repository.

The README promises two commands and points into docs/; the details live in docs/. These checks keep it
that way: the README stays short enough to read, every relative link in the README and in docs/ names a
file that exists (anchors are not checked), docs/index.md lists every page, docs/methods.md lists every
registered method exactly once, and no tracked file cites material a user cannot open (the design notes
and paper specifications that lived outside the repository while privfl was written; the docs cite the
papers themselves instead).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
METHODS_PAGE = DOCS / "methods.md"
MAX_README_LINES = 150
#: strings that point outside the repository (a user has no such file)
FORBIDDEN = ("shared/specs", "../shared", "DESIGN.md")

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Link targets of a Markdown page that point into the repository: code blocks and inline code are
    skipped (Python indexing such as ``a[0](x)`` is not a link), as are URLs and same-page anchors."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = [m.group(1) for m in LINK.finditer(prose)]
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details into docs/ (at most {MAX_README_LINES})"


def test_readme_keeps_its_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    missing = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_index_lists_every_page() -> None:
    index = DOCS / "index.md"
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for t in relative_links(index.read_text(encoding="utf-8"))}
    unlisted = [p.relative_to(DOCS).as_posix() for p in sorted(DOCS.rglob("*.md")) if p != index and p.resolve() not in linked]
    assert not unlisted, f"docs/index.md does not list {unlisted}"


def method_table_names() -> list[str]:
    """The CLI names in the first column of docs/methods.md's method table (header starts with '| method')."""
    lines = METHODS_PAGE.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| method")), None)
    assert start is not None, "docs/methods.md has no table whose header starts with '| method'"
    names = []
    for line in lines[start + 2 :]:  # after the header and its |---| row
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        m = re.search(r"`([^`]+)`", first)
        assert m, f"docs/methods.md: a row without a `name` in its first cell: {line[:80]}"
        names.append(m.group(1))
    return names


def test_methods_page_lists_every_method_once() -> None:
    from privfl.methods import METHODS

    counts = Counter(method_table_names())
    registered = set(METHODS.names())
    assert not registered - set(counts), f"docs/methods.md lacks {sorted(registered - set(counts))}"
    assert not set(counts) - registered, f"docs/methods.md names unregistered methods {sorted(set(counts) - registered)}"
    twice = sorted(n for n, c in counts.items() if c > 1)
    assert not twice, f"docs/methods.md lists {twice} more than once"


def test_no_tracked_file_points_outside_the_repository() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listed = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if name == this or not path.is_file():  # this file names the strings; a deleted file is not there to read
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        hits += [f"{name}: {s}" for s in FORBIDDEN if s in text]
    assert not hits, "tracked files cite material outside the repository (cite the paper or a docs page instead):\n" + "\n".join(hits)
