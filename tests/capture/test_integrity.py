"""A run's integrity: verify catches damage (also damage that keeps the chain valid), resume refuses a
damaged index but repairs a kill's partial line, one writer per run, and opening a run runs no code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from privfl.capture.store import TensorStore, chain_next, genesis
from privfl.cli import run_cli
from privfl.errors import CaptureError, ConfigError
from privfl.train import main as train_main
from privfl.verify import verify_run
from tests.helpers import ROOT, pythonpath

TINY = ["--subsample", "600", "--num-clients", "3", "--rounds", "2", "--no-progress", "--batch-size", "32"]
ENV = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 2-round FedRE run (3 clients), copied by each test that damages it."""
    if not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("integrity")
    assert train_main(["fedre", *TINY, "--out-dir", str(out), "--run-name", "base"]) == 0
    return out / "base"


def copy_run(base: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(base, dst, symlinks=True)
    return dst


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def rewrite(store_dir: Path, records: list[dict], *, rechain: bool) -> None:
    """Write ``records`` back; with ``rechain`` the chain and head are recomputed, as a careful forger
    would, so that only the meaning checks can catch the edit."""
    role = json.loads((store_dir / "manifest.json").read_text())["role"]
    if rechain:
        chain = genesis(role)
        for n, rec in enumerate(records):
            rec["seq"] = n
            rec["chain"] = chain = chain_next(chain, rec)
        (store_dir / "head.json").write_text(json.dumps({"records": len(records), "chain": chain}))
    (store_dir / "index.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def test_a_fresh_run_verifies(base_run):
    report = verify_run(base_run)
    assert report.ok, report.lines()
    assert report.counts["capture"] > 0 and report.counts["truth"] > 0


def _drop_middle(recs: list[dict]) -> list[dict]:
    return recs[:3] + recs[4:]


def _duplicate(recs: list[dict]) -> list[dict]:
    return [*recs[:3], recs[2], *recs[3:]]


def _swap_lines(recs: list[dict]) -> list[dict]:
    return [recs[-1], *recs[1:-1], recs[0]]  # a round-1 message first


def _swap_checksums(recs: list[dict]) -> list[dict]:
    a, b = next((i, j) for i in range(len(recs)) for j in range(i) if recs[i]["sha256"] != recs[j]["sha256"])
    recs[a]["sha256"], recs[b]["sha256"] = recs[b]["sha256"], recs[a]["sha256"]
    return recs


def _edit_round(recs: list[dict]) -> list[dict]:
    recs[-1]["round"] = 0
    return recs


def _sender_not_selected(recs: list[dict]) -> list[dict]:
    up = next(r for r in recs if r["direction"] == "up")
    up["sender"] = "client7"  # the run has 3 clients
    return recs


def _drop_last(recs: list[dict]) -> list[dict]:
    return recs[:-1]


def _edit_kind(recs: list[dict]) -> list[dict]:
    up = next(r for r in recs if r["direction"] == "up")
    up["kind"] = "grad"  # FedRE does not send gradients
    return recs


def _edit_scalars(recs: list[dict]) -> list[dict]:
    recs[-1]["scalars"] += 1
    recs[-1]["paper_scalars"] += 1
    return recs


DAMAGE: dict[str, Callable[[list[dict]], list[dict]]] = {
    "drop a middle record": _drop_middle,
    "duplicate a record": _duplicate,
    "swap two records": _swap_lines,
    "swap two checksums": _swap_checksums,
    "edit a round": _edit_round,
    "an uploader that does not exist": _sender_not_selected,
    "drop the last record": _drop_last,
    "a kind the method does not send": _edit_kind,
    "scalar count": _edit_scalars,
}


@pytest.mark.parametrize("rechain", [False, True], ids=["plain", "rechained"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_catches_index_damage_even_when_the_chain_is_recomputed(base_run, tmp_path, damage, rechain):
    run = copy_run(base_run, tmp_path)
    records = DAMAGE[damage](lines(run / "capture" / "index.jsonl"))
    rewrite(run / "capture", records, rechain=rechain)
    report = verify_run(run)
    assert not report.ok, f"{damage} ({'rechained' if rechain else 'plain'}) went unnoticed"


def test_verify_catches_missing_stores_links_and_truth(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    shutil.rmtree(run / "truth")
    assert any("truth" in p for p in verify_run(run).problems["truth"])

    run2 = tmp_path / "run2"
    shutil.copytree(base_run, run2)
    outside = tmp_path / "outside.safetensors"
    rec = lines(run2 / "capture" / "index.jsonl")[0]
    blob = TensorStore(run2 / "capture", "capture").blob_path(rec["sha256"])
    shutil.copy(blob, outside)
    blob.unlink()
    blob.symlink_to(outside)  # identical bytes, but outside the run
    with pytest.raises(CaptureError, match="symbolic link"):
        TensorStore(run2 / "capture", "capture").load(rec)
    assert not verify_run(run2).ok

    run3 = tmp_path / "run3"
    shutil.copytree(base_run, run3)
    truth = lines(run3 / "truth" / "index.jsonl")
    truth[0]["message_seq"] = truth[1]["message_seq"]
    rewrite(run3 / "truth", truth, rechain=True)
    assert verify_run(run3).problems["truth"]


def test_capture_cli_verify_exit_status(base_run, tmp_path, capsys):
    from privfl.capture.__main__ import main as capture_main

    assert capture_main(["verify", "--run", str(base_run)]) == 0  # --run after the subcommand, as the docstring shows
    run = copy_run(base_run, tmp_path)
    (run / "knowledge" / "head.json").unlink()
    assert capture_main(["verify", "--run", str(run)]) == 1
    assert "head.json is missing" in capsys.readouterr().out


def _killed_run(tmp_path: Path, *, write_early: bool = True, name: str = "killed") -> Path:
    """A 2-round FedRE run killed (os._exit, nothing flushed) after 4 messages of round 1; ``write_early``:
    its stores write every record as it comes (``tests/killer.py``), so the kill leaves uncommitted ones."""
    argv = ["fedre", *TINY, "--out-dir", str(tmp_path), "--run-name", name]
    early = ["--write-early"] if write_early else []
    cmd = [sys.executable, "-m", "tests.killer", *early, "1", "4", *argv]
    proc = subprocess.run(cmd, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 137, proc.stderr[-2000:]
    return tmp_path / name


def resume(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``privfl.train --resume RUN`` through its console entry point, in this process (the kills above are the
    part that needs a process of its own): exit status and stderr."""
    capsys.readouterr()
    code = run_cli("privfl.train", lambda: train_main(["--resume", str(run), "--no-progress"]))
    return code, capsys.readouterr().err


@pytest.mark.usefixtures("base_run")
def test_resume_repairs_a_partial_line_and_refuses_other_damage(tmp_path, capsys):
    killed = _killed_run(tmp_path)
    assert not verify_run(killed).ok  # uncommitted records of the interrupted round
    clean = _killed_run(tmp_path, write_early=False, name="kept-in-memory")
    assert verify_run(clean).ok  # the same kill with the stores' default: the round's records never reached the disk
    damaged = tmp_path / "damaged"
    shutil.copytree(killed, damaged)
    recs = lines(damaged / "capture" / "index.jsonl")
    rewrite(damaged / "capture", recs[:2] + recs[3:], rechain=False)  # a committed record dropped
    with open(killed / "capture" / "index.jsonl", "a") as fh:
        fh.write('{"seq": 99, "round": 1, "sen')  # the line a kill cuts short
    torn = killed / "capture" / "blobs" / "00" / ".00ab.safetensors.k1l2.tmp"  # a blob write cut short
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"\x00" * 10)
    assert any("temporary file" in p for p in verify_run(killed).problems["files"])

    code, err = resume(damaged, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--resume refuses" in err

    code, err = resume(killed, capsys)
    assert code == 0, err[-2000:]
    assert "dropped a partial last line" in err and "a write the kill cut short" in err
    assert not torn.exists()
    assert verify_run(killed).ok, verify_run(killed).lines()


def test_one_writer_per_run(tmp_path, capsys):
    from privfl.runs import RunClaim

    run = tmp_path / "r"
    first = RunClaim(run)
    first.acquire(create=True)
    with pytest.raises(ConfigError, match="appeared while"):
        RunClaim(run).acquire(create=True)  # a second training given the same name
    (run / "config.json").write_text(json.dumps({"method": "fedre"}))
    code = run_cli("privfl.train", lambda: train_main(["--resume", str(run), "--no-progress"]))
    err = capsys.readouterr().err
    assert code == 2 and f"pid {os.getpid()}" in err and len(err.strip().splitlines()) == 1, err
    first.release()
    again = RunClaim(run)
    again.acquire(create=False)  # free once the writer is gone
    again.release()


def test_listed_failures_that_empty_the_ring_are_refused_before_the_run_exists(tmp_path, capsys):
    code = run_cli(
        "privfl.train",
        lambda: train_main(["drdfl", "--num-clients", "3", "--failures", "0@1,1@1,2@1", "--out-dir", str(tmp_path / "o"), "--no-progress"]),
    )
    err = capsys.readouterr().err
    assert code == 2 and "every ring node is down in round 1" in err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


PROBE = """
from pathlib import Path
Path({marker!r}).write_text("imported")
"""


def test_opening_a_run_never_imports_code_it_names(base_run, tmp_path, monkeypatch, capsys):
    """A run's config.json naming 'pkg:Class' is a file someone may have sent you: reading it runs nothing."""
    marker = tmp_path / "marker"
    (tmp_path / "privfl_probe_mod.py").write_text(PROBE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "privfl_probe_mod", raising=False)
    run = copy_run(base_run, tmp_path)
    for name in ("config.json", "run.json"):
        data = json.loads((run / name).read_text())
        data["method"] = "privfl_probe_mod:Method"
        (run / name).write_text(json.dumps(data))
    from privfl.attack import main as attack_main
    from privfl.run import Run

    with pytest.raises(ConfigError, match="--plugin privfl_probe_mod"):
        _ = Run.open(run).method_cls
    assert run_cli("privfl.attack", lambda: attack_main(["list", "--run", str(run)])) == 2
    assert run_cli("privfl.train", lambda: train_main(["--resume", str(run)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("privfl does not import code named in a run's files" in e for e in err), err
    assert any("schedule" in n for n in verify_run(run).notes)  # verify reads it too, and runs nothing
    assert not marker.exists()
    assert run_cli("privfl.attack", lambda: attack_main(["list", "--run", str(run), "--plugin", "privfl_probe_mod"])) == 2
    assert marker.exists()  # named by the user: imported (and then refused: it defines no Method)


def test_verify_catches_edited_weights_summary_and_partition(base_run, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    run = copy_run(base_run, tmp_path)
    pointer = json.loads((run / "checkpoint" / "checkpoint.json").read_text())
    state_path = run / "checkpoint" / pointer["file"]
    state = load_file(str(state_path))
    first = next(iter(state))
    state[first] = state[first] + 1  # still a valid safetensors file, other weights
    state_path.unlink()
    save_file(state, str(state_path))
    assert any("checksum mismatch in checkpoint" in p for p in verify_run(run).problems["files"])

    run2 = tmp_path / "run2"
    shutil.copytree(base_run, run2)
    summary = json.loads((run2 / "summary.json").read_text())
    summary["final_acc"] += 0.1
    (run2 / "summary.json").write_text(json.dumps(summary))
    part = load_file(str(run2 / "truth" / "partition.safetensors"))
    part["train_1"] = torch.cat([part["train_1"][:-1], part["train_0"][:1]])  # sizes kept, one sample in two clients
    (run2 / "truth" / "partition.safetensors").unlink()
    save_file(part, str(run2 / "truth" / "partition.safetensors"))
    problems = verify_run(run2).problems
    assert any("summary.json" in p for p in problems["files"])
    assert any("more than one client split" in p for p in problems["truth"])


def test_resume_refuses_records_of_completed_rounds_after_the_head(tmp_path):
    store = TensorStore(tmp_path / "k", "knowledge", create=True)
    store.append({"round": 0, "client": "client0", "kind": "extractor"}, {"a": torch_ones()})
    store.flush()
    store.append({"round": 0, "client": "client1", "kind": "extractor"}, {"a": torch_ones()})  # after the head, yet round 0
    with pytest.raises(CaptureError, match="completed rounds follow the committed head"):
        store.truncate(lambda r: r["round"] <= 0)
    n, repairs = store.truncate(lambda r: r["round"] < 0)  # the interrupted round's records: dropped and said
    assert n == 0 and any("dropped 2 record(s)" in r for r in repairs)


def torch_ones():
    import torch

    return torch.ones(2)


def test_results_are_never_written_through_a_linked_results_folder(tmp_path):
    from privfl.runs import output_path, write_output_folder

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "attacks").symlink_to(elsewhere)  # a run someone sent, redirecting results out of it
    with pytest.raises(ConfigError, match="symbolic link"):
        output_path(run / "attacks", "invert-x")
    final = output_path(run / "analysis", "tsne")
    write_output_folder(final, lambda f: (f / "a.txt").write_text("x"), by="test")
    assert (final / "a.txt").read_text() == "x" and not list(elsewhere.iterdir())
    assert [p.name for p in (run / "analysis").iterdir()] == ["tsne"]  # no temporary folder left
