"""The import-linter contract behind ``make lint``'s "no import circle" rule finds circles where they are,
and finds none in privfl (the four it found before are gone: see the layers contracts in .importlinter)."""

from __future__ import annotations

import sys

import pytest

grimp = pytest.importorskip("grimp")

from tests.helpers import ROOT  # noqa: E402
from tools.import_contracts import AcyclicModulesContract, _strongly_connected  # noqa: E402


def _check(packages: list[str], containers: list[str]):
    graph = grimp.build_graph(*packages, cache_dir=None)
    contract = AcyclicModulesContract("no circles", session_options={}, contract_options={"containers": containers})
    return contract.check(graph, verbose=False)


def test_a_circle_between_two_modules_breaks_the_contract(tmp_path, monkeypatch):
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from circled import b\n    return b\n")  # inside a function: still an import
    (pkg / "b.py").write_text("from circled import a\n")
    (pkg / "c.py").write_text("from circled import b\n")  # depends on the circle, is not in it
    monkeypatch.syspath_prepend(str(tmp_path))
    check = _check(["circled"], ["circled"])
    assert not check.kept
    (circle,) = check.metadata["circles"]
    assert circle["modules"] == ["circled.a", "circled.b"]
    assert sorted(circle["imports"]) == [("circled.a", "circled.b"), ("circled.b", "circled.a")]
    sys.modules.pop("circled", None)


def test_privfl_has_no_import_circle():
    check = _check(["privfl", "attacks", "defenses"], ["privfl", "attacks", "defenses"])
    assert check.kept, check.metadata["circles"]
    assert (ROOT / ".importlinter").is_file()


def test_tarjan_finds_every_component():
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": []}
    comps = sorted(c for c in _strongly_connected(sorted(edges), edges) if len(c) > 1)
    assert comps == [["a", "b", "c"], ["d", "e"]]
