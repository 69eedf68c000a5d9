"""The audit end to end on a method defined only in this file, its report and schema, --check, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attacks.audit import PROFILES, Profile, audit, audited_rounds, predict
from attacks.audit_report import LEAKS, NO_EVIDENCE, SCHEMA
from privfl.cli import run_cli
from tests.helpers import ROOT

#: a profile small enough for the default suite: two rounds on 600 samples, one client attacked, few steps
TINY = Profile(
    "tiny",
    "the test suite's: 600 samples, 2 rounds, 1 client, a few steps",
    {"subsample": 600, "rounds": 2, "partition": "dir", "alpha": 0.3, "min_samples": 8, "batch_size": 32, "model_group": "homo-cnn4"},
    1,
    {"invert": {"steps": 2, "input_depth": 4}, "dlg": {"steps": 1, "lbfgs_max_iter": 2}, "idlg": {"steps": 1, "lbfgs_max_iter": 2},
     "ig": {"steps": 2}, "mia-loss": {"queries": 40}, "mia-lira": {"queries": 40, "population": 80, "shadows": 2, "shadow_epochs": 1},
     "mia-rmia": {"queries": 40, "population": 80, "shadows": 2, "shadow_epochs": 1},
     "invert-head": {"steps": 5, "shifts": 0, "population": 80}, "invert-learned": {"steps": 5, "shifts": 0, "population": 80},
     "invert-substitute": {"steps": 5, "shifts": 0, "population": 80, "substitute_steps": 5}},
)  # fmt: skip

METHOD = '''
import torch
from privfl.capture import Message
from privfl.fl.method import GlobalModelServer, class_prototypes, module_tensors


class ProtoAvg(GlobalModelServer):
    """FedAvg whose clients also upload their class prototypes (a method written by a user, in a test)."""

    sends = {"model": "up/down", "proto": "up"}
    paper = "a test method"

    def run_round(self, rnd, selected):
        acc, total = {}, 0.0
        for c in selected:
            self.local_train(rnd, c)
            n = len(c.train_idx)
            got = self.send(Message(rnd, c.name, "server", "model", module_tensors(c.model), {"num_samples": n}), {"indices": c.train_idx.cpu()})
            reps, labels = self.representations(c)
            cls, protos, counts = class_prototypes(reps, labels, self.env.num_classes)
            self.send(Message(rnd, c.name, "server", "proto", {"protos": protos, "classes": cls, "counts": counts}),
                      {"indices": c.train_idx.cpu()})
            total += n
            for k, v in got.tensors.items():
                acc[k] = acc.get(k, 0) + v.double() * n
        ref = self.global_model.state_dict()
        self.global_model.load_state_dict({k: (v / total).to(ref[k].dtype) for k, v in acc.items()})
        self.broadcast(rnd)
        return {}


class NoCount(ProtoAvg):
    """The same upload without its sample count: refused at the first send."""

    def run_round(self, rnd, selected):
        c = selected[0]
        self.send(Message(rnd, c.name, "server", "model", module_tensors(c.model)))
        return {}
'''


@pytest.fixture(scope="module")
def user_method(tmp_path_factory):
    folder = tmp_path_factory.mktemp("usermethod")
    (folder / "audit_user_method.py").write_text(METHOD)
    sys.path.insert(0, str(folder))
    yield "audit_user_method:ProtoAvg"
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def audited(user_method, tmp_path_factory):
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    import torch
    from threadpoolctl import threadpool_limits

    out = tmp_path_factory.mktemp("audit") / "report"
    lines: list[str] = []
    # one thread, as each of test_two_workers_give_the_same_report's workers: a decoder trained on two threads sums
    # in another order than on one, and that test compares the two audits to the last bit
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            result = audit(user_method, profile=TINY, compare=["local"], out=out, device="cpu", progress=False, log=lines.append)
    finally:
        torch.set_num_threads(threads)
    return result, lines


def test_the_audit_attacks_every_kind_and_compares_with_the_references(audited):
    result, lines = audited
    report = result.report
    audited_entry, local = report["methods"]
    assert (audited_entry["role"], local["role"], local["method"]) == ("audited", "reference", "local")
    kinds = {k["kind"]: k for k in audited_entry["kinds"]}
    assert set(kinds) == {"model", "proto"}
    model, proto = kinds["model"], kinds["proto"]
    assert model["reconstruction"]["psnr"] is not None and model["reconstruction"]["attack"] in ("dlg", "idlg", "ig", "invert-head")
    assert model["membership"] is not None and 0.0 <= model["membership"]["auc"] <= 1.0
    assert proto["labels"]["recall"] == 1.0 and proto["labels"]["l1"] < 1e-6  # classes and counts travel in the clear
    assert {r["round"] for r in model["results"]} == set(audited_rounds(2))
    # prototypes cannot be inverted without the extractor: said, with the declaration that would change it
    invert = [n for n in proto["not_applicable"] if n["attack"] == "invert"]
    assert invert and "extractor" in invert[0]["reason"] and "exposes = ('extractor',)" in invert[0]["fix"]
    assert local["kinds"] == [] and any("local sends nothing" in c for k in audited_entry["kinds"] for c in k["comparison"])
    # every strongest result is read against the attacker's prior, with the SoK class of its threat model
    recon = model["reconstruction"]
    assert recon["verdict"] in (LEAKS, NO_EVIDENCE) and recon["gain_psnr"] is not None and recon["prior_psnr"] is not None
    assert recon["gain_psnr"] == max(r["metrics"]["gain_psnr"] for r in model["results"] if r["family"] == "reconstruction")
    assert recon["sok_threat_model"] in ("A", "B", "B+", "C", "D", "E") and proto["labels"]["verdict"] in (LEAKS, NO_EVIDENCE)
    assert model["verdict"] in (LEAKS, NO_EVIDENCE) and isinstance(audited_entry["privacy"]["leaks"], list)
    assert audited_entry["accuracy"]["final"] is not None and audited_entry["communication"]["upload_bytes"] > 0
    assert any("training" in line for line in lines)  # progress was reported


def test_report_json_validates_against_its_schema_and_the_html_stands_alone(audited):
    import jsonschema

    result, _ = audited
    saved = json.loads(result.json.read_text())
    jsonschema.validate(saved, SCHEMA)
    assert saved["schema"] == "privfl-audit/2" and saved["profile"]["name"] == "tiny"
    bad = {**saved, "methods": [{**saved["methods"][0], "role": "spectator"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)
    page = result.html.read_text()
    for section in ("<h2>Summary</h2>", "audit_user_method:ProtoAvg <small>(audited)", "local <small>(reference)",
                    "threat model it assumes", "attacks that do not apply", "To enable it:"):  # fmt: skip
        assert section in page, section
    assert page.count("data:image/png;base64,") >= 3  # figure, a gallery, a ROC or label grid: embedded, no links
    assert 'src="http' not in page and 'src="/' not in page
    assert (result.folder / "privacy_utility.png").stat().st_size > 0
    assert "leaks beyond the prior" in page or "no evidence beyond the prior" in page


def test_old_reports_are_still_read_and_foreign_ones_refused(audited, tmp_path):
    from attacks.audit_report import read_report
    from privfl.errors import ConfigError

    result, _ = audited
    assert read_report(result.json)["schema"] == "privfl-audit/2"
    old = json.loads(result.json.read_text())
    old["schema"] = "privfl-audit/1"
    for entry in old["methods"]:
        entry["privacy"].pop("leaks")
        for k in entry["kinds"]:
            k.pop("verdict")
            for family in ("reconstruction", "labels", "membership"):
                if k[family]:
                    k[family].pop("verdict")
                    k[family].pop("sok_threat_model")
    (tmp_path / "old.json").write_text(json.dumps(old))
    upgraded = read_report(tmp_path / "old.json")
    assert upgraded["methods"][0]["kinds"][0]["verdict"] is None and upgraded["methods"][0]["privacy"]["leaks"] == []
    (tmp_path / "future.json").write_text(json.dumps({**old, "schema": "privfl-audit/99"}))
    with pytest.raises(ConfigError, match="privfl-audit/99"):
        read_report(tmp_path / "future.json")


def test_profiles_and_predictions():
    from privfl.methods import METHODS

    assert set(PROFILES) == {"quick", "standard", "paper"}
    assert audited_rounds(20) == [0, 9, 19] and audited_rounds(1) == [0]
    notes = dict(predict(METHODS.get("fedproto")))  # exposes its extractor: inversion applies
    assert "invert" not in notes
    assert "membership" in dict(predict(METHODS.get("drdfl")))  # a probe readout: no membership test of the client's classifier


def test_references_and_model_groups():
    from attacks.audit import model_group_for, references_for
    from privfl.methods import METHODS

    assert references_for(METHODS.get("fedre"), None, "fedre") == ["fedavg", "local", "fedproto"]
    assert references_for(METHODS.get("fedavg"), None, "fedavg") == ["fedsgd", "local"]  # some reference sends something
    assert references_for(METHODS.get("fedavg"), ["fedavg", "local"], "fedavg") == ["local"]
    assert model_group_for("fedavg", {"model_group": "cpu5"}).startswith("homo-")  # one architecture for every client
    assert model_group_for("fedre", {"model_group": "cpu5"}) == "cpu5"


def err(capsys, argv):
    from privfl.audit import main

    code = run_cli("privfl.audit", lambda: main(argv))
    text = capsys.readouterr().err.strip()
    assert code == 2 and len(text.splitlines()) == 1, text
    return text


def test_refusals_are_one_line(user_method, tmp_path, capsys, fmnist):
    assert "give a METHOD" in err(capsys, [])
    assert "unknown method 'nope'" in err(capsys, ["nope", "--out", str(tmp_path / "a")])
    assert "unknown defense" in err(capsys, [user_method, "--defense", "nodefense", "--out", str(tmp_path / "b")])
    assert "invalid choice" not in err(capsys, [user_method, "--train", "oops", "--out", str(tmp_path / "c")])
    text = err(capsys, ["audit_user_method:NoCount", "--out", str(tmp_path / "d"), "--train", "subsample=600", "--train", "rounds=1",
                        "--train", "model_group=homo-cnn4", "--no-progress"])  # fmt: skip
    assert "missing meta 'num_samples'" in text
    assert not (tmp_path / "d").exists()  # the failed run is gone, and the report folder this audit created with it


def test_check_names_what_applies_and_the_fix(user_method, capsys, fmnist):
    from privfl.audit import main

    assert main([user_method, "--check", "--train", "model_group=homo-cnn4"]) == 0
    out = capsys.readouterr().out
    assert "it sends model (up/down), proto (up)" in out and "before training: proto cannot be inverted" in out
    assert "dlg                applies to model" in out and "to enable it: declare exposes = ('extractor',)" in out


def test_schema_is_printed_and_piping_into_head_ends_quietly():
    done = subprocess.run(f"{sys.executable} -m privfl.audit --schema | head -n 2", shell=True, cwd=ROOT, capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("{") and "Traceback" not in done.stderr, done.stderr
    assert json.loads(json.dumps(SCHEMA))["properties"]["schema"]["const"] == "privfl-audit/2"
    assert Path(ROOT / "docs" / "audit.md").is_file()


def test_a_message_without_its_sample_ids_is_one_line_not_a_key_error():
    import torch

    from attacks.scoring import sample_ids
    from privfl.errors import CaptureError

    assert torch.equal(sample_ids({"indices": torch.tensor([3, 1])}, 7), torch.tensor([3, 1]))
    with pytest.raises(CaptureError, match=r"message 7 was sent without the ids .* truth=\{'indices'") as info:
        sample_ids({"weights": torch.ones(2)}, 7)
    assert "\n" not in str(info.value)


def _comparable(value, out: Path):
    """A report without its timings and with its own folder written as OUT, to compare two audits."""
    if isinstance(value, dict):
        return {k: _comparable(v, out) for k, v in value.items() if "second" not in k and k not in ("created", "time", "duration")}
    if isinstance(value, list):
        return [_comparable(v, out) for v in value]
    if isinstance(value, str):
        return value.replace(str(out), "OUT")
    return value


@pytest.mark.slow  # a second audit in spawned workers (~20 s): .ci/run runs it after the default suite
def test_two_workers_give_the_same_report(audited, user_method, tmp_path):
    """The trainings and attack jobs spread over two spawned processes (one thread each) report exactly
    what one process does: every job is seeded by itself, and outcomes keep the sequential order."""
    from attacks.audit import Workers

    result, _ = audited
    lines: list[str] = []
    out = tmp_path / "report"
    parallel = audit(user_method, profile=TINY, compare=["local"], out=out, device="cpu", progress=False, log=lines.append, workers=Workers(2, 1))
    assert any(line.startswith("2 workers, 1 torch thread(s) each") for line in lines)
    assert _comparable(parallel.report, out) == _comparable(result.report, result.folder)


def test_workers_are_checked_before_anything_runs(tmp_path, capsys):
    from privfl.audit import main

    code = run_cli("privfl.audit", lambda: main(["fedavg", "--workers", "0", "--out", str(tmp_path / "a")]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "privfl.audit: error: --workers must be >= 1 and --threads-per-worker >= 0, got 0 and 0"
    assert not (tmp_path / "a").exists()


def test_deterministic_reaches_every_attack_job_the_attack_itself_and_the_trainings(audited, monkeypatch, tmp_path, capsys):
    """``--deterministic`` on the audit: each job's arguments carry it, an attack run from one records it,
    the trainings' options take it, and a training option of text that is not a bool is one line."""
    import torch

    import attacks.audit as audit_module
    from attacks.audit import AttackJob, JobSettings, _attack, _deterministic, _subject_values

    result, _ = audited
    subject = result.subjects[0]
    jobs = [j for j in audit_module.attack_jobs(subject, TINY, JobSettings(0, "cpu", True)) if isinstance(j, AttackJob)]
    assert jobs and all(j.arguments["deterministic"] is True for j in jobs)
    plain = [j for j in audit_module.attack_jobs(subject, TINY, JobSettings(0, "cpu")) if isinstance(j, AttackJob)]
    assert [j.arguments["deterministic"] for j in plain] == [False] * len(jobs)

    from attacks.base import ATTACKS

    labels = next(j for j in jobs if j.outcome.family == "labels")
    seen: list[bool] = []
    cls = ATTACKS.get(labels.arguments["attack"])
    real_run_batch = cls.run_batch

    def spy(self, *args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real_run_batch(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run_batch", spy)
    before = torch.are_deterministic_algorithms_enabled()  # on in the whole session where CUDA is (conftest)
    report, reason, _, _ = _attack(subject.run, {**labels.arguments, "name": "det-check"}, False)
    assert reason == "" and report is not None and report.protocol["deterministic"] is True and seen == [True]
    assert torch.are_deterministic_algorithms_enabled() == before  # restored after the attack

    assert _deterministic({"deterministic": "true"}) and not _deterministic({}) and _deterministic({"deterministic": True})
    values = {"deterministic": True, "seed": 0, "rounds": 2}
    assert _subject_values(audit_module.Subject("reference", "local"), values)["deterministic"] is True

    from privfl.audit import main

    code = run_cli("privfl.audit", lambda: main(["fedavg", "--train", "deterministic=maybe", "--out", str(tmp_path / "a")]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "privfl.audit: error: deterministic='maybe': expected true or false" and not (tmp_path / "a").exists()

    calls: list[dict] = []

    def record(*args, **kwargs):
        calls.append(kwargs)
        raise SystemExit(0)  # what the CLI passes is all this checks

    monkeypatch.setattr(audit_module, "audit", record)
    run_cli("privfl.audit", lambda: main(["fedavg", "--deterministic", "--out", str(tmp_path / "b")]))
    assert calls and calls[0]["deterministic"] is True
