"""The leaderboard: one partition for every method, cells keyed by content, a killed leaderboard resumed to
the same table, intervals over seeds, ranks only where intervals separate, the frontier, refusals."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attacks import leaderboard as lb
from attacks import leaderboard_report as lb_report
from attacks.audit import Profile
from attacks.audit_report import LEAKS, NO_EVIDENCE
from attacks.leaderboard_report import MEASURES, _pareto, _verdict, build_rows, combine, ranks
from tests.helpers import FMNIST, ROOT, pythonpath

#: the audit's tiny test profile without a model group, so that the leaderboard's rule chooses one per method
BOARD = Profile(
    "tiny-board",
    "the test suite's: 600 samples, 2 rounds, 1 client, a few steps",
    {"subsample": 600, "rounds": 2, "partition": "dir", "alpha": 0.3, "min_samples": 8, "batch_size": 32},
    1,
    {"invert": {"steps": 2, "input_depth": 4}, "dlg": {"steps": 1, "lbfgs_max_iter": 2}, "idlg": {"steps": 1, "lbfgs_max_iter": 2},
     "ig": {"steps": 2}, "mia-loss": {"queries": 40}, "mia-lira": {"queries": 40, "population": 80, "shadows": 2, "shadow_epochs": 1},
     "mia-rmia": {"queries": 40, "population": 80, "shadows": 2, "shadow_epochs": 1}, "mia-logits": {"queries": 40, "population": 80},
     "invert-head": {"steps": 5, "shifts": 0, "population": 80}, "invert-learned": {"steps": 5, "shifts": 0, "population": 80},
     "invert-substitute": {"steps": 5, "shifts": 0, "population": 80, "substitute_steps": 5}},
)  # fmt: skip
METHODS = ["local", "fedavg", "fedproto"]


def _one_thread():
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    return threadpool_limits(1)


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    import torch

    out = tmp_path_factory.mktemp("board") / "lb"
    threads = torch.get_num_threads()
    try:
        with _one_thread():
            result = lb.leaderboard(METHODS, seeds=[0, 1], profile=BOARD, out=out, device="cpu", progress=False, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return result


def _numbers(table: dict) -> list[dict]:
    """The rows without what legitimately differs between two invocations (timings, folders, ranks among other rows)."""
    keep = []
    for r in table["rows"]:
        cells = {k: {x: v for x, v in s.items() if x != "rank"} for k, s in r["cells"].items()}
        fams = {f: {**d, "per_seed": [{k: v for k, v in s.items() if k != "folder"} for s in d["per_seed"]]} for f, d in r["families"].items()}
        keep.append({"label": r["label"], "cells": cells, "families": fams, "model_group": r["model_group"], "upload": r["upload_bytes"]})
    return keep


def test_every_method_is_trained_on_one_partition_and_the_outputs_are_written(board):
    t = board.table
    assert [r["label"] for r in t["rows"]] == METHODS and t["seeds"] == [0, 1] and t["warnings"] == []
    assert t["cells_computed"] == 6 and t["cells_reused"] == 0 and t["wall_seconds"] > 0
    parts = {(c["seed"], c["partition"]) for c in t["cells"]}
    assert len(parts) == 2 and all(p for _, p in parts)  # one partition per seed, shared by the three methods
    rows = {r["method"]: r for r in t["rows"]}
    # the audit's rule: FedAvg needs one architecture and gets the mixed group's homogeneous counterpart
    assert rows["fedavg"]["model_group"] == ["homo-cnn4"] and rows["fedproto"]["model_group"] == ["cpu5"]
    assert t["setting"]["model_groups"] == {"heterogeneous": ["cpu5"], "homogeneous": ["homo-cnn4"]}
    assert rows["local"]["sends"] == [] and rows["local"]["families"] == {} and rows["local"]["leaks"] == []
    assert rows["fedavg"]["upload_bytes"] > rows["fedproto"]["upload_bytes"] > 0
    acc = rows["fedavg"]["cells"]["acc_global"]
    assert acc["n"] == 2 and acc["low"] <= acc["mean"] <= acc["high"] and acc["interval"] == "Student's t over 2 seeds"
    assert rows["fedproto"]["families"]["labels"]["verdict"]["leaks_seeds"] == 2 and "labels" in rows["fedproto"]["leaks"]
    for fam in rows["fedavg"]["families"].values():  # every family names its attacks and the SoK class of their threat model
        assert fam["attacks"] and fam["sok"] and fam["verdict"]["text"]
    for name in ("leaderboard.html", "leaderboard.json", "leaderboard.md", "leaderboard.csv", "leaderboard_cells.csv", "frontier.png"):
        assert (board.folder / name).is_file(), name
    assert json.loads(board.json.read_text())["schema"] == "privfl-leaderboard/1"
    lines = board.csv.read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("method,defenses,model_group,seeds")
    page = board.html.read_text()
    assert "sortable" in page and "data:image/png;base64," in page and "SoK" in page and "fedproto" in page
    for r in t["rows"]:  # every cell keeps its own audit report, linked from the row
        assert all(Path(p).is_file() for p in r["reports"]) and len(r["reports"]) == 2


def test_a_finished_leaderboard_run_again_reuses_every_cell_and_gives_the_same_table(board):
    with _one_thread():
        again = lb.leaderboard(METHODS, seeds=[0, 1], profile=BOARD, out=board.folder, device="cpu", progress=False, log=lambda _: None)
    assert again.table["cells_reused"] == 6 and again.table["cells_computed"] == 0
    assert _numbers(again.table) == _numbers(board.table)


def test_a_killed_leaderboard_resumes_to_the_table_of_an_uninterrupted_one(board, tmp_path, monkeypatch):
    """Killed while its second cell trains (two methods, seed 0: the board's cheapest pair of cells, which the
    board already holds), resumed: the finished cell is reused, the half-made one trained again, and the
    table is the one the board's own cells give."""
    import shutil

    methods, out = ["local", "fedproto"], tmp_path / "lb"
    real = lb.run_cell
    calls = []

    def dies_on_the_second(cell, folder, *a, **k):
        calls.append(cell)
        if len(calls) == 2:  # killed while the second cell trains: its folder holds a half-made cell
            Path(folder).mkdir(parents=True, exist_ok=True)
            raise KeyboardInterrupt
        return real(cell, folder, *a, **k)

    monkeypatch.setattr(lb, "run_cell", dies_on_the_second)
    with _one_thread(), pytest.raises(KeyboardInterrupt):
        lb.leaderboard(methods, seeds=[0], profile=BOARD, out=out, device="cpu", progress=False, log=lambda _: None)
    assert len(list(out.glob("cells/*/cell.json"))) == 1 and len(list(out.glob("cells/*"))) == 2
    monkeypatch.setattr(lb, "run_cell", real)
    with _one_thread():
        resumed = lb.leaderboard(methods, seeds=[0], profile=BOARD, out=out, device="cpu", progress=False, log=lambda _: None)
    assert resumed.table["cells_reused"] == 1 and resumed.table["cells_computed"] == 1
    first, second = resumed.table["invocations"]  # the killed one counts until its last finished cell
    assert (first["cells"], first["ended"], second["cells"], second["ended"]) == (1, False, 1, True)
    assert resumed.table["total_wall_seconds"] >= first["seconds"] + second["seconds"] - 0.2
    # the uninterrupted table: the board's own cells of these methods and seed, reused in a copy (the board's outputs stay as they are)
    shutil.copytree(board.folder, tmp_path / "uninterrupted")
    with _one_thread():
        whole = lb.leaderboard(methods, seeds=[0], profile=BOARD, out=tmp_path / "uninterrupted", device="cpu", progress=False, log=lambda _: None)
    assert whole.table["cells_reused"] == 2 and whole.table["cells_computed"] == 0
    assert _numbers(resumed.table) == _numbers(whole.table)
    assert [{k: c.get("rank") for k, c in r["cells"].items()} for r in resumed.table["rows"]] == [
        {k: c.get("rank") for k, c in r["cells"].items()} for r in whole.table["rows"]
    ]


