"""privfl.analyze on two tiny real runs (FedProto, FedRE on Fashion-MNIST): Grad-CAM maps checked against
a hand-written Grad-CAM, figure layout, t-SNE panels and separation numbers, determinism, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib.image import imread
from safetensors.torch import load_file
from torch import nn

from privfl.analysis import separation
from privfl.analyze import main as analyze_main
from privfl.cli import run_cli
from privfl.methods import ModelRequest
from privfl.methods.simple import Local
from privfl.models import SplitModel
from privfl.run import Run
from privfl.train import main as train_main
from tests.helpers import FMNIST, ROOT

pytestmark = pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
# 3 clients of the cpu5 group: cnn4-narrow, mlp (no spatial layer), cnn3x3
TINY = ["--subsample", "400", "--partition", "iid", "--rounds", "2", "--num-clients", "3", "--rep-dim", "64", "--batch-size", "32", "--no-progress"]


class PairEncoder(nn.Module):
    """An encoder returning a (mean, log-variance) pair, as VAE-style methods do: not a spatial map."""

    def __init__(self, channels: int, dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1), nn.ReLU())
        self.fc = nn.Linear(8 * 7 * 7, 2 * dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_var = self.fc(self.net(x).flatten(1)).chunk(2, dim=1)
        return mu, log_var


class PairModel(nn.Module):
    def __init__(self, req: ModelRequest):
        super().__init__()
        self.encoder, self.head = PairEncoder(req.in_channels, 16), nn.Linear(16, req.num_classes)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.represent(x))


class PairLocal(Local):
    """A user's method (given by import path) with its own model and a predict needing only that model."""

    name = "pair-local"

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> nn.Module:
        return PairModel(req)

    def predict(self, client, x: torch.Tensor) -> torch.Tensor:
        return client.model(x) / 2.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("analyze")
    for method, name in (("fedproto", "fedproto"), ("fedre", "fedre"), (f"{__name__}:PairLocal", "plugin")):
        extra = ["--rounds", "1"] if name == "plugin" else []
        assert train_main([method, *TINY, *extra, "--out-dir", str(out), "--run-name", name]) == 0
    return {m: out / m for m in ("fedproto", "fedre", "plugin")}


def analyze(*argv: str) -> None:
    assert analyze_main([*argv, "--no-progress"]) == 0


def cli_error(capsys, *argv: str) -> str:
    code = run_cli("privfl.analyze", lambda: analyze_main([*argv, "--no-progress"]))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def manual_gradcam(model, layer, x: torch.Tensor, target: int) -> torch.Tensor:
    """Grad-CAM written out (Selvaraju et al.): channel weights = spatial mean of d score / d A.
    The hook hands a copy downstream so an in-place ReLU after the layer cannot overwrite A."""
    saved = {}

    def keep(_module, _inputs, out):
        saved["a"] = out
        return out.clone()

    handle = layer.register_forward_hook(keep)
    try:
        logits = model(x)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(logits[0, target], saved["a"])
    cam = F.relu((grad.mean((2, 3), keepdim=True) * saved["a"]).sum(1, keepdim=True))
    return F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[0, 0].detach()


