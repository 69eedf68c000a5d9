"""Contract tests, parametrised over every registered method, attack, defense and artifact kind.

A new method, attack, defense or kind is checked here without a test of its own: every method trains two
rounds on tiny real data and every message it sent satisfies its kind; for each kind a method sends,
every attack either plans targets or says why not; every defense transforms every kind of its families
(and only those) without breaking the kind; a kind registered with one call works with the channel,
the capture, the defenses and the attacks of its family, end to end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from attacks import ATTACKS, Selection, run_attack
from defenses import DEFENSES, parse_defense
from privfl.capture import Message
from privfl.channel import Channel
from privfl.kinds import KINDS, ArtifactKind, Family, MessageContractError, TensorSpec, example_message, register_kind
from privfl.methods import METHODS, check_method_class
from privfl.run import Run
from privfl.train import main as train_main

TINY = ["--subsample", "600", "--partition", "iid", "--rounds", "2", "--no-progress", "--batch-size", "32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One two-round run per registered method, trained once for the tests of this module."""
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("contracts")
    cache: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in cache:
            group = ["--model-group", "homo-cnn4"] if METHODS.get(method).requires_homogeneous else []
            assert train_main([method, *TINY, *group, "--out-dir", str(out), "--run-name", method]) == 0
            cache[method] = out / method
        return cache[method]

    return get


# ------------------------------------------------------------------------------------------ methods
#: kinds a method declares but does not send in the setting trained here (each covered where named)
SENT_ONLY_IN_ANOTHER_SETTING: dict[str, set[str]] = {
    "fedgen": {"model"},  # identical client models only (share=auto -> model): tests/methods/test_fedgen.py
}


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_is_well_declared(method):
    cls = METHODS.get(method)
    check_method_class(cls)
    assert cls.paper and set(cls.sends) <= set(KINDS.names())
    for kind in cls.sends:
        ctx = cls.leakage_context(kind)
        assert (ctx is not None) == (KINDS.get(kind).form is not None and KINDS.get(kind).family is not Family.GENERATOR)


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_trains_and_every_message_satisfies_its_kind(trained, method):
    run = Run.open(trained(method))
    assert len(run.metrics) == 2 and all(0.0 <= h["acc"] <= 1.0 for h in run.metrics)
    assert run.info["sends"] == METHODS.get(method).sends
    records = run.capture.records()
    sent, declared = {r["kind"] for r in records}, set(METHODS.get(method).sends)
    assert sent <= declared
    assert declared - sent == SENT_ONLY_IN_ANOTHER_SETTING.get(method, set())
    for rec in records:
        spec = KINDS.get(rec["kind"])
        tensors = run.capture.load(rec)
        assert spec.problems(tensors, rec["meta"], rec["direction"], rec["aux"]) == [], rec["seq"]
        assert tuple(rec["aux"]) == tuple(n for n in spec.aux_names if n in tensors) or not spec.aux_names


@pytest.mark.parametrize("method", METHODS.names())
def test_every_attack_plans_or_says_why_on_every_kind_sent(trained, method):
    view = Run.open(trained(method)).attacker
    for kind in view.kinds():
        for name in ATTACKS.names():
            attack = ATTACKS.get(name)()
            plan = attack.plan(view, Selection(kind=kind, max_targets=1))
            if plan:
                assert all(t.kind == kind and t.view is view for t in plan.targets)
                assert attack.takes(kind)
            else:
                assert plan.reason and "\n" not in plan.reason, (name, kind)