def test_a_changed_setting_never_reads_a_stale_cell(board, tmp_path):
    """Another learning rate, dataset contents, code or profile is another key, so another folder."""
    cells, _ = lb.plan(["fedavg"], [0], [], BOARD, train_options={}, device="cpu", data_root=None)
    other, _ = lb.plan(["fedavg"], [0], [], BOARD, train_options={"lr": 0.02}, device="cpu", data_root=None)
    assert cells[0].key != other[0].key and cells[0].folder_name != other[0].folder_name
    base = {"data": "d", "code": "c", "device_type": "cpu"}
    key = lb.cell_key(cells[0], BOARD, **base)
    assert lb.cell_key(cells[0], BOARD, **{**base, "data": "e"}) != key
    assert lb.cell_key(cells[0], BOARD, **{**base, "code": "x"}) != key
    tougher = Profile(BOARD.name, BOARD.description, BOARD.train, 2, BOARD.attack_options)
    assert lb.cell_key(cells[0], tougher, **base) != key
    assert cells[0].key in [c["key"] for c in board.table["cells"]]  # the plan is what the leaderboard ran
    # a cell.json whose key does not match the folder's is refused, not read
    folder = next(board.folder.glob(f"cells/fedavg-s0-{cells[0].key[:12]}"))
    with pytest.raises(lb.ConfigError, match="key differs"):
        lb.read_cell(other[0], folder)