def test_gradcam_maps_figure_and_json(runs):
    run = runs["fedproto"]
    analyze("gradcam", "--run", str(run), "--module", "features,features.3", "--clients", "0,2", "--images", "2", "--name", "two")
    folder = run / "analysis" / "two"
    info = json.loads((folder / "gradcam.json").read_text())
    assert info["layout"]["columns"] == ["ground truth", "features", "features.3"]
    assert info["layout"]["clients"] == [0, 2] and info["layout"]["rows"] == len(info["images"]) == 4
    # `features` ends in Flatten: it stands for its last spatial layer (the second max-pool)
    assert info["layers"]["client0"] == {"features": "features.5", "features.3": "features.3"}
    assert info["layer_map_size"]["client0"]["features"] == [4, 4] and info["layer_map_size"]["client2"]["features"] == [7, 7]
    assert "FedProto.predict needs" in info["score"]["client0"]  # nearest-prototype predict needs server state
    maps = load_file(str(folder / "maps.safetensors"))
    rm = Run(run).models()
    for k in (0, 2):
        for m in ("features", "features.3"):
            assert maps[f"client{k}.{m}"].shape == (2, 28, 28)
            assert (maps[f"client{k}.{m}"] >= 0).all() and torch.isfinite(maps[f"client{k}.{m}"]).all()
        # own test images, true label as target
        ids = maps[f"client{k}.pool_index"]
        assert set(ids.tolist()) <= set(rm.client_ids(k, "test").tolist())
        rows = [r for r in info["images"] if r["client"] == k]
        assert [r["target"] for r in rows] == rm.labels_of(ids).tolist()
    # captum's maps equal a hand-written Grad-CAM of the same layer and class
    model = rm.model(2)
    x = rm.client_data(maps["client2.pool_index"][:1]).x
    want = manual_gradcam(model, dict(model.named_modules())["features.3"], x, info["images"][2]["target"])
    torch.testing.assert_close(maps["client2.features.3"][0], want, atol=1e-5, rtol=1e-4)
    # the figure grows with rows (images) and columns (modules)
    analyze("gradcam", "--run", str(run), "--module", "features", "--clients", "0,2", "--images", "1", "--name", "one")
    big, small = imread(folder / "gradcam.png"), imread(run / "analysis" / "one" / "gradcam.png")
    assert big.shape[0] > 1.6 * small.shape[0] and big.shape[1] > small.shape[1]


def test_gradcam_class_and_same_images(runs):
    run = runs["fedre"]
    analyze("gradcam", "--run", str(run), "--module", "features", "--class", "trouser", "--same-images", "--images", "3")
    folder = run / "analysis" / "gradcam-features-Trouser-same"
    info = json.loads((folder / "gradcam.json").read_text())
    assert info["class"] == {"index": 1, "name": "Trouser"}
    # default clients: those whose model has a spatial `features` layer; client1 is the MLP
    assert info["layout"]["clients"] == [0, 2] and "(B, C, h, w)" in info["skipped_clients"]["client1"]
    assert all(r["target"] == 1 and r["label"] == 1 for r in info["images"])
    maps = load_file(str(folder / "maps.safetensors"))
    shown = info["layout"]["clients"]
    pools = [maps[f"client{k}.pool_index"].tolist() for k in shown]
    assert all(p == pools[0] for p in pools) and len(pools[0]) == 3
    c = info["consistency_mean_pairwise_cosine"]["features"]
    assert len(shown) >= 2 and 0.0 <= c <= 1.0 + 1e-6  # non-negative maps: cosine in [0, 1]


