"""End-to-end training runs on small real data: counts, the three-way split, resume, CLI errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from privfl.capture import TensorStore
from privfl.cli import run_cli
from privfl.methods import METHODS
from privfl.models import build_model
from privfl.train import main as train_main
from tests.conftest import pythonpath
from tests.fakedata import write_cifar100, write_tinyimagenet

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
QUICK = ["--subsample", "600", "--partition", "iid", "--rounds", "1", "--no-progress", "--batch-size", "32"]
ROOT = Path(__file__).resolve().parents[1]


def train(tmp_path: Path, *args: str, name: str = "run") -> Path:
    assert train_main([*args, "--out-dir", str(tmp_path), "--run-name", name]) == 0
    return tmp_path / name


def cli_error(capsys, main, argv) -> str:
    code = run_cli("privfl.train", lambda: main(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@needs_fmnist
def test_fedre_capture_counts_and_three_way_split(tmp_path):
    run = train(tmp_path, "fedre", *QUICK)
    m = metrics(run)[-1]
    # FedRE paper: upload K*d = 5.12e3, broadcast K*(dC+C) = 51.30e3 (K=10, d=512, C=10)
    assert m["upload_scalars"] == 10 * 512 == 5120
    assert m["upload_scalars_full"] == 10 * (512 + 10)  # dense entangled label counted too
    assert m["broadcast_scalars"] == 10 * (512 * 10 + 10) == 51300
    assert m["upload_bytes"] == 4 * 10 * (512 + 10)
    assert (tmp_path / "latest").resolve() == run.resolve()
    capture = TensorStore(run / "capture", "capture")
    knowledge = TensorStore(run / "knowledge", "knowledge")
    truth = TensorStore(run / "truth", "truth")
    ups = [r for r in capture.records() if r["kind"] == "ent_rep"]
    assert len(ups) == 10 and capture.verify() == []
    # the capture holds no ground truth; truth is keyed by message seq
    assert all(set(r["tensors"]) == {"rep", "label"} for r in ups)
    truth_by_seq = {r["message_seq"]: r for r in truth.records()}
    know_by_client = {r["client"]: r for r in knowledge.records()}
    assert set(know_by_client) == {f"client{k}" for k in range(10)}
    # knowledge + truth rebuild exactly what was sent: extractor(samples) weighted by the RE weights
    from safetensors.torch import load_file

    from privfl.data import load_dataset

    data = load_dataset("fashionmnist")
    subset = load_file(str(run / "truth" / "partition.safetensors"))["subset"]
    for rec in ups[:3]:
        k = know_by_client[rec["sender"]]
        model = build_model(**k["spec"])
        model.load_extractor_state(knowledge.load(k))
        model.eval()
        t = truth.load(truth_by_seq[rec["seq"]])
        x = data.normalize(data.images[subset[t["indices"]]])
        with torch.no_grad():
            rebuilt = model.represent(x).double().T @ t["weights"]
        sent = capture.load(rec)
        assert torch.allclose(rebuilt.float(), sent["rep"], atol=1e-4)
        assert sent["label"].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_fedre_broadcast_counts_cifar100_and_tinyimagenet_d2048(tmp_path):
    write_cifar100(tmp_path / "data-c100")  # the data lives apart from the runs: a run never writes into a folder it did not create
    run = train(tmp_path, "fedre", "--dataset", "cifar100", "--data-root", str(tmp_path / "data-c100"), *QUICK, name="c100")
    m = metrics(run)[-1]
    assert (m["upload_scalars"], m["broadcast_scalars"]) == (5120, 513000)  # paper: 5.12e3 / 513.00e3
    write_tinyimagenet(tmp_path / "data-tiny")
    run = train(
        tmp_path,
        "fedre",
        "--dataset",
        "tinyimagenet",
        "--data-root",
        str(tmp_path / "data-tiny"),
        "--rep-dim",
        "2048",
        *QUICK,
        "--model-group",
        "homo-cnn4",
        name="tiny",
    )
    m = metrics(run)[-1]
    assert (m["upload_scalars"], m["broadcast_scalars"]) == (20480, 4098000)  # paper: 20.48e3 / 4098.00e3


@needs_fmnist
@pytest.mark.parametrize("method", ["fedgh", "fedproto"])
def test_prototype_upload_is_client_class_pairs_times_d(tmp_path, method):
    run = train(tmp_path, method, "--subsample", "1000", "--alpha", "0.3", "--rounds", "1", "--no-progress", "--min-samples", "8")
    from safetensors.torch import load_file

    split = load_file(str(run / "truth" / "partition.safetensors"))
    labels = None
    capture = TensorStore(run / "capture", "capture")
    ups = [r for r in capture.records() if r["direction"] == "up"]
    from privfl.data import load_dataset

    labels = load_dataset("fashionmnist").labels[split["subset"]]
    pairs = sum(len(labels[split[f"train_{k}"]].unique()) for k in range(10))
    assert metrics(run)[-1]["upload_scalars"] == pairs * 512
    assert sum(r["tensors"]["protos"]["shape"][0] for r in ups) == pairs
    down = [r for r in capture.records() if r["direction"] == "down" and r["round"] == 0 and r["meta"].get("phase") != "setup"]
    if method == "fedproto":
        assert all(r["kind"] == "global_proto" for r in down) and metrics(run)[-1]["broadcast_scalars"] == 10 * 10 * 512
    else:
        assert all(r["kind"] == "head" for r in down)


@needs_fmnist
def test_fedavg_averages_by_sample_count(tmp_path):
    run = train(tmp_path, "fedavg", *QUICK, "--model-group", "homo-cnn4", "--partition", "dir", "--alpha", "0.5", "--min-samples", "10")
    capture = TensorStore(run / "capture", "capture")
    recs = capture.records()
    ups = [r for r in recs if r["direction"] == "up"]
    down = [r for r in recs if r["direction"] == "down" and r["meta"].get("phase") == "train"][0]
    weights = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
    key = "features.0.weight"
    stacked = torch.stack([capture.load(r)[key].double() for r in ups])
    expected = (stacked * (weights / weights.sum()).view(-1, *[1] * (stacked.dim() - 1))).sum(0)
    assert torch.allclose(capture.load(down)[key].double(), expected, atol=1e-6)


def test_killed_run_resumes_to_identical_metrics_and_capture(assert_resumes_exactly):
    # on the CPU, where privfl promises the same numbers: three processes on a GPU pick their kernels each
    # (the in-process resume checks run deterministic kernels there, tests/conftest.py)
    assert_resumes_exactly(["fedre", *QUICK, "--rounds", "3", "--device", "cpu"], kill_round=1, kill_after=7, real_kill=True)


@needs_fmnist
def test_user_method_by_import_path(tmp_path, monkeypatch, capsys):
    """A method written outside privfl, as docs/extending.md shows: it trains and is captured; the same
    method written as earlier releases allowed (an upload without its sample count) fails at its first
    send with one line that says what to add, and leaves no run behind."""
    source = (
        "from privfl.methods import FLMethod\n"
        "from privfl.capture import Message\n"
        "class HeadOnly(FLMethod):\n"
        "    name = 'headonly'\n"
        "    sends = {'head': 'up'}\n"
        "    def run_round(self, rnd, selected):\n"
        "        for c in selected:\n"
        "            self.local_train(rnd, c)\n"
        "            tensors = {k: v.detach() for k, v in c.model.head.state_dict().items()}\n"
        "            self.send(Message(rnd, c.name, 'server', 'head', tensors, META))\n"
        "        return {}\n"
    )
    (tmp_path / "my_fl.py").write_text(source.replace("META", "{'num_samples': len(c.train_idx)}"))
    (tmp_path / "old_fl.py").write_text(source.replace("META", "{}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = train(tmp_path, "my_fl:HeadOnly", *QUICK)
    assert metrics(run)[-1]["upload_scalars"] == 10 * (512 * 10 + 10)

    err = cli_error(capsys, train_main, ["old_fl:HeadOnly", *QUICK, "--out-dir", str(tmp_path), "--run-name", "old"])
    assert "old_fl:HeadOnly" in err and "'head'" in err and "missing meta 'num_samples'" in err
    assert not (tmp_path / "old").exists()  # nothing half-written
    assert (tmp_path / "latest").resolve() == run.resolve()  # and `latest` still points at the last good run


def test_retired_hooks_and_bad_declarations_fail_when_loaded(tmp_path, monkeypatch, capsys):
    """Earlier releases' attacker hooks on a method are refused with one line before anything is created."""
    (tmp_path / "legacy_fl.py").write_text(
        "from privfl.methods import FLMethod\n"
        "class Hook(FLMethod):\n"
        "    sends = {'model': 'up/down'}\n"
        "    @classmethod\n"
        "    def leakage_module(cls, kind, req):\n"
        "        return None\n"
        "class Unknown(FLMethod):\n"
        "    sends = {'weights': 'up'}\n"
        "class Exposes(FLMethod):\n"
        "    sends = {'rep': 'up'}\n"
        "    exposes = ('weights',)\n"
        "class Legacy(FLMethod):\n"
        "    sends = {'small_model': 'up/down'}\n"
        "    parameter_kinds = {'small_model': 'small_model'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = ["--out-dir", str(tmp_path), "--run-name", "x", *QUICK]
    err = cli_error(capsys, train_main, ["legacy_fl:Hook", *out])
    assert "leakage_module is no longer called" in err and "LeakageContext" in err
    err = cli_error(capsys, train_main, ["legacy_fl:Exposes", *out])
    assert "exposes names 'weights'" in err and "accepted: extractor" in err
    err = cli_error(capsys, train_main, ["legacy_fl:Unknown", *out])
    assert "unknown kind 'weights'" in err and "register_kind" in err
    assert not (tmp_path / "x").exists()
    from privfl.methods import resolve_method

    legacy = resolve_method("legacy_fl:Legacy")  # the earlier {kind: previous kind} declaration still works
    ctx = legacy.leakage_context("small_model")
    assert ctx is not None and ctx.previous == "small_model"


@needs_fmnist
def test_config_file_equivalent_and_saved(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('method = "fedre"\nsubsample = 600\npartition = "iid"\nrounds = 1\nprogress = false\n[options]\nre = "vap"\nserver-batch = 5\n')
    run = train(tmp_path, "--config", str(cfg), "--lr", "0.05")
    saved = json.loads((run / "config.json").read_text())
    assert saved["options"]["re"] == "vap" and saved["options"]["server_batch"] == 5 and saved["lr"] == 0.05
    assert (run / "config.toml").read_text().count("vap") == 1
    up = [r for r in TensorStore(run / "capture", "capture").records() if r["kind"] == "ent_rep"][0]
    assert up["meta"]["re"] == "vap"
    # the saved TOML reproduces the run
    again = train(tmp_path, "--config", str(run / "config.toml"), name="again")
    assert metrics(again)[-1]["acc"] == metrics(run)[-1]["acc"]


def test_bad_input_gives_one_line_and_status_2(tmp_path, capsys):
    err = cli_error(capsys, train_main, ["fedrex"])
    assert "unknown method 'fedrex'" in err and "fedre" in err and "fedproto" in err
    assert "accepted" in cli_error(capsys, train_main, ["fedre", "--dataset", "svhn"])
    err = cli_error(capsys, train_main, ["fedre", "--dataset", "cifar10", "--data-root", str(tmp_path), "--out-dir", str(tmp_path)])
    assert "cifar" in err.lower() and "--download" in err
    err = cli_error(capsys, train_main, ["fedre", "--model-group", "huge"])
    assert "cpu5" in err and "htm10" in err
    err = cli_error(capsys, train_main, ["fedre", "--re", "xyz", "--out-dir", str(tmp_path)])
    assert "rap" in err
    (tmp_path / "bad.toml").write_text("roundz = 3\n")
    assert "roundz" in cli_error(capsys, train_main, ["--config", str(tmp_path / "bad.toml")])
    assert "not a valid int" in cli_error(capsys, train_main, ["fedre", "--rounds", "many"])
    assert not list(tmp_path.glob("fedre-*"))  # nothing half-written


def test_help_lists_catalogue(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    out = capsys.readouterr().out
    for word in ("fedre", "fedallrep", "fashionmnist", "tinyimagenet", "htm10", "cpu5", "dir", "longtail", "--join-ratio"):
        assert word in out, word
    with pytest.raises(SystemExit):
        train_main(["fedre", "--help"])
    out = capsys.readouterr().out
    assert "--re " in out and "--weight-dist" in out and "--sampling" in out


@needs_fmnist
def test_capture_cli_verify_detects_flipped_byte(tmp_path, capsys):
    from privfl.capture.__main__ import main as capture_main

    run = train(tmp_path, "fedre", *QUICK)
    assert capture_main(["--run", str(run), "verify"]) == 0
    assert capture_main(["--run", str(run), "list", "--kind", "ent_rep"]) == 0
    out = capsys.readouterr().out
    assert out.count("ent_rep") == 10
    rec = TensorStore(run / "capture", "capture").records()[-1]
    blob = TensorStore(run / "capture", "capture").blob_path(rec["sha256"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert capture_main(["--run", str(run), "verify"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    code = run_cli("privfl.capture", lambda: capture_main(["--run", str(run), "list", "--kind", "weights"]))
    assert code == 2 and "ent_rep" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "papers" / "fedre").glob("*.toml")), ids=lambda p: p.stem)
def test_paper_configs_are_valid(path):
    from privfl.config import build_config, read_config_file
    from privfl.models import assign_archs

    values = read_config_file(path)
    cfg = build_config(values, METHODS.get(values["method"]).Options)
    assert cfg.rounds == 100 and cfg.options["server_lr"] == 0.01 and cfg.options["server_batch"] == 10
    assert len(assign_archs(cfg.model_group, cfg.num_clients)) == cfg.num_clients


def test_real_processes_exit_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    for argv in (["privfl.train", "fedrex"], ["privfl.capture", "--run", str(tmp_path / "none"), "verify"]):
        proc = subprocess.run([sys.executable, "-m", *argv], check=False, env=env, cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(argv[0]), proc.stderr


@needs_fmnist
def test_defenses_apply_through_the_channel_and_survive_resume(tmp_path):
    from privfl.config import build_config, load_saved_config
    from privfl.engine import Trainer

    run = train(
        tmp_path,
        "fedavg",
        *QUICK,
        "--rounds",
        "2",
        "--model-group",
        "homo-cnn4",
        "--defense",
        "dp:max_norm=1.0,noise_multiplier=1.0",
        "--defense",
        "quantize:bits=8",
    )
    summary = json.loads((run / "summary.json").read_text())
    dp = next(v for k, v in summary["defenses"].items() if k.startswith("dp:"))
    assert set(dp["epsilon"]) == {f"client{k}" for k in range(10)} and all(e > 0 for e in dp["epsilon"].values())
    assert all(n == 2 for n in dp["steps"].values())
    # the capture holds defended uploads: every update relative to the broadcast has norm <= 1 + noise
    capture = TensorStore(run / "capture", "capture")
    recs = capture.records()
    broadcast = capture.load([r for r in recs if r["direction"] == "down" and r["round"] == 0 and r["meta"].get("phase") == "setup"][0])
    up = capture.load([r for r in recs if r["direction"] == "up" and r["round"] == 0][0])
    quantised = up["features.0.weight"] - broadcast["features.0.weight"]
    assert len(quantised.unique()) <= 256  # quantize:bits=8 ran after dp
    # resume restores the accountant exactly
    cfg = build_config(load_saved_config(run), METHODS.get("fedavg").Options)
    trainer = Trainer(cfg, run, resume=True)
    trainer.load_checkpoint()
    restored = next(d for d in trainer.defenses if d.name == "dp").report()
    assert restored["epsilon"] == dp["epsilon"] and restored["steps"] == dp["steps"]


@pytest.mark.parametrize("bad", [["--knowledge-rounds", "0,7"], ["--partition", "nope"], ["--knowledge-rounds", "first"]])
def test_bad_run_options_are_refused_before_the_output_folder_exists(tmp_path, capsys, bad):
    out = tmp_path / "not-yet"
    err = cli_error(capsys, train_main, ["fedavg", "--rounds", "2", "--out-dir", str(out), *bad])
    assert "\n" not in err.strip() and ("--knowledge-rounds" in err or "partition scheme" in err)
    assert not out.exists()


@pytest.mark.parametrize("name", ["..", "../outside", "a/b", ".hidden"])
def test_a_run_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, capsys, name):
    out = tmp_path / "runs"
    err = cli_error(capsys, train_main, ["fedavg", "--rounds", "1", "--out-dir", str(out), "--run-name", name])
    assert "--run-name must be a plain folder name" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_existing_folder_that_is_not_a_run_is_never_written_into_or_removed(tmp_path, capsys):
    """A failed setup removes the run folder, so the run folder must be one this invocation creates."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file\n")
    err = cli_error(capsys, train_main, ["fedavg", "--partition", "nope", "--out-dir", str(tmp_path), "--run-name", "mine"])
    assert "already exists and is not a run" in err
    assert (mine / "notes.txt").read_text() == "a user's file\n"


@needs_fmnist
def test_evaluation_protocols_agree_with_each_other_and_leave_training_alone(tmp_path):
    """``--eval both`` reports exactly what ``global`` and ``personal`` report on their own: the swap of a
    client's own head in and out for the personal score changes nothing else (the global numbers and the
    capture are those of a global-only run), and summary.json carries both protocols."""
    args = ["fedre", "--subsample", "600", "--partition", "dir", "--rounds", "3", "--join-ratio", "0.5", "--no-progress", "--batch-size", "32"]
    runs = {e: train(tmp_path, *args, "--eval", e, name=e) for e in ("global", "personal", "both")}
    m = {e: metrics(r) for e, r in runs.items()}
    assert [h["acc"] for h in m["both"]] == [h["acc"] for h in m["global"]]
    assert [h["acc_personal"] for h in m["both"]] == [h["acc"] for h in m["personal"]]
    assert [h["client_acc_personal"] for h in m["both"]] == [h["client_acc"] for h in m["personal"]]
    assert any(h["acc_personal"] != h["acc"] for h in m["both"])  # FedRE's broadcast head does overwrite something
    assert "acc_personal" not in m["global"][0] and "acc_personal" not in m["personal"][0]
    sha = {e: [r["sha256"] for r in TensorStore(run / "capture", "capture").records()] for e, run in runs.items()}
    assert sha["both"] == sha["global"] == sha["personal"]
    summary = json.loads((runs["both"] / "summary.json").read_text())
    assert summary["eval"] == "both"
    assert summary["final_acc_personal"] == m["both"][-1]["acc_personal"]
    assert summary["best_acc_personal"] == max(h["acc_personal"] for h in m["both"])
    from privfl.verify import verify_run

    assert verify_run(runs["both"]).ok


@needs_fmnist
def test_a_method_whose_broadcast_overwrites_nothing_scores_the_same_under_both_protocols(tmp_path):
    run = train(tmp_path, "local", *QUICK, "--rounds", "2", "--eval", "both")
    assert all(h["acc_personal"] == h["acc"] and h["client_acc_personal"] == h["client_acc"] for h in metrics(run))


def test_drop_last_and_fixed_order_batches():
    from privfl.fl.method import DataView

    view = DataView(torch.zeros(7, 1, 2, 2, dtype=torch.uint8), torch.arange(7), (0.0,), (1.0,), torch.device("cpu"))
    idx = torch.tensor([5, 1, 3, 6, 0, 2, 4])
    assert [y.tolist() for _, y in view.batches(idx, 3)] == [[5, 1, 3], [6, 0, 2], [4]]
    assert [y.tolist() for _, y in view.batches(idx, 3, drop_last=True)] == [[5, 1, 3], [6, 0, 2]]
    assert list(view.batches(idx[:2], 3, drop_last=True)) == []  # a client smaller than a batch trains nothing


def test_an_epochs_last_single_sample_is_skipped_for_batchnorm_models_only():
    from privfl.config import build_config, saved_run_values
    from privfl.fl.method import DataView
    from privfl.fl.trainer import batches_per_epoch, min_train_batch

    view = DataView(torch.zeros(7, 1, 2, 2, dtype=torch.uint8), torch.arange(7), (0.0,), (1.0,), torch.device("cpu"))
    idx = torch.arange(7)
    assert [y.tolist() for _, y in view.batches(idx, 3, min_batch=2)] == [[0, 1, 2], [3, 4, 5]]  # 7 = 2 x 3 + 1
    assert [y.tolist() for _, y in view.batches(idx[:5], 3, min_batch=2)] == [[0, 1, 2], [3, 4]]  # a last batch of 2 stays
    assert [y.tolist() for _, y in view.batches(idx, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert (batches_per_epoch(7, 3), batches_per_epoch(7, 3, min_batch=2), batches_per_epoch(7, 3, drop_last=True)) == (3, 2, 2)
    assert (batches_per_epoch(1, 32, min_batch=2), batches_per_epoch(1, 32), batches_per_epoch(64, 32, min_batch=2)) == (0, 1, 2)
    resnet, cnn4 = (build_model(a, in_channels=1, num_classes=10, image_size=28) for a in ("resnet-tiny", "cnn4"))
    cfg = build_config({}, None)
    assert (min_train_batch(resnet, cfg), min_train_batch(cnn4, cfg)) == (2, 1)
    old_run = build_config(saved_run_values({"method": "fedre"}), None)  # saved before the option: every batch, as then
    assert (min_train_batch(resnet, old_run), min_train_batch(cnn4, old_run)) == (1, 1)


@needs_fmnist
def test_a_batchnorm_client_one_sample_past_its_full_batches_trains(tmp_path):
    """ResNet-18 reaches a 1x1 map on 28 px, where BatchNorm refuses a batch of one ("Expected more than 1
    value per channel"): 60 training samples in batches of 59 crashed the run before the last sample was skipped."""
    run = train(tmp_path, "local", "--subsample", "80", "--num-clients", "1", "--partition", "iid", "--model-group", "homo-resnet18",
                "--batch-size", "59", "--rounds", "1", "--no-progress")  # fmt: skip
    assert json.loads((run / "partition.json").read_text())["train_sizes"] == [60]
    assert len(metrics(run)) == 1
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):  # as before, if asked for
        train(tmp_path, "local", "--subsample", "80", "--num-clients", "1", "--partition", "iid", "--model-group", "homo-resnet18",
              "--batch-size", "59", "--rounds", "1", "--no-progress", "--batchnorm-min-batch", "1", name="every-batch")  # fmt: skip


@needs_fmnist
def test_same_init_gives_clients_of_one_architecture_one_initialisation(tmp_path):
    """The initial weights, checked on the models the engine builds (before any training)."""
    from privfl.config import build_config
    from privfl.engine import Trainer

    def initial(same: bool) -> list[torch.Tensor]:
        values = {"method": "local", "subsample": 600, "partition": "iid", "same_init": same, "out_dir": str(tmp_path), "progress": False}
        cfg = build_config(values, None)
        trainer = Trainer(cfg, tmp_path / f"init-{same}")
        return [next(iter(c.model.parameters())).detach().clone() for c in trainer.clients]

    same, own = initial(True), initial(False)
    assert torch.equal(same[0], same[5]) and not torch.equal(own[0], own[5])  # clients 0 and 5 share cnn4-narrow in cpu5


@needs_fmnist
def test_fedproto_training_prototypes_are_the_steps_representations(tmp_path):
    """``--prototypes training`` averages what the training steps computed: with a step size too small to
    move the weights (and cnn4's train and eval forwards being the same function) that is the pass's mean,
    over one epoch or two (each sample counted once per epoch); ``counts`` stays the split's class sizes
    even when ``--drop-last`` leaves samples out; at the usual step size the two differ."""
    common = ["fedproto", *QUICK, "--model-group", "homo-cnn4", "--partition", "dir", "--alpha", "0.5", "--min-samples", "10"]

    def uploads(name: str, *extra: str) -> list[dict[str, torch.Tensor]]:
        store = TensorStore(train(tmp_path, *common, *extra, name=name) / "capture", "capture")
        return [store.load(r) for r in store.records() if r["kind"] == "proto"]

    tiny = ("--lr", "1e-12")
    passed = uploads("pass", *tiny)
    for name, extra in (("one", ()), ("two", ("--local-epochs", "2")), ("drop", ("--drop-last", "--batch-size", "7"))):
        got = uploads(name, *tiny, *extra, "--prototypes", "training")
        assert len(got) == len(passed) == 10
        missing, moved_by_drop = 0, 0
        for a, b in zip(passed, got, strict=True):
            if name != "drop":
                assert torch.equal(a["classes"], b["classes"]) and torch.equal(a["counts"], b["counts"]), name
                assert torch.allclose(a["protos"], b["protos"], atol=1e-5), name
                continue
            # a class whose every sample fell in a dropped last batch has no prototype; the others keep their split's count
            at = torch.searchsorted(a["classes"], b["classes"])
            assert torch.equal(a["classes"][at], b["classes"]) and torch.equal(a["counts"][at], b["counts"])
            missing += len(a["classes"]) - len(b["classes"])
            moved_by_drop += not torch.allclose(a["protos"][at], b["protos"], rtol=1e-3, atol=1e-6)  # fewer samples averaged
        assert name != "drop" or (missing > 0 and moved_by_drop > 0)  # both cases occur in this partition
    moved = uploads("moved", "--prototypes", "training")
    assert not torch.allclose(moved[0]["protos"], uploads("moved-pass")[0]["protos"], atol=1e-3)


@needs_fmnist
def test_a_diverged_training_is_reported_where_and_when(tmp_path, capsys):
    """lr 1e6 sends the loss to NaN within three rounds: the run still ends and scores, one line on stderr
    says which metric went non-finite in which round, summary.json keeps it, the summary table shows it."""
    run = train(tmp_path, "local", *QUICK, "--rounds", "3", "--lr", "1e6", "--model-group", "homo-cnn4")
    losses = [h["train_loss"] for h in metrics(run)]
    first = next(r for r, loss in enumerate(losses) if not math.isfinite(loss))
    assert json.loads((run / "summary.json").read_text())["nonfinite"] == {"train_loss": first}
    out = capsys.readouterr()
    assert out.err.count("train_loss is") == 1 and f"privfl: round {first}: train_loss is" in out.err  # once, when it starts
    assert "non-finite (training diverged)" in out.out and f"train_loss from round {first}" in out.out
    healthy = train(tmp_path, "local", *QUICK, "--model-group", "homo-cnn4", name="healthy")
    assert json.loads((healthy / "summary.json").read_text())["nonfinite"] == {}