def test_every_method_gets_the_same_shared_options():
    """FedFed's quick default trains on 3,000 samples and FedBN's on resnet-tiny: on the leaderboard they
    train on the profile's subsample and the audit's model group, like every other method."""
    from attacks.audit import PROFILES

    prof = PROFILES["quick"]
    fedfed = lb.cell_values("fedfed", 0, prof, {}, "cpu", None)
    fedre = lb.cell_values("fedre", 0, prof, {}, "cpu", None)
    fedbn = lb.cell_values("fedbn", 0, prof, {}, "cpu", None)
    assert fedfed["subsample"] == fedre["subsample"] == 6000 and fedfed["distill_rounds"] == 2  # its method options stay
    assert fedbn["model_group"] == "homo-cnn4" and fedre["model_group"] == "cpu5"
    assert fedfed["knowledge_rounds"] == "0,2,4"


def test_a_defended_variant_is_planned_only_where_the_defense_touches_a_message():
    cells, notes = lb.plan(["local", "fedavg", "fedproto"], [0], ["dp:max_norm=1,noise_multiplier=1"], BOARD, train_options={}, device="cpu",
                           data_root=None)  # fmt: skip
    assert [c.label for c in cells] == ["local", "fedavg", "fedavg + dp:max_norm=1,noise_multiplier=1", "fedproto"]
    assert len({c.key for c in cells}) == 4
    assert any(n.startswith("fedproto + dp") and "touches none" in n for n in notes) and any(n.startswith("local + dp") for n in notes)


def test_the_frontier_draws_defended_variants_fedavg_and_the_method_that_sends_nothing(tmp_path):
    def row(label, method, defenses, sends, gain, acc):
        cells = {"acc_personal": {"mean": acc, "low": acc - 1, "high": acc + 1}}
        if gain is not None:
            cells["reconstruction"] = {"mean": gain, "low": gain - 0.5, "high": gain + 0.5}
        return {"label": label, "method": method, "defenses": defenses, "sends": sends, "cells": cells}

    rows = [row("local", "local", [], [], None, 88.0), row("fedavg", "fedavg", [], ["model"], 2.0, 80.0),
            row("fedavg + dp", "fedavg", ["dp"], ["model"], 0.2, 70.0), row("fedx", "fedx", [], ["proto"], 3.0, 60.0),
            row("fedy", "fedy", [], ["proto"], None, 75.0)]  # fmt: skip
    fronts = lb_report.frontier_figure(tmp_path / "f.png", rows)
    assert fronts["reconstruction"] == ["fedavg + dp", "fedavg"]  # fedx leaks more at lower accuracy: dominated
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_intervals_over_seeds_and_within_one_seed():
    one = combine([(1.0, 0.4, 1.6)])
    assert one is not None and one["mean"] == 1.0 and (one["low"], one["high"]) == (0.4, 1.6) and one["interval"] == "bootstrap within the run"
    three = combine([(1.0, None, None), (2.0, None, None), (3.0, None, None)])
    assert three is not None
    half = 4.302652729911275 * 1.0 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert three["mean"] == 2.0 and three["low"] == pytest.approx(2.0 - half) and three["high"] == pytest.approx(2.0 + half)
    single = combine([(0.5, None, None)])
    assert combine([(None, None, None)]) is None and single is not None and single["low"] is None


