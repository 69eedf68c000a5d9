"""docs/extending.md runs as written: its files, its commands, its claims.

Every Python block of the page that starts with ``# file: PATH`` is written under a temporary folder,
then every command of its ``bash`` blocks (``python -m MODULE ...`` or ``python SCRIPT``) runs there in
the page's order, on tiny real data: the example method trains, its capture is checked, the example
attack (label inference, through the runner) and a built-in one attack it, the example defense is
applied through ``--defense`` and the example kind is sent, defended and attacked; the command lines
load the example package with ``--plugin``. Commands run in this process (a subprocess would import
torch again for each, several seconds apiece); what the examples register is removed afterwards so the
rest of the suite sees the registries it expects.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from attacks import ATTACKS
from defenses import DEFENSES, parse_defense
from privfl.capture import Message
from privfl.channel import Channel
from privfl.cli import run_cli
from privfl.errors import ConfigError
from privfl.kinds import KINDS, Family, MessageContractError, check_message, example_message
from privfl.methods import METHODS, check_method_class, resolve_method
from privfl.registry import Registry
from privfl.run import Run
from privfl.train import main as train_main
from tests.helpers import FMNIST, ROOT

DOC = ROOT / "docs" / "extending.md"
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```[ \t]*$", re.M | re.S)
FILE_MARK = re.compile(r"#\s*file:\s*(\S+)")
#: CLI modules whose main() takes argv (``privfl.capture``'s lives in its __main__)
CLIS = {"privfl.capture": "privfl.capture.__main__"}
#: what the page's examples register, removed after the module's tests
REGISTERED: list[tuple[Registry[Any], str]] = [(ATTACKS, "labelset"), (DEFENSES, "signcomp"), (KINDS, "body")]
PACKAGE = "mypkg"
#: the page's tiny settings
TINY = ["--model-group", "homo-cnn4", "--subsample", "600", "--partition", "iid", "--rounds", "2", "--batch-size", "32", "--no-progress"]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def example_files(text: str) -> dict[str, str]:
    """Path -> source of every ``python`` block whose first line is ``# file: PATH``."""
    out = {}
    for lang, body in blocks(text):
        mark = FILE_MARK.match(body.splitlines()[0]) if lang == "python" and body.strip() else None
        if mark:
            assert mark.group(1) not in out, f"{mark.group(1)} is given twice"
            out[mark.group(1)] = body
    return out


def commands(text: str) -> list[list[str]]:
    """The argv (after ``python``) of every command line of the ``bash`` blocks; env assignments dropped."""
    out = []
    for lang, body in blocks(text):
        if lang != "bash":
            continue
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words:
                assert words[0] == "python", f"the docs test runs python commands only, got {line!r}"
                out.append(words[1:])
    return out


def section(text: str, heading: str) -> str:
    """The text under a ``## heading`` up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def run_command(argv: list[str], root: Path) -> str:
    """Run one page command in this process; its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if argv[0] == "-m":
            module = importlib.import_module(CLIS.get(argv[1], argv[1]))
            code = module.main(argv[2:])
        else:
            saved = sys.argv
            sys.argv = [str(root / argv[0]), *argv[1:]]
            try:
                runpy.run_path(str(root / argv[0]), run_name="__main__")
            finally:
                sys.argv = saved
            code = 0
    assert code == 0, (argv, out.getvalue()[-2000:])
    return out.getvalue()


def forget_package() -> None:
    """Unregister what the page's package registered and drop its modules, as in a fresh process."""
    for registry, name in REGISTERED:
        if name in registry:
            registry.unregister(name)
    for module in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[module]