def test_gradcam_errors(runs, capsys):
    run = str(runs["fedproto"])
    err = cli_error(capsys, "gradcam", "--run", run, "--module", "nope", "--clients", "0")
    assert "unknown module 'nope'" in err and "features.3" in err and "head" not in err.split("spatial outputs:")[1]
    err = cli_error(capsys, "gradcam", "--run", run, "--module", "features", "--clients", "1")  # the MLP
    assert "client1 (mlp)" in err and "(B, C, h, w)" in err
    assert "unknown class 'zebra'" in cli_error(capsys, "gradcam", "--run", run, "--module", "features", "--class", "zebra")
    assert "--target model" in cli_error(capsys, "gradcam", "--run", run, "--module", "features", "--clients", "0", "--target", "predict")
    assert "client 7 does not exist" in cli_error(capsys, "gradcam", "--run", run, "--module", "features", "--clients", "7")
    # the real exit status and one line of the module's own entry point
    proc = subprocess.run(
        [sys.executable, "-m", "privfl.analyze", "gradcam", "--run", str(Path(run) / "nothing"), "--module", "features"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "not a privfl run" in proc.stderr


def test_tsne_prototypes_two_runs(runs):
    out = runs["fedproto"].parent
    analyze("tsne", "--runs", f"{runs['fedproto']},{runs['fedre']}", "--seed", "3")
    folder = out / "analysis" / "tsne-proto-fedproto+fedre"
    info = json.loads((folder / "tsne.json").read_text())
    assert [p["method"] for p in info["panels"]] == ["fedproto", "fedre"]
    rm = Run(runs["fedproto"]).models()
    # one point per (client, class present in its train split)
    expected = sum(len(torch.unique(rm.labels_of(rm.client_ids(k, "train")))) for k in range(3))
    vectors = load_file(str(folder / "vectors.safetensors"))
    for i, panel in enumerate(info["panels"]):
        assert panel["points"] == expected and panel["clients"] == 3 and panel["dim"] == 64
        assert -1.0 <= panel["silhouette"] <= 1.0 and -1.0 <= panel["silhouette_2d"] <= 1.0
        assert 0.0 <= panel["knn_accuracy"] <= 1.0
        assert vectors[f"{i}.vectors"].shape == (expected, 64) and vectors[f"{i}.tsne"].shape == (expected, 2)
    # the stored prototypes are the clients' class means of model.represent on their train data
    model, ids = rm.model(0), rm.client_ids(0, "train")
    assert isinstance(model, SplitModel)  # FedProto's client model
    with torch.no_grad():
        reps = model.represent(rm.client_data(ids).x).double()
    labels = rm.labels_of(ids)
    first = int(vectors["0.classes"][0])
    assert int(vectors["0.clients"][0]) == 0
    torch.testing.assert_close(vectors["0.vectors"][0].double(), reps[labels == first].mean(0), atol=1e-5, rtol=1e-5)
    # the silhouette is computed in the original space: recompute it from the stored vectors
    again = separation(vectors["0.vectors"].double().numpy(), vectors["0.classes"].numpy(), vectors["0.clients"].numpy(), "euclidean")
    assert again["silhouette"] == pytest.approx(info["panels"][0]["silhouette"], abs=1e-6)
    summary = (folder / "summary.csv").read_text().splitlines()
    assert len(summary) == 3 and summary[0].startswith("run,")
    assert len((folder / "points.csv").read_text().splitlines()) == 1 + 2 * expected
    png = imread(folder / "tsne.png")
    assert png.shape[1] > png.shape[0]  # two panels side by side
    # seeded: the same seed gives the same embedding
    analyze("tsne", "--runs", f"{runs['fedproto']},{runs['fedre']}", "--seed", "3", "--output", str(out / "again"))
    torch.testing.assert_close(load_file(str(out / "again" / "vectors.safetensors"))["1.tsne"], vectors["1.tsne"])


def test_tsne_samples_and_module_space(runs, capsys):
    run = runs["fedre"]
    analyze("tsne", "--runs", str(run), "--space", "rep", "--max-samples", "20")
    info = json.loads((run / "analysis" / "tsne-rep" / "tsne.json").read_text())
    assert info["panels"][0]["points"] == 60 and not info["prototypes"]
    analyze("tsne", "--runs", str(run), "--space", "module:features.3", "--clients", "0", "--max-samples", "25")
    panel = json.loads((run / "analysis" / "tsne-module_features.3" / "tsne.json").read_text())["panels"][0]
    assert panel["points"] == 25 and panel["dim"] == 32 * 8 * 8  # cnn4-narrow's second conv, flattened
    assert panel["silhouette_by_client"] is None and "1 distinct clients" in panel["silhouette_by_client_note"]
    err = cli_error(capsys, "tsne", "--runs", str(run), "--space", "module:features.3")
    assert "different sizes across clients" in err
    assert "accepted: proto, rep, module:NAME" in cli_error(capsys, "tsne", "--runs", str(run), "--space", "latent")
    assert "unknown module 'nope'" in cli_error(capsys, "tsne", "--runs", str(run), "--space", "module:nope")


def test_user_method_with_its_own_model(runs, capsys):
    """Nothing is special to SplitModels: a plugin's encoder that returns a tuple stands for its last
    conv block, and its predict (which needs only the client model) is the score explained."""
    run = runs["plugin"]
    analyze("gradcam", "--run", str(run), "--module", "encoder,encoder.net.0", "--clients", "1", "--images", "1")
    folder = run / "analysis" / "gradcam-encoder+encoder.net.0-true-label"
    info = json.loads((folder / "gradcam.json").read_text())
    assert info["layers"]["client1"] == {"encoder": "encoder.net", "encoder.net.0": "encoder.net.0"}
    assert info["score"]["client1"] == "PairLocal.predict (client model only)"
    rm = Run(run).models()
    maps = load_file(str(folder / "maps.safetensors"))
    x = rm.client_data(maps["client1.pool_index"]).x
    with torch.no_grad():
        prob = (rm.model(1)(x) / 2.0).softmax(1)[0, info["images"][0]["target"]]
    assert info["images"][0]["target_prob"] == pytest.approx(float(prob), abs=1e-5)
    assert maps["client1.encoder"].shape == (1, 28, 28)
    # a (mean, log-variance) encoder stands for its mean: the same points as the model's represent()
    analyze("tsne", "--runs", str(run), "--space", "module:encoder", "--prototypes")
    enc = json.loads((run / "analysis" / "tsne-module_encoder-prototypes" / "tsne.json").read_text())["panels"][0]
    analyze("tsne", "--runs", str(run), "--space", "proto")
    proto = json.loads((run / "analysis" / "tsne-proto" / "tsne.json").read_text())["panels"][0]
    assert enc["dim"] == proto["dim"] == 16 and enc["points"] == proto["points"]
    assert enc["silhouette"] == pytest.approx(proto["silhouette"], abs=1e-6)
    analyze("tsne", "--runs", str(run), "--space", "module:encoder.fc", "--prototypes")
    panel = json.loads((run / "analysis" / "tsne-module_encoder.fc-prototypes" / "tsne.json").read_text())["panels"][0]
    assert panel["dim"] == 32 and panel["prototypes"] and panel["clients"] == 3


def test_separation_numbers_on_known_geometry():
    rng = np.random.default_rng(0)
    centres = np.eye(4) * 20
    x = np.concatenate([c + rng.normal(size=(15, 4)) for c in centres])
    y = np.repeat(np.arange(4), 15)
    clients = np.tile(np.arange(3), 20)
    tight = separation(x, y, clients, "euclidean")
    assert tight["silhouette"] > 0.8 and tight["knn_accuracy"] == 1.0 and abs(tight["silhouette_by_client"]) < 0.1
    shuffled = separation(x, rng.permutation(y), clients, "euclidean")
    assert shuffled["silhouette"] < 0.1 and shuffled["knn_accuracy"] < 0.6


def test_output_folders_privfl_did_not_write_are_refused_before_the_work(runs, tmp_path, capsys, monkeypatch):
    """--output DIR / --name: an existing folder without privfl's marker (or a link) is never replaced, a
    name is one plain folder name, and both are refused before any model is run; privfl's own output is
    replaced by a re-run. --run goes before or after the subcommand."""
    import privfl.analysis.gradcam
    import privfl.analysis.tsne
    from privfl.runs import OUTPUT_MARKER

    run = str(runs["fedre"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file\n")
    (runs["fedre"] / "analysis").mkdir(exist_ok=True)
    (runs["fedre"] / "analysis" / "theirs").mkdir()
    calls = []
    monkeypatch.setattr(privfl.analysis.tsne, "collect", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(privfl.analysis.gradcam, "run_gradcam", lambda *a, **k: calls.append(1))
    foreign = "already exists and is not a privfl output (no .privfl-output.json); privfl replaces only folders it wrote: "
    foreign += "remove it or choose another name"
    assert cli_error(capsys, "tsne", "--runs", run, "--output", str(mine)) == f"privfl.analyze: error: {mine} {foreign}"
    assert cli_error(capsys, "--run", run, "tsne", "--output", str(tmp_path)).endswith(f"{tmp_path} {foreign}")
    assert foreign in cli_error(capsys, "tsne", "--run", run, "--name", "theirs")
    assert foreign in cli_error(capsys, "gradcam", "--run", run, "--module", "features", "--name", "theirs")
    for name in ("..", "a/b", "../x", ".hidden"):
        assert "--name must be a plain folder name" in cli_error(capsys, "tsne", "--runs", run, "--name", name)
        assert "--name must be a plain folder name" in cli_error(capsys, "--run", run, "gradcam", "--module", "features", "--name", name)
    (tmp_path / "link").symlink_to(mine)
    assert "is a symbolic link" in cli_error(capsys, "tsne", "--runs", run, "--output", str(tmp_path / "link"))
    assert calls == [] and (mine / "notes.txt").read_text() == "a user's file\n"
    monkeypatch.undo()
    out = tmp_path / "out"
    analyze("--run", run, "tsne", "--output", str(out))
    analyze("tsne", "--run", run, "--output", str(out))  # its own output: replaced
    assert json.loads((out / OUTPUT_MARKER).read_text())["written_by"] == "privfl.analyze tsne" and (out / "tsne.png").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "mine", "out"]  # no temp or old folder left