def test_ranks_order_only_where_intervals_separate():
    gain = next(m for m in MEASURES if m.key == "reconstruction")
    l1 = next(m for m in MEASURES if m.key == "label_l1")
    rows: list[dict[str, Any]] = [{"cells": {"reconstruction": {"mean": 5, "low": 4, "high": 6}, "label_l1": {"mean": 0.1, "low": 0.0, "high": 0.2}}},
            {"cells": {"reconstruction": {"mean": 4.5, "low": 3, "high": 5.5}, "label_l1": {"mean": 0.5, "low": 0.4, "high": 0.6}}},
            {"cells": {"reconstruction": {"mean": 0, "low": -1, "high": 1}, "label_l1": {"mean": 0.15, "low": 0.05, "high": 0.5}}},
            {"cells": {"reconstruction": {"mean": 2, "low": None, "high": None}}}]  # fmt: skip
    ranks(rows, gain)
    ranks(rows, l1)
    assert [r["cells"]["reconstruction"].get("rank") for r in rows] == [1, 1, 3, None]  # overlapping intervals share a rank
    failed: list[dict[str, Any]] = [
        {"cells": {"reconstruction": {"mean": -1, "low": -2, "high": -0.5}}},
        {"cells": {"reconstruction": {"mean": -8, "low": -9, "high": -7}}},
    ]
    ranks(failed, gain)  # two attacks below the prior: no ordering of the two, however far apart
    assert [r["cells"]["reconstruction"]["rank"] for r in failed] == [1, 1]
    assert [r["cells"].get("label_l1", {}).get("rank") for r in rows] == [1, 2, 1, None]  # a smaller L1 leaks more


def test_a_family_leaks_when_any_seed_shows_it():
    """Never less than a seed measured: one leaking seed of three makes the family leak, and says how many."""
    v = _verdict([{"verdict": LEAKS}, {"verdict": NO_EVIDENCE}, {"verdict": NO_EVIDENCE}], 3)
    assert v["leaks_seeds"] == 1 and v["text"] == "leaks beyond the prior in 1 of 3 seeds"
    assert _verdict([{"verdict": NO_EVIDENCE}], 1)["text"] == "no evidence beyond the prior in 1 of 1 seed"
    from attacks.leaderboard import Cell, CellResult

    def entry(verdict: str) -> dict:
        best = {"attack": "ig", "round": 1, "threat_model": "curious-server", "verdict": verdict, "gain_psnr": 1.0, "psnr": 12.0}
        return {"accuracy": {"final": 0.5}, "communication": {}, "kinds": [{"kind": "model", "reconstruction": best, "labels": None,
                                                                                "membership": None}]}  # fmt: skip

    cells = [CellResult(Cell("m", (), s, {}, f"k{s}"), entry=entry(LEAKS if s == 2 else NO_EVIDENCE)) for s in range(3)]
    (row,) = build_rows(cells, [0, 1, 2])
    assert row["leaks"] == ["reconstruction"] and row["families"]["reconstruction"]["verdict"]["leaks_seeds"] == 1


def test_the_pareto_front_keeps_the_points_nothing_beats():
    pts = [(0.0, 80.0, "a"), (1.0, 90.0, "b"), (2.0, 85.0, "c"), (0.5, 70.0, "d")]
    assert [p[2] for p in _pareto(pts, True)] == ["a", "b"]  # less leakage, more accuracy
    assert [p[2] for p in _pareto(pts, False)] == ["c", "b"]  # for L1, larger is less leakage


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": pythonpath(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "privfl.audit", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_bad_leaderboard_input_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys):
    """The first refusal in a real process (exit status 2, one line on stderr); the others through the same
    entry point in this process, which spares a torch import per case."""
    from privfl.audit import main as audit_main
    from privfl.cli import run_cli

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    cases = [
        (["--all", "fedavg"], "give no METHOD"),
        (["--methods", "fedavg,nosuch", "--out", str(tmp_path / "a")], "nosuch"),
        (["--methods", "fedavg", "--seeds", "0,x", "--out", str(tmp_path / "b")], "--seeds"),
        (["--methods", "fedavg,fedavg", "--out", str(tmp_path / "c")], "twice"),
        (["--all", "--methods", "fedavg"], "not both"),
        (["--methods", "fedavg", "--out", str(foreign)], "not a leaderboard folder"),
        (["fedavg", "--seeds", "0,1"], "--seeds is for the leaderboard"),
    ]
    got = _cli(*cases[0][0], "--no-progress", cwd=tmp_path)
    assert got.returncode == 2 and cases[0][1] in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
    monkeypatch.chdir(tmp_path)  # where a leaderboard without --out would write
    for args, words in cases[1:]:
        argv: list[str] = [*args, "--no-progress"]
        code = run_cli("privfl.audit", functools.partial(audit_main, argv))
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert words in err and len(err.strip().splitlines()) == 1, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and (foreign / "notes.txt").read_text() == "keep"
