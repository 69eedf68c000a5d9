"""Every ``python -m privfl.*`` command written in the README and docs/ parses with the command's real
parser: a renamed or removed flag breaks this test, not a reader's first try. (Running them all would
take hours: docs/extending.md's commands run for real in test_docs_examples.py, the demo in CI.)"""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest

from tests.helpers import ROOT

FENCE = re.compile(r"^```(?:bash|sh|console)?\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"(?:^|\s)(?:\.venv/bin/)?python -m (privfl\.(?:train|attack|audit|analyze|capture))\b(.*)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documented() -> list[tuple[str, str, str]]:
    """(page, module, argument text) of every command line in a fenced block of the pages."""
    out = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            joined = re.sub(r"\\\n\s*", " ", block)  # continued lines
            for line in joined.splitlines():
                line = line.split("  #", 1)[0].split(" # ", 1)[0].strip()
                m = COMMAND.search(line)
                if m and "..." not in line and "<" not in line:
                    out.append((str(page.relative_to(ROOT)), m.group(1), m.group(2).strip()))
    return out


def _parse(module: str, argv: list[str]) -> None:
    import importlib

    from privfl.cli import load_plugins

    load_plugins(argv)
    if module == "privfl.train":
        from privfl.methods import resolve_method
        from privfl.train import _method_from_argv, build_parser

        name = _method_from_argv(argv)
        build_parser(resolve_method(name) if name and ":" not in name else None).parse_args(argv)
        return
    mod = importlib.import_module("privfl.capture.__main__" if module == "privfl.capture" else module)
    mod.build_parser().parse_args(argv)


COMMANDS = documented()


def test_the_pages_hold_commands():
    assert len(COMMANDS) > 40 and {m for _, m, _ in COMMANDS} >= {"privfl.train", "privfl.attack", "privfl.audit", "privfl.analyze"}


@pytest.mark.parametrize("page, module, args", COMMANDS, ids=[f"{p}:{m}:{a[:40]}" for p, m, a in COMMANDS])
def test_a_documented_command_parses(page, module, args):
    import importlib.util

    argv = shlex.split(args)
    if any(":" in a and "." in a.split(":")[0] and not a.startswith("-") for a in argv):
        pytest.skip("names a user's pkg.mod:Class that is not installed here")
    plugins = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--plugin"]
    if any(importlib.util.find_spec(p) is None for p in plugins):
        pytest.skip("loads a user's --plugin package that is not installed here")
    err = io.StringIO()
    code: int | str | None = 0
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parse(module, argv)
    except SystemExit as exc:  # argparse's refusal (2), or --help (0)
        code = exc.code
    assert code == 0, f"{page}: python -m {module} {args}\n{err.getvalue()}"