@dataclass
class Session:
    root: Path
    outputs: list[tuple[str, str]]  # (command, its stdout)

    def output(self, command: str) -> str:
        found = [out for cmd, out in self.outputs if command in cmd]
        assert len(found) == 1, f"{command!r} matches {len(found)} commands of the page"
        return found[0]

    def run(self, name: str) -> Run:
        return Run(self.root / "runs" / name)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """The page, run once: files written, commands run in order."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    text = DOC.read_text()
    taken = [name for registry, name in REGISTERED if name in registry]
    assert not taken and PACKAGE not in sys.modules, f"names the page's examples register are taken: {taken}"
    root = tmp_path_factory.mktemp("extending")
    for path, source in example_files(text).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(source)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.syspath_prepend(str(root))
        try:
            yield Session(root, [(" ".join(argv), run_command(argv, root)) for argv in commands(text)])
        finally:
            forget_package()


# ------------------------------------------------------------------------------------------ the page itself
def test_every_example_file_is_used_and_every_link_resolves(session):
    text = DOC.read_text()
    files = example_files(text)
    ran = "\n".join(cmd for cmd, _ in session.outputs)
    for path in files:
        if "/" in path:  # a module of the package: imported by the commands
            assert path.removesuffix(".py").replace("/", ".").removesuffix(".__init__") in sys.modules, path
        else:  # a script: run by a command
            assert path in ran, f"no command of the page runs {path}"
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for link in re.findall(r"\]\(#([^)]+)\)", text):
        assert link in anchors, f"link #{link} has no heading"
    assert "migrating" in anchors  # the library's errors point to docs/extending.md#migrating


def test_the_public_api_names_exist():
    api = section(DOC.read_text(), "The public API")
    names = set(re.findall(r"`((?:privfl|attacks|defenses)(?:\.\w+)+)`", api))
    assert len(names) > 40
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), name
                obj = getattr(obj, attr)
            break


# ------------------------------------------------------------------------------------------ example 1: the method
def test_the_method_trains_and_sends_what_it_declares(session):
    run = session.run("fedavgm")
    assert len(run.metrics) == 2 and run.info["sends"] == {"update": "up", "model": "down"}
    records = run.capture.records()
    assert {r["kind"] for r in records} == {"model", "update"}
    for rec in records:
        assert KINDS.get(rec["kind"]).problems(run.capture.load(rec), rec["meta"], rec["direction"], rec["aux"]) == []
    ups = [r for r in records if r["kind"] == "update"]
    assert len(ups) == 20 and all(r["direction"] == "up" and r["meta"]["num_samples"] == 45 and r["meta"]["tau"] == 2 for r in ups)
    truth = run.ground_truth()
    assert all(len(truth.message_truth(r["seq"])["indices"]) == 45 for r in ups)  # send(..., truth=) filed the samples
    from safetensors import safe_open

    ckpt = json.loads((run.path / "checkpoint" / "checkpoint.json").read_text())
    with safe_open(str(run.path / "checkpoint" / ckpt["file"]), "pt") as f:
        assert "method.velocity.head.weight" in set(f.keys())  # server momentum is checkpointed for --resume
    assert "accuracy" in session.output("check_fedavgm.py")
    assert re.search(r"update +gradient +client0->server", session.output("privfl.capture list --run runs/fedavgm"))


def test_the_built_in_form_is_one_decorator(session):
    """The page's diff turns the method file into a built-in: apply it under a unique name."""
    diff = next(body for lang, body in blocks(DOC.read_text()) if lang == "diff")
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    (context,) = [line[1:] for line in diff.splitlines() if line.startswith(" ")]
    source = example_files(DOC.read_text())[f"{PACKAGE}/fedavgm.py"]
    assert context in source
    name = "fedavgm_docs_builtin"
    patched = source.replace(context, "\n".join(added).replace('"fedavgm"', f'"{name}"') + "\n" + context)
    module = types.ModuleType("docs_builtin_fedavgm")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(patched, "privfl/methods/fedavgm.py", "exec"), module.__dict__)
        cls = resolve_method(name)
        check_method_class(cls)
        assert cls is module.FedAvgM and name in METHODS.names()
    finally:
        METHODS._entries.pop(name, None)
        del sys.modules[module.__name__]


# ------------------------------------------------------------------------------------------ example 2: the attack
def test_the_attacks_ran_and_were_scored(session):
    assert ATTACKS.get("labelset").produces == frozenset({"labels"})
    out = session.output("attack_fedavgm.py")
    assert len(re.findall(r"client\d: recovered (\d+) of its \1 classes", out)) >= 8  # exact label sets, nearly all clients
    folder = session.root / "runs/fedavgm/attacks/labelset-update-r1"
    assert (folder / "labels.png").stat().st_size > 0 and not (folder / "gallery.png").exists()
    report = json.loads((folder / "metrics.json").read_text())
    assert report["protocol"]["artifact"] == "update" and report["protocol"]["family"] == "gradient"
    assert report["summary"]["messages"] == 10 and report["summary"]["precision"] == 1.0  # the sign rule names no absent class
    assert report["summary"]["recall"] >= 0.9 and f"precision {report['summary']['precision']:.3f}" in out
    assert {"recovered", "true", "precision", "recall", "f1", "exact", "rule"} <= set(report["images"][0])  # one row per message
    report = json.loads((session.root / "runs/fedavgm/attacks/idlg-update-r1/metrics.json").read_text())
    assert report["protocol"]["artifact"] == "update" and report["protocol"]["family"] == "gradient"
    listing = " ".join(session.output("attack list --plugin mypkg --run runs/fedavgm").split())  # padded columns: compare words
    assert "labelset applies to update (last round 1): 10 target(s)" in listing
    assert "dlg applies to update" in listing and "invert does not apply: attack invert needs extractor" in listing