def test_attack_list_shows_applicable_attacks_and_reasons(trained, capsys):
    from privfl.attack import main as attack_main

    assert attack_main(["list", "--run", str(trained("fedre"))]) == 0
    out = " ".join(capsys.readouterr().out.split())  # columns are padded: compare words
    assert "invert applies to ent_rep" in out
    for name in ("dlg", "idlg", "ig"):
        assert f"{name} does not apply: " in out and "takes (gradient, parameters)" in out
    assert attack_main(["list", "--run", str(trained("fedsgd"))]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "dlg applies to grad" in out and "invert does not apply: attack invert needs extractor" in out


# ------------------------------------------------------------------------------------------ kinds
@pytest.mark.parametrize("kind", KINDS.names())
def test_every_kind_accepts_its_example_and_refuses_what_it_lacks(kind):
    spec = KINDS.get(kind)
    for direction in ("up", "down", "peer"):
        msg = example_message(kind, direction)
        assert spec.problems(msg.tensors, msg.meta, direction, msg.aux) == []
        Channel(method="m", sends={kind: "up/down/peer"}).send(msg)
    required_meta = [m for m in spec.meta if m.required and m.applies("up")]
    up = example_message(kind, "up")
    if required_meta:
        key = required_meta[0].key
        bad = Message(0, "client0", "server", kind, up.tensors, {k: v for k, v in up.meta.items() if k != key})
        with pytest.raises(MessageContractError, match=f"missing meta '{key}'"):
            Channel(method="m").send(bad)
    named = [t.name for t in spec.tensors if t.required and not t.is_pattern]
    if named:
        bad = Message(0, "client0", "server", kind, {k: v for k, v in up.tensors.items() if k != named[0]} or {"x": torch.zeros(1)}, up.meta)
        with pytest.raises(MessageContractError, match=f"missing tensor '{named[0]}'"):
            Channel(method="m").send(bad)


def test_undeclared_sends_and_unknown_kinds_are_one_line_errors():
    msg = example_message("model", "up")
    with pytest.raises(MessageContractError, match="does not declare 'model' in sends") as info:
        Channel(method="mine", sends={"head": "down"}).send(msg)
    assert "\n" not in str(info.value) and "mine" in str(info.value)
    with pytest.raises(MessageContractError, match="declares model: 'down'"):
        Channel(method="mine", sends={"model": "down"}).send(msg)
    with pytest.raises(MessageContractError, match=r"unknown kind 'weights'.*register_kind"):
        Channel(method="mine").send(Message(0, "client0", "server", "weights", {"w": torch.zeros(1)}))


# ------------------------------------------------------------------------------------------ defenses
@pytest.mark.parametrize("defense", DEFENSES.names())
@pytest.mark.parametrize("kind", KINDS.names())
def test_every_defense_applies_to_every_kind_of_its_families(defense, kind):
    d = parse_defense(f"{defense}:directions=up+down+peer")
    msg = example_message(kind, "up")
    ch = Channel(mods=[d], method="m")
    got = ch.send(msg)
    spec = KINDS.get(kind)
    assert spec.problems(got.tensors, got.meta, got.direction, got.aux) == []  # still a valid message of its kind
    payload = [k for k, t in msg.tensors.items() if k not in got.aux and t.is_floating_point()]
    changed = any(not torch.equal(got.tensors[k], msg.tensors[k]) for k in payload)
    assert d.applies_to(msg) == (spec.family in d.families)
    if spec.family not in d.families:
        assert not changed and got is not msg  # untouched (the receiver still gets its own copy)
    assert all(torch.equal(got.tensors[k], msg.tensors[k]) for k in got.aux)  # bookkeeping never touched


# ------------------------------------------------------------------------------------------ a new kind, end to end
_KIND = "test_sketch"


def _register_sketch() -> None:
    if _KIND not in KINDS:
        register_kind(
            ArtifactKind(
                _KIND,
                Family.AGGREGATE_REPRESENTATION,
                "per-class sums of representations (a user's kind)",
                (TensorSpec("sums", ndim=2, doc="(k, d) per-class sums"), TensorSpec("cls", dtype="int", ndim=1, role="aux")),
                vectors="sums",
                classes="cls",
            )
        )


def test_a_kind_registered_with_one_call_is_captured_defended_and_attacked(tmp_path, monkeypatch, fmnist, request):
    _register_sketch()
    request.addfinalizer(lambda: KINDS.unregister(_KIND))  # leave the vocabulary as found
    assert parse_defense("repnoise").applies_to(example_message(_KIND))  # its family's defense takes it
    assert ATTACKS.get("invert").takes(_KIND) and not ATTACKS.get("dlg").takes(_KIND)
    (tmp_path / "sketch_fl.py").write_text(
        "import torch\n"
        "from privfl.methods import FLMethod\n"
        "from privfl.fl.method import class_prototypes\n"
        "from privfl.capture import Message\n"
        f"class Sketch(FLMethod):\n"
        f"    sends = {{'{_KIND}': 'up'}}\n"
        "    exposes = ('extractor',)\n"
        "    paper = 'a test method'\n"
        "    def run_round(self, rnd, selected):\n"
        "        for c in selected:\n"
        "            self.local_train(rnd, c)\n"
        "            reps, labels = self.representations(c)\n"
        "            cls, protos, counts = class_prototypes(reps, labels, self.env.num_classes)\n"
        f"            self.send(Message(rnd, c.name, 'server', '{_KIND}', {{'sums': protos, 'cls': cls}}), {{'indices': c.train_idx.cpu()}})\n"
        "            self.env.knowledge.record_extractor(rnd, c)\n"
        "        return {}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        train_main(["sketch_fl:Sketch", *TINY, "--rounds", "1", "--defense", "repnoise:sigma=0.01", "--out-dir", str(tmp_path), "--run-name", "s"])
        == 0
    )
    run = Run.open(tmp_path / "s")
    (report_of_defense,) = run.summary["defenses"].values()
    assert report_of_defense["defended_messages"] == 10
    rec = run.capture.records()[0]
    assert rec["kind"] == _KIND and rec["aux"] == ["cls"] and rec["paper_scalars"] == rec["tensors"]["sums"]["shape"][0] * 512
    report = run_attack(run, "invert", clients=[0], max_targets=2, options={"steps": 2, "input_depth": 4}, device="cpu")
    assert report.kind == _KIND and len(report.rows) == 2 and all("best_psnr255" in r for r in report.rows)
    assert all("training images of its class" in r["ground_truth"] for r in report.rows)  # scored by the class rule
    assert report.folder is not None
    saved = json.loads((report.folder / "metrics.json").read_text())
    assert saved["protocol"]["family"] == "aggregate_representation"


# ------------------------------------------------------------------------------------------ label-only attacks
def test_a_label_attack_is_planned_run_scored_and_written_by_the_runner(trained):
    """An attack that produces labels (no images) goes through run_attack: scored by the label rule,
    written with a clients x classes picture."""
    from attacks import Attack, Knowledge, Reconstruction, Target, register_attack
    from privfl.kinds import ParamForm

    class SignRows(Attack):
        """Classes whose last-layer gradient row has a negative entry (iDLG's sign rule, batch form)."""

        consumes = frozenset({"gradient"})
        needs = Knowledge(previous_state=False)
        produces = frozenset({"labels"})
        threat_model = "curious-server-previous-state"
        paper = "Zhao et al., iDLG, 2020"

        def plan_messages(self, view, kind, rnd, records, selection):
            assert KINDS.get(kind).form is ParamForm.GRADIENT
            return [Target(kind, rnd, r["sender"], r, view) for r in records if r["direction"] == "up"]

        def run(self, target, progress=None):
            rows = target.view.load(target.record)["head.weight"]  # (C, d)
            labels = torch.nonzero(rows.min(dim=1).values < 0).flatten()
            return Reconstruction(target, None, 0.0, 0.0, labels=labels, notes={"rule": "negative row"})

    register_attack("test_signrows")(SignRows)
    try:
        report = run_attack(trained("fedsgd"), "test_signrows", kind="grad", device="cpu")
        assert report.summary["messages"] == 10 and report.summary["precision"] == 1.0  # the sign rule names no absent class
        assert 0 < report.summary["recall"] <= 1 and {"recovered", "true", "f1", "exact"} <= set(report.rows[0])
        folder = report.folder
        assert folder is not None and (folder / "labels.png").stat().st_size > 0 and not (folder / "gallery.png").exists()
        assert "labels.png" in (folder / "index.html").read_text()
    finally:
        ATTACKS.unregister("test_signrows")


def test_registering_an_attack_checks_its_declarations():
    from attacks import Attack, Knowledge, register_attack

    class NoNeeds(Attack):
        consumes = frozenset({"gradient"})
        threat_model = "curious-server-previous-state"

    with pytest.raises(TypeError, match="declare needs"):
        ATTACKS.register("test_noneeds", NoNeeds)  # the registry checks, with or without the decorator

    class BadOutput(NoNeeds):
        needs = Knowledge()
        produces = frozenset({"audio"})

    with pytest.raises(TypeError, match="produces"):
        register_attack("test_badoutput")(BadOutput)
    assert "test_noneeds" not in ATTACKS and "test_badoutput" not in ATTACKS


# ------------------------------------------------------------------------------------------ plug-ins on the command line
def test_plugins_on_the_command_line(trained, tmp_path, monkeypatch, capsys, request):
    """--plugin MODULE makes a user's defense, kind and attack known to every CLI; `attack run NAME` runs any
    registered attack with typed --option values; a bad plug-in or option is one line."""
    from privfl.attack import main as attack_main
    from privfl.capture.__main__ import main as capture_main
    from privfl.cli import run_cli

    (tmp_path / "cli_plugin.py").write_text(
        "import torch\n"
        "from dataclasses import dataclass\n"
        "from defenses import Defense, DefenseParams, register_defense, PARAMETER_FAMILIES\n"
        "@dataclass\n"
        "class HalfParams(DefenseParams):\n"
        "    factor: float = 0.5\n"
        "@register_defense\n"
        "class Half(Defense):\n"
        "    '''Scales every update (a test plug-in).'''\n"
        "    name = 'test_half'\n"
        "    paper = 'none'\n"
        "    families = PARAMETER_FAMILIES\n"
        "    Params = HalfParams\n"
        "    def transform(self, updates, msg):\n"
        "        return {k: u * self.params.factor for k, u in updates.items()}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cli_plugin", raising=False)
    request.addfinalizer(lambda: "test_half" in DEFENSES and DEFENSES.unregister("test_half"))  # leave the registry as found
    out = ["--out-dir", str(tmp_path), *TINY, "--rounds", "1", "--model-group", "homo-cnn4"]
    assert train_main(["fedavg", "--plugin", "cli_plugin", "--defense", "test_half:factor=0.25", *out, "--run-name", "h"]) == 0
    (spec,) = Run.open(tmp_path / "h").summary["defenses"]
    assert spec.startswith("test_half")
    assert capture_main(["kinds", "--plugin", "cli_plugin"]) == 0 and "ent_rep" in capsys.readouterr().out
    run = str(trained("fedsgd"))
    assert (
        attack_main(
            [
                "run",
                "dlg",
                "--run",
                run,
                "--artifact",
                "grad",
                "--clients",
                "0",
                "--option",
                "steps=2",
                "--option",
                "max_batch=1",
                "--no-progress",
                "--plugin",
                "cli_plugin",
            ]
        )
        == 0
    )
    assert "dlg on grad" in capsys.readouterr().out

    def err(main, argv):
        code = run_cli("privfl.x", lambda: main(argv))
        text = capsys.readouterr().err.strip()
        assert code == 2 and len(text.splitlines()) == 1, text
        return text

    assert "cannot import --plugin no_such_mod" in err(attack_main, ["list", "--run", run, "--plugin", "no_such_mod"])
    assert "KEY one of" in err(attack_main, ["run", "dlg", "--run", run, "--option", "nope=1"])
    assert "not a valid int" in err(attack_main, ["run", "dlg", "--run", run, "--option", "steps=many"])
    assert "unknown defense 'test_nohalf'" in err(train_main, ["fedavg", "--defense", "test_nohalf", *out, "--run-name", "z"])


def test_piping_into_head_is_not_an_error(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    done = subprocess.run(f"{sys.executable} -m privfl.capture kinds | head -n 1", shell=True, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_a_defense_declaring_kinds_the_old_way_is_refused():
    from defenses import Defense, register_defense

    class Old(Defense):
        name = "test_old"
        paper = "none"
        default_kinds = frozenset({"model"})  # type: ignore[assignment]  # the retired declaration under test

    with pytest.raises(TypeError, match="default_kinds is no longer read"):
        register_defense(Old)
    assert "test_old" not in DEFENSES
