"""End-to-end training runs on small real data: a user's method by import path, a config file that
reproduces its run, the evaluation protocols, batching rules (drop-last, BatchNorm's single-sample batches),
the same initialisation per architecture, and a diverged training reported where and when."""

from __future__ import annotations

import json
import math

import pytest
import torch

from privfl.capture import TensorStore
from privfl.models import build_model
from privfl.train import main as train_main
from tests.helpers import QUICK, cli_error, needs_fmnist, read_metrics, train


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
    assert read_metrics(run)[-1]["upload_scalars"] == 10 * (512 * 10 + 10)

    err = cli_error(capsys, train_main, ["old_fl:HeadOnly", *QUICK, "--out-dir", str(tmp_path), "--run-name", "old"])
    assert "old_fl:HeadOnly" in err and "'head'" in err and "missing meta 'num_samples'" in err
    assert not (tmp_path / "old").exists()  # nothing half-written
    assert (tmp_path / "latest").resolve() == run.resolve()  # and `latest` still points at the last good run


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
    assert read_metrics(again)[-1]["acc"] == read_metrics(run)[-1]["acc"]


@needs_fmnist
def test_evaluation_protocols_agree_with_each_other_and_leave_training_alone(tmp_path):
    """``--eval both`` reports exactly what ``global`` and ``personal`` report on their own: the swap of a
    client's own head in and out for the personal score changes nothing else (the global numbers and the
    capture are those of a global-only run), and summary.json carries both protocols."""
    args = ["fedre", "--subsample", "600", "--partition", "dir", "--rounds", "3", "--join-ratio", "0.5", "--no-progress", "--batch-size", "32"]
    runs = {e: train(tmp_path, *args, "--eval", e, name=e) for e in ("global", "personal", "both")}
    m = {e: read_metrics(r) for e, r in runs.items()}
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
    assert all(h["acc_personal"] == h["acc"] and h["client_acc_personal"] == h["client_acc"] for h in read_metrics(run))


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
    assert len(read_metrics(run)) == 1
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
def test_a_diverged_training_is_reported_where_and_when(tmp_path, capsys):
    """lr 1e6 sends the loss to NaN within three rounds: the run still ends and scores, one line on stderr
    says which metric went non-finite in which round, summary.json keeps it, the summary table shows it."""
    run = train(tmp_path, "local", *QUICK, "--rounds", "3", "--lr", "1e6", "--model-group", "homo-cnn4")
    losses = [h["train_loss"] for h in read_metrics(run)]
    first = next(r for r, loss in enumerate(losses) if not math.isfinite(loss))
    assert json.loads((run / "summary.json").read_text())["nonfinite"] == {"train_loss": first}
    out = capsys.readouterr()
    assert out.err.count("train_loss is") == 1 and f"privfl: round {first}: train_loss is" in out.err  # once, when it starts
    assert "non-finite (training diverged)" in out.out and f"train_loss from round {first}" in out.out
    healthy = train(tmp_path, "local", *QUICK, "--model-group", "homo-cnn4", name="healthy")
    assert json.loads((healthy / "summary.json").read_text())["nonfinite"] == {}