# ------------------------------------------------------------------------------------------ example 3: the defense
def test_the_defense_is_applied_through_the_flag(session):
    run = session.run("fedavgm-sign")
    assert run.summary["defenses"] == {"signcomp:directions=up": {"defended_messages": 20}}
    view = run.attacker
    tensors = view.load(view.messages("update", round=1)[0])
    assert all(len(t.abs().unique()) <= 2 for t in tensors.values())
    assert "recovered exactly despite the defense: 10 of 10" in session.output("check_signcomp.py")
    assert (session.root / "runs/fedavgm-sign/attacks/labelset-update-r1/labels.png").exists()
    assert parse_defense("signcomp:magnitude=0.5,directions=up+down").spec == "signcomp:directions=down+up,magnitude=0.5"
    with pytest.raises(ConfigError, match="magnitude must be a positive number"):
        parse_defense("signcomp:magnitude=0")


# ------------------------------------------------------------------------------------------ example 4: the kind
def test_the_kind_is_captured_checked_defended_and_attacked(session):
    body = KINDS.get("body")
    assert body.family is Family.PARAMETERS and body.form is not None and body.closed
    run = session.run("fedper")
    records = run.capture.records()
    assert {r["kind"] for r in records} == {"body"}
    assert all(name.startswith("features.") for r in records for name in r["tensors"])  # the head never left
    assert run.summary["defenses"] == {"clip:directions=up,max_norm=5.0": {"defended_messages": 20}}
    assert ATTACKS.get("ig").takes("body") and not ATTACKS.get("invert").takes("body")
    report = json.loads((session.root / "runs/fedper/attacks/ig-body-r1/metrics.json").read_text())
    assert report["protocol"]["artifact"] == "body" and "random probe" in report["protocol"]["approximation"]
    listing = " ".join(session.output("attack list --plugin mypkg --run runs/fedper").split())
    assert "labelset does not apply: body messages carry no (10, d) float layer" in listing and "dlg applies to body" in listing

    up = run.capture.load(next(r for r in records if r["direction"] == "up"))
    channel = Channel(method="fedper", sends={"body": "up/down"})
    channel.send(Message(0, "client0", "server", "body", up, {"num_samples": 45}))
    with pytest.raises(MessageContractError, match=r"undeclared tensor\(s\) 'head.weight'"):
        channel.send(Message(0, "client0", "server", "body", {**up, "head.weight": torch.zeros(10, 512)}, {"num_samples": 45}))
    with pytest.raises(MessageContractError, match="missing meta 'num_samples'"):
        channel.send(Message(0, "client0", "server", "body", up))
    channel.send(Message(0, "server", "client0", "body", up))  # broadcasts need no sample count
    example = example_message("body")
    assert sorted(example.tensors) == ["features.layer.bias", "features.layer.weight"] and "num_samples" in example.meta
    check_message(example)
    assert re.search(r"^body +parameters .*features\.\*", session.output("capture kinds --plugin mypkg"), re.M)


