"""The paper-table helper (experiments/papers/tables.py), the table scripts and the FedRE toy (experiments/papers/fedre/toy2d.py).

Tiny runs: the toy2d dataset (500 generated 2-D points, two MLP clients) and, for the FedRE script, a
300-sample Fashion-MNIST subset with 3 clients and one round.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from experiments.papers import tables
from experiments.papers.fedre import table1 as fedre_table1
from experiments.papers.fedre import toy2d
from privfl.cli import ArgumentParser, run_cli
from privfl.errors import ConfigError


def toy_table(rows: list[tables.Row], rounds: int = 1, seeds: tuple[int, ...] = (0,)) -> tables.Table:
    return tables.Table("test", "test table", rows, {**toy2d.TOY_BASE, "rounds": rounds}, list(seeds), paper_acc="paper", paper_comm="paper")


def test_table_has_both_protocols_and_comm_and_resumes_without_retraining(tmp_path, monkeypatch):
    rows = [
        tables.Row("Local", "local", paper={"acc": "1.00", "up": 0.0, "bc": 0.0}),
        tables.Row("FedGH", "fedgh", paper={"acc": "2.00", "up": 2.05}),
    ]
    table = toy_table(rows)
    lines: list[str] = []
    result = tables.run_table(table, tmp_path, log=lines.append)
    assert result["failed"] == 0 and [r["label"] for r in result["rows"]] == ["Local", "FedGH"]
    local, fedgh = result["rows"]
    for agg in (local, fedgh):
        for key in ("final_acc", "best_acc", "final_acc_personal", "best_acc_personal", "upload_e3", "broadcast_e3", "seconds_per_round"):
            assert agg[key] is not None, key
    assert local["upload_e3"] == 0 and local["broadcast_e3"] == 0
    # FedGH on toy2d: 4 (client, class) prototypes of d = 512 up, the Linear(512, 4) head to each of 2 clients down
    assert fedgh["upload_e3"] == 2.05 and fedgh["broadcast_e3"] == 4.1 and fedgh["paper_acc"] == "2.00"
    assert sum("trained in" in line for line in lines) == 2
    header = next(csv.reader((tmp_path / "table.csv").open()))
    assert {"final_acc", "final_acc_personal", "best_acc_personal", "upload_e3", "broadcast_e3", "paper_acc"} <= set(header)
    md = (tmp_path / "table.md").read_text()
    assert "personal final" in md and "Up ×10³" in md and "paper Up (paper)" in md and "| FedGH |" in md
    assert json.loads((tmp_path / "table.json").read_text())["runs"]["FedGH"]["0"]["status"] == "trained"

    # a second run of the table reads every run (training would fail) and gives the same table
    import privfl.train as training

    def no_training(*args, **kwargs):
        raise AssertionError("retrained a finished run")

    monkeypatch.setattr(training, "train_config", no_training)
    lines.clear()
    again = tables.run_table(table, tmp_path, log=lines.append)
    assert sum("already trained, not retrained" in line for line in lines) == 2
    assert again["rows"] == result["rows"]
    # the same folder with other settings is refused, not mixed in
    with pytest.raises(ConfigError, match="trained with other settings"):
        tables.run_table(toy_table(rows, rounds=2), tmp_path, log=lines.append)

    # the figure of the toy reads the runs back
    toy2d.plot(table, again, 0, tmp_path / "toy.png", steps=21)
    assert (tmp_path / "toy.png").stat().st_size > 0


def test_a_killed_run_is_continued(tmp_path):
    from privfl.config import build_config
    from privfl.engine import TrainCallback
    from privfl.methods import resolve_method
    from privfl.train import train_config as train

    class Kill(TrainCallback):
        def on_round_end(self, rnd, entry):
            raise RuntimeError("killed")

    table = toy_table([tables.Row("Local", "local")], rounds=2)
    values = tables.run_values(table, table.rows[0], 0, tmp_path / "runs" / "local-s0")
    with pytest.raises(RuntimeError, match="killed"):
        train(build_config(values, resolve_method("local").Options), callbacks=[Kill()])
    assert not (tmp_path / "runs" / "local-s0" / "summary.json").exists()
    lines: list[str] = []
    result = tables.run_table(table, tmp_path, log=lines.append)
    assert result["runs"]["Local"]["0"]["status"] == "resumed" and result["runs"]["Local"]["0"]["rounds"] == 2
    assert any("continued a killed run" in line for line in lines)


def test_a_missing_method_is_one_line_and_exit_2(tmp_path, capsys):
    table = toy_table([tables.Row("Local", "local"), tables.Row("Ghost", "nosuchmethod")])
    parser = ArgumentParser(prog="t")
    tables.add_arguments(parser, out=str(tmp_path / "out"))
    code = tables.main_for("t", parser, lambda args: table, [])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Ghost (nosuchmethod)" in err and "--skip-missing" in err
    assert not (tmp_path / "out").exists()  # refused before anything was trained or written

    code = tables.main_for("t", parser, lambda args: table, ["--skip-missing"])
    out = capsys.readouterr().out
    assert code == 0 and "skipped (method not registered): Ghost (nosuchmethod)" in out
    result = json.loads((tmp_path / "out" / "table.json").read_text())
    assert [r["label"] for r in result["rows"]] == ["Local"] and result["skipped"][0]["method"] == "nosuchmethod"


def test_fedre_script_rows_and_missing_rows(tmp_path, capsys, fmnist, monkeypatch):
    # a paper row whose method privfl does not have stops the script, naming it (FedALA made unknown here)
    monkeypatch.setitem(fedre_table1.METHOD_OF, "FedALA", "fedala-not-registered")
    code = fedre_table1.main(["--homo", "--methods", "fedala-not-registered,local", "--out", str(tmp_path / "homo")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "FedALA (fedala-not-registered)" in err
    assert not (tmp_path / "homo").exists()
    assert run_cli("x", lambda: fedre_table1.main(["--methods", "nosuch"])) == 2

    out = tmp_path / "t1"
    argv = ["--methods", "local,fedgh", "--subsample", "300", "--rounds", "1", "--seeds", "0", "--num-clients", "3", "--out", str(out)]
    assert fedre_table1.main(argv) == 0
    result = json.loads((out / "table.json").read_text())
    rows = {r["label"]: r for r in result["rows"]}
    assert set(rows) == {"FedGH", "Local"}
    assert rows["FedGH"]["paper_acc"] == "78.66±0.34" and rows["FedGH"]["paper_up_e3"] == 31.23 and rows["FedGH"]["paper_bc_e3"] == 51.2
    assert rows["FedGH"]["broadcast_e3"] == 15.39  # the Linear(512, 10) head to 3 clients
    assert rows["FedGH"]["final_acc_personal"] is not None and rows["Local"]["upload_e3"] == 0


def test_toy_split_is_300_200_and_follows_the_seed():
    from privfl.data import load_dataset, partition_indices, split_train_test
    from privfl.data.toy import make_toy2d, toy2d_points

    data = load_dataset("toy2d")
    assert data.images.shape == (500, 1, 2, 2) and data.labels.bincount().tolist() == [125] * 4
    assert np.array_equal(data.images[:, :, 0], data.images[:, :, 1])  # the point on both rows
    again = make_toy2d(0)
    assert np.array_equal(data.images.numpy(), again.images.numpy()) and np.array_equal(data.labels.numpy(), again.labels.numpy())
    assert not np.array_equal(make_toy2d(1).images.numpy(), data.images.numpy())
    assert np.abs(toy2d_points(data.images)).max() <= 7.0

    base = toy2d.TOY_BASE

    def split(seed: int):
        labels = data.labels.numpy()
        parts = partition_indices(labels, base["num_clients"], base["partition"], seed, classes_per_client=2, balanced=base["balanced"])
        return split_train_test(parts, base["train_fraction"], seed)

    first = split(0)
    assert [len(t) for t in first.train] == [150, 150] and [len(t) for t in first.test] == [100, 100]
    labels = data.labels.numpy()
    assert all(len(set(labels[np.concatenate([tr, te])])) == 2 for tr, te in zip(first.train, first.test))
    same = split(0)
    assert all(np.array_equal(a, b) for a, b in zip(first.train + first.test, same.train + same.test))
    other = split(1)
    assert not all(np.array_equal(a, b) for a, b in zip(first.train, other.train))


def test_drdfl_table_reports_local_t_global_t_and_total_comm(tmp_path, fmnist):
    from experiments.papers.drdfl import table1 as drdfl_table1

    table = drdfl_table1.build(drdfl_table1.parser().parse_args([]))
    rows = {r.label: r for r in table.rows}
    assert list(rows) == ["Local", "FedRep", "FedNova", "FedBN", "FedFed", "DFedPGP", "FedCVAE", "DisPFL", "DRDFL"]
    assert all(rows[label].options.get("topology") == "ring" for label in ("DFedPGP", "FedCVAE", "DisPFL"))
    assert rows["FedRep"].options == {"body_epochs": 4, "head_epochs": 1} and table.base["global_test"] == 1000
    assert rows["DRDFL"].paper == {"local_t": "92.91", "global_t": "28.19", "comm": "0.58 M"}  # C10 Dir(0.1), Table I
    shard = drdfl_table1.build(drdfl_table1.parser().parse_args(["--setting", "shard4"]))
    assert next(r for r in shard.rows if r.label == "FedNova").paper == {"local_t": "88.12", "global_t": "33.51", "comm": "213.45 M"}

    out = tmp_path / "d"
    argv = ["--methods", "local,drdfl", "--subsample", "400", "--rounds", "2", "--seeds", "0", "--num-clients", "4", "--out", str(out)]
    assert drdfl_table1.main(argv) == 0
    result = json.loads((out / "table.json").read_text())
    got = {r["label"]: r for r in result["rows"]}
    for agg in got.values():
        for key in ("final_local_t_personal", "final_global_t_personal", "last10_local_t_personal", "last10_global_t_personal"):
            assert agg[key] is not None and 0 <= agg[key] <= 100, key
    run = json.loads((out / "runs" / "drdfl-s0" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "runs" / "drdfl-s0" / "metrics.jsonl").read_text().splitlines()]
    assert got["DRDFL"]["last10_global_t_personal"] == round(100 * np.mean([m["global_t_personal"] for m in metrics]), 2)
    assert got["DRDFL"]["final_local_t_personal"] == round(100 * run["final_local_t_personal"], 2)
    assert got["Local"]["comm_m"] == 0 and got["DRDFL"]["comm_m"] == round(run["per_round"]["peer_scalars"] / 1e6, 4) > 0
    md = (out / "table.md").read_text()
    assert "Global-T last-10" in md and "#Comm M/round" in md and "paper L (C10 dir0.1, ref.)" in md


def test_new_clients_script_compares_drdfl_with_dispfl_and_never_overwrites(tmp_path, fmnist, capsys):
    from experiments.papers.drdfl import new_clients

    out = tmp_path / "nc"
    argv = ["--old", "2", "--new", "1", "--stage1", "1", "--stage2", "1", "--subsample", "400", "--out", str(out)]
    assert new_clients.main([*argv, "--rows", "DRDFL (Learngene init),DisPFL"]) == 0
    result = json.loads((out / "new_clients.json").read_text())
    assert set(result["curves"]) == {"DRDFL (Learngene init)", "DisPFL"} and all(len(c) == 1 for c in result["curves"].values())
    assert (out / "new_clients.png").stat().st_size > 0
    dispfl = json.loads((out / "dispfl" / "metrics.jsonl").read_text().splitlines()[-1])
    key = "client_acc_personal" if "client_acc_personal" in dispfl else "client_acc"
    assert result["curves"]["DisPFL"][0] == pytest.approx(dispfl[key][2])  # the new client's own accuracy
    assert run_cli("x", lambda: new_clients.main(argv)) == 2  # the folder is not empty: refused, nothing deleted
    assert (out / "new_clients.json").exists()
