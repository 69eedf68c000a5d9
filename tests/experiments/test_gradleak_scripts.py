"""The issue-4 experiment scripts run end to end on a tiny setting and write what they promise."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from experiments.papers.drdfl import fig9_gradleak, fig9_learngene
from experiments.privacy import defense_table
from tests.helpers import FMNIST


def test_fig9_script_writes_table_and_gallery(tmp_path):
    assert (
        fig9_gradleak.main(["--datasets", "cifar10", "--images", "1", "--steps", "2", "--variances", "1e-2", "--no-drdfl", "--out", str(tmp_path)])
        == 0
    )
    rows = list(csv.DictReader((tmp_path / "table.csv").open()))
    assert [r["system"] for r in rows] == ["FedNova", "FedNova+noise s2=0.01"]
    for r in rows:
        assert -100 < float(r["psnr_mean"]) < 100 and r["images"] == "1"
    assert (tmp_path / "gallery-cifar10.png").stat().st_size > 1000
    per_image = list(csv.DictReader((tmp_path / "per_image.csv").open()))
    assert len(per_image) == 2


def test_fig9_noise_reaches_the_attacker_at_the_gradient_scale():
    """The defense acts on the update d = lr * g; sigma = lr * s must leave N(0, s^2) on d / lr."""
    import torch

    from defenses import build_defenses
    from privfl.channel import Channel

    lr, s = 0.01, 0.1
    model = fig9_gradleak.build_victim("lenet", 100, 0)
    x, y = torch.rand(1, 3, 32, 32), torch.tensor([3])
    clean = fig9_gradleak.fednova_update(model, x, y, lr, Channel(None, None, mods=[]), "client0")
    noisy = fig9_gradleak.fednova_update(model, x, y, lr, Channel(None, None, mods=build_defenses([f"gaussian:sigma={lr * s}"])), "client0")
    diff = torch.cat([(noisy.tensors[k] - clean.tensors[k]).flatten() / lr for k in clean.tensors])
    assert diff.std().item() == pytest.approx(s, rel=0.05)


@pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
def test_defense_table_script(tmp_path):
    assert (
        defense_table.main(
            [
                "--defenses",
                "none;dp:max_norm=1.0,noise_multiplier=1.0",
                "--rounds",
                "1",
                "--subsample",
                "800",
                "--probe-subsample",
                "400",
                "--attack-clients",
                "0",
                "--dlg-steps",
                "1",
                "--ig-steps",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert [r["defense"] for r in rows] == ["none", "dp:max_norm=1.0,noise_multiplier=1.0"]
    assert rows[0]["epsilon"] is None and rows[1]["epsilon"] > 0
    for r in rows:
        assert 0 <= r["final_acc"] <= 1
        assert Path(r["run"], "attacks", "dlg-update", "gallery.png").is_file()
        assert Path(r["probe_run"], "attacks", "ig-grad", "metrics.json").is_file()


def test_fig9_learngene_one_step_protocol():
    """DRDFL's row: the attacker's probe is DRDFL's declared Learngene module, named like the message."""
    import torch

    from attacks.images import packaged_images
    from privfl.methods.drdfl import DRDFL

    req = fig9_learngene._request(10, 0, 8)
    probe = fig9_learngene.attacker_probe(req, torch.zeros(2, 3, 32, 32), seed=1)
    sent = probe.to_module_names(DRDFL.learngene_tensors(DRDFL.build_client_model(req)))
    assert sent and set(sent) <= {n for n, _ in probe.named_parameters()}
    images, labels = packaged_images("cifar10", 1)
    [(row, rec)] = list(fig9_learngene.attack_learngene("cifar10", images, labels, steps=1, seed=0, width=8))
    assert row["system"] == "DRDFL Learngene" and rec.shape == (3, 32, 32) and -100 < row["psnr"] < 100