# ------------------------------------------------------------------------------------------ the command lines
def test_the_command_lines_load_the_package_with_plugin(session, capsys):
    """Each CLI, in a state where the page's package was never imported: --plugin makes its parts known."""
    root = session.root
    run_sign = session.run("fedavg-sign")
    assert run_sign.method == "fedavg" and run_sign.summary["defenses"] == {"signcomp:directions=up": {"defended_messages": 20}}
    out = session.output("privfl.attack run labelset")
    assert "labelset on update r1: 10 message(s)" in out and "precision 1.000" in out
    assert json.loads((root / "runs/fedavgm/attacks/labelset-tol/metrics.json").read_text())["protocol"]["config"]["tolerance"] == 0.01

    def error(main: Any, argv: list[str]) -> str:
        code = run_cli("privfl", lambda: main(argv))
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        return err

    from privfl.attack import main as attack_main
    from privfl.capture.__main__ import main as capture_main

    try:
        forget_package()
        assert "unknown defense 'signcomp'" in error(train_main, ["fedavg", "--defense", "signcomp", *TINY, "--run-name", "no-plugin"])
        assert not (root / "runs/no-plugin").exists()
        listing = " ".join(run_command(["-m", "privfl.attack", "list", "--run", "runs/fedavgm"], root).split())
        assert "dlg applies" in listing and "labelset" not in listing  # the package came in while planning: too late to list it
        forget_package()
        assert re.search(r"^body ", run_command(["-m", "privfl.capture", "kinds", "--plugin", PACKAGE], root), re.M)
        forget_package()
        listing = " ".join(run_command(["-m", "privfl.attack", "list", "--plugin", PACKAGE, "--run", "runs/fedavgm"], root).split())
        assert "labelset applies to update (last round 1): 10 target(s)" in listing
        forget_package()
        argv = ["run", "labelset", "--run", "runs/fedavgm", "--artifact", "update", "--name", "labelset-cli", "--no-progress", "--plugin", PACKAGE]
        out = run_command(["-m", "privfl.attack", *argv], root)
        assert "precision 1.000" in out and (root / "runs/fedavgm/attacks/labelset-cli/labels.png").exists()
        forget_package()
        # the one-line errors the page quotes
        assert "cannot import --plugin mypkgg: No module named 'mypkgg'" in error(
            attack_main, ["list", "--run", "runs/fedavgm", "--plugin", "mypkgg"]
        )
        bad_key = error(attack_main, [*argv[:-2], "--option", "nope=1", "--plugin", PACKAGE])
        assert "--option 'nope=1': expected KEY=VALUE with KEY one of tolerance, batch_rule (attack labelset)" in bad_key
        assert "--option 'tolerance=abc': 'abc' is not a valid float" in error(attack_main, [*argv, "--option", "tolerance=abc"])
        assert "dlg reads no model message of this run (it reads what clients send); accepted: update" in error(
            attack_main, ["dlg", "--artifact", "model", "--run", "runs/fedavgm"]
        )
        assert "cannot import --plugin" in error(capture_main, ["kinds", "--plugin", "mypkgg"])
    finally:
        importlib.import_module(PACKAGE)  # registered again for the other tests of this module


# ------------------------------------------------------------------------------------------ migrating
def test_the_migration_claims_hold(tmp_path, monkeypatch):
    migrating = section(DOC.read_text(), "Migrating")
    for removed in ("attacks.groundtruth", "attacks.targets"):
        assert removed in migrating and importlib.util.find_spec(removed) is None
    import defenses

    assert not any(hasattr(defenses, k) for k in ("PARAMETER_KINDS", "FULL_PARAMETER_KINDS", "REPRESENTATION_KINDS"))
    assert not any("PRIVFL_FAULT" in p.read_text() for p in (ROOT / "privfl").rglob("*.py"))
    (tmp_path / "legacy_doc_fl.py").write_text(
        "from privfl.methods import FLMethod\n"
        "class Hook(FLMethod):\n"
        "    sends = {'model': 'up/down'}\n"
        "    def leakage_module(self, kind, req):\n"
        "        return None\n"
        "class Translated(FLMethod):\n"
        "    sends = {'small_model': 'up/down'}\n"
        "    parameter_kinds = {'small_model': 'small_model'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape("docs/extending.md#migrating")):
        resolve_method("legacy_doc_fl:Hook")
    ctx = resolve_method("legacy_doc_fl:Translated").leakage_context("small_model")
    assert ctx is not None and ctx.previous == "small_model" and ctx.module == ""

    class PlainAttack:  # the pre-0.2 form: any class with run(view, record)
        def run(self, view, record):
            return None

    with pytest.raises(TypeError, match=re.escape("register a subclass of attacks.Attack (docs/extending.md#migrating)")):
        ATTACKS.register("doc_plain_attack", PlainAttack)  # type: ignore[arg-type]  # the retired form under test

    class OldDefense(defenses.Defense):
        name = "doc_old_defense"
        default_kinds = frozenset({"model"})  # type: ignore[assignment]  # the retired declaration under test

    with pytest.raises(TypeError, match=re.escape("default_kinds is no longer read") + ".*" + re.escape("#migrating")):
        defenses.register_defense(OldDefense)
    assert "doc_plain_attack" not in ATTACKS and "doc_old_defense" not in DEFENSES
