"""Attack reports: gallery PNG geometry, metric files round-trip, self-contained escaped HTML."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from attacks.report import save_gallery, write_html, write_metrics


def _imgs(n: int, c: int, size: int = 28, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, c, size, size, generator=torch.Generator().manual_seed(seed))


def _size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


@pytest.mark.parametrize("c", [1, 3])
def test_gallery_grows_with_rows(tmp_path: Path, c: int) -> None:
    truth = _imgs(6, c)
    recon = [(f"ent_rep client{i} r19", _imgs(6, c, seed=i + 1)) for i in range(3)]
    labels = {lbl: [f"PSNR {12.3 + j:.1f} dB" for j in range(6)] for lbl, _ in recon}
    one = save_gallery(tmp_path / "one.png", truth, recon[:1], title="t", per_image_labels=labels)
    three = save_gallery(
        tmp_path / "sub" / "three.png", truth, recon, captions=[f"#{j}" for j in range(6)], title="inversion <b>", per_image_labels=labels
    )
    w1, h1 = _size(one)
    w3, h3 = _size(three)
    assert w1 == w3 and h3 > h1
    only_recon = save_gallery(tmp_path / "r.png", None, recon[:1])
    assert _size(only_recon)[1] < h1
    assert not list(tmp_path.glob(".*.tmp"))


def test_gallery_single_image_and_wide_rows(tmp_path: Path) -> None:
    p = save_gallery(
        tmp_path / "n1.png", _imgs(1, 1), [("r", _imgs(1, 1, seed=2))], per_image_labels={"ground truth": ["label 7"], "r": ["PSNR 9.0 dB"]}
    )
    w1, _ = _size(p)
    p16 = save_gallery(tmp_path / "n16.png", _imgs(16, 3, 32), [("r", _imgs(16, 3, 32, seed=2))])
    w16, _ = _size(p16)
    assert w16 > w1
    # reconstructions outside [0,1] (unclamped attack output) still render
    save_gallery(tmp_path / "wild.png", None, [("raw", _imgs(2, 3) * 3 - 1)])


def test_gallery_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        save_gallery(tmp_path / "x.png", torch.rand(2, 2, 8, 8), [])
    with pytest.raises(ValueError):
        save_gallery(tmp_path / "x.png", None, [])


def test_write_metrics_roundtrip(tmp_path: Path) -> None:
    rows = [
        {"image": 0, "client": 3, "psnr": 12.5, "mse255": 4000.25},
        {"image": 1, "client": 3, "psnr": 13.25, "mse255": 5029.5, "lpips": 0.5},
        {"image": 2, "client": 4, "psnr": float("inf"), "mse255": 0.0},
    ]
    summary = {"psnr": 12.89, "psnr_std": 0.5, "mse255": 4514.91}
    protocol = {"attack": "inversion", "round": 19, "target": {"clients": [3, 4]}}
    j, c, s = write_metrics(tmp_path / "m", rows, summary, protocol)
    assert (j.name, c.name, s.name) == ("metrics.json", "metrics.csv", "summary.csv")

    doc = json.loads(j.read_text())
    assert doc["protocol"] == protocol and doc["summary"] == summary
    assert doc["images"][:2] == rows[:2] and doc["images"][2]["psnr"] is None  # strict JSON: no Infinity

    with open(c, newline="") as f:
        reader = csv.DictReader(f)
        got = list(reader)
        assert reader.fieldnames == ["image", "client", "psnr", "mse255", "lpips"]
    assert len(got) == 3
    assert float(got[1]["psnr"]) == 13.25 and float(got[0]["mse255"]) == 4000.25
    assert got[0]["lpips"] == "" and float(got[1]["lpips"]) == 0.5

    with open(s, newline="") as f:
        summ = {r["key"]: float(r["value"]) for r in csv.DictReader(f)}
    assert summ == summary
    # overwrite in place, no temp files left behind
    write_metrics(tmp_path / "m", rows[:1], summary, protocol)
    with open(c) as f:
        assert len(list(csv.DictReader(f))) == 1
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["metrics.csv", "metrics.json", "summary.csv"]


def test_write_html(tmp_path: Path) -> None:
    folder = tmp_path / "report"
    gal = save_gallery(folder / "gallery_client3.png", _imgs(2, 1), [("r", _imgs(2, 1, seed=1))])
    write_metrics(folder, [{"image": 0, "psnr": 12.89}], {"psnr": 12.89}, {"attack": "inv"})
    page = write_html(
        folder,
        "<script>alert(1)</script> report",
        [
            {
                "heading": "client 3 & friends",
                "protocol": {"attack": "inversion", "prior": "<none>"},
                "images": [gal, "other/gallery 2.png"],
                "summary": {"psnr255": 12.89, "psnr255_std": 1.5, "mse255": 4514.91, "lpips": math.nan},
            },
            {"heading": "second", "summary": {"ssim": 0.25}, "links": {"raw captures": "capture/index.json"}},
        ],
    )
    assert page == folder / "index.html"
    text = page.read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt; report" in text
    assert "client 3 &amp; friends" in text and "&lt;none&gt;" in text
    assert 'src="gallery_client3.png"' in text  # absolute path inside the folder made relative
    assert 'src="other/gallery%202.png"' in text
    for v in ("12.89", "1.5", "4514.91", "0.25", "n/a"):
        assert f">{v}<" in text
    for name in ("metrics.json", "metrics.csv", "summary.csv", "capture/index.json"):
        assert f'href="{name}"' in text
    assert "http://" not in text and "https://" not in text and "<script" not in text.lower()
