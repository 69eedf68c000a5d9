"""Plain helpers and constants that tests in several folders use.

Test modules import from here (``from tests.helpers import train``), never from one another. Fixtures live
in the ``conftest.py`` of the folder whose tests share them (tests/conftest.py for the whole suite).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: the repository root: subprocesses run there, and tests read docs/ and experiments/ from it
ROOT = Path(__file__).resolve().parents[1]
#: the real dataset most tests train on (``apt-get install dataset-fashion-mnist``; make setup does it)
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
#: one round on 600 samples, IID over the default 10 clients: the smallest run that exercises a method end to end
QUICK = ["--subsample", "600", "--partition", "iid", "--rounds", "1", "--no-progress", "--batch-size", "32"]


def pythonpath(first: Path = ROOT) -> str:
    """PYTHONPATH for a test's subprocess: ``first`` (the checkout) ahead of the caller's own entries, so
    dependencies installed through PYTHONPATH (``pip install --target DIR``, as on a lent GPU machine) stay
    importable there."""
    return os.pathsep.join([str(first), *filter(None, [os.environ.get("PYTHONPATH")])])


def read_metrics(run: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per round."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def metrics_without_time(run: Path) -> list[dict]:
    """A run's metrics without the wall time of each round: what two runs that must agree are compared on."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in read_metrics(run)]


def train(tmp_path: Path, *args: str, name: str = "run") -> Path:
    """``privfl.train ARGS`` in this process, into ``tmp_path/name``; returns the run folder."""
    from privfl.train import main as train_main

    assert train_main([*args, "--out-dir", str(tmp_path), "--run-name", name]) == 0
    return tmp_path / name


def engine_trainer(run_dir: Path, values: dict[str, Any]) -> Any:
    """A privfl ``Trainer`` built in this process from config ``values`` (``method`` among them), so a test
    can look at the clients' models between rounds; ``.run()`` trains it."""
    from privfl.config import build_config
    from privfl.engine import Trainer
    from privfl.methods import METHODS

    return Trainer(build_config(values, METHODS.get(values["method"]).Options), run_dir)


def captured_messages(run: Path) -> list[tuple[tuple, dict[str, Any]]]:
    """Every captured message of a run as ((round, sender, receiver, kind, phase), tensors), in capture order."""
    from privfl.capture import TensorStore

    capture = TensorStore(run / "capture", "capture")
    return [((r["round"], r["sender"], r["receiver"], r["kind"], r["meta"].get("phase")), capture.load(r)) for r in capture.records()]


def assert_same_run(a: Path, b: Path, messages: int) -> None:
    """Same metrics (accuracies, losses, counts) and bit-identical tensors in every one of the ``messages``
    captured messages: how a method that reduces to another (FedProx with mu = 0, FedBN without BatchNorm)
    is checked against it."""
    import torch

    keys = ("acc", "acc_personal", "client_acc", "client_acc_personal", "train_loss", "upload_scalars", "broadcast_scalars")
    assert [{k: m[k] for k in keys} for m in read_metrics(a)] == [{k: m[k] for k in keys} for m in read_metrics(b)]
    ma, mb = captured_messages(a), captured_messages(b)
    assert [h for h, _ in ma] == [h for h, _ in mb] and len(ma) == messages
    for (head, ta), (_, tb) in zip(ma, mb):
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), head


def cli_error(capsys: pytest.CaptureFixture[str], main: Callable[..., int], argv: list[str]) -> str:
    """Run a command-line ``main`` as its console script would; assert exit status 2 and one line on
    stderr, and return that line."""
    from privfl.cli import run_cli

    code = run_cli("privfl.train", lambda: main(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------------------------------- runs on a graph
def client_index(name: str) -> int:
    """``client7`` -> 7."""
    return int(name.removeprefix("client"))


def edges_of(records: list[dict[str, Any]], rnd: int) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs of a round's captured peer messages, sorted."""
    return sorted((client_index(r["sender"]), client_index(r["receiver"])) for r in records if r["round"] == rnd)


class ClientSpy:
    """Wraps a method's ``train_client`` to keep CPU copies of what each client held around its local training
    (``before``/``after``, keyed by (round, client index)), as ``snapshot(method, client)`` reads it."""

    def __init__(self) -> None:
        self.before: dict[tuple[int, int], dict[str, Any]] = {}
        self.after: dict[tuple[int, int], dict[str, Any]] = {}
        self.method: Any = None

    def wrap(self, original: Callable[..., Any], snapshot: Callable[[Any, Any], dict[str, Any]]) -> Callable[..., Any]:
        def spied(method: Any, rnd: int, client: Any) -> Any:
            self.method = method
            self.before[(rnd, client.index)] = _on_cpu(snapshot(method, client))
            out = original(method, rnd, client)
            self.after[(rnd, client.index)] = _on_cpu(snapshot(method, client))
            return out

        return spied


def _on_cpu(snapshot: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """CPU copies, comparable with the capture's tensors when the run trains on a GPU."""
    return {part: {k: v.detach().cpu().clone() for k, v in tensors.items()} for part, tensors in snapshot.items()}


# ---------------------------------------------------------------------------------------------- Flower
#: two rounds of 3 clients on 600 samples: what the Flower engine is compared with the in-process one on
FLOWER_TINY = ["--subsample", "600", "--partition", "dir", "--alpha", "0.5", "--rounds", "2", "--num-clients", "3", "--batch-size", "32"]
FLOWER_TINY += ["--lr", "0.05", "--device", "cpu", "--no-progress"]


def assert_same_tree(a: Path, b: Path) -> None:
    """The same files under ``a`` and ``b``, byte for byte."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def assert_flower_equals_inprocess(tmp_path: Path, method: str, extra: list[str], flower: tuple[str, ...] = ()) -> None:
    """Train ``method`` twice with one seed, in-process and on Flower (simulation, or ``flower`` options),
    and compare: metrics entry by entry (wall time aside), and the capture, truth and knowledge stores
    byte for byte."""
    pytest.importorskip("flwr")
    import torch

    from privfl.train import main as train_main
    from privfl.verify import verify_run

    torch.set_num_threads(1)  # the nodes train on one thread each (--flower-client-cpus 1)
    out = tmp_path / "runs"
    for engine, more in (("inprocess", ()), ("flower", flower)):
        assert train_main([method, *FLOWER_TINY, *extra, "--engine", engine, *more, "--out-dir", str(out), "--run-name", engine]) == 0
    a, b = out / "inprocess", out / "flower"
    assert metrics_without_time(a) == metrics_without_time(b)
    for store in ("capture", "truth", "knowledge"):
        assert_same_tree(a / store, b / store)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (a, b)]
    assert summaries[0].get("defenses") == summaries[1].get("defenses")
    assert json.loads((b / "run.json").read_text())["engine"] == "flower"
    assert json.loads((b / "config.json").read_text())["engine"] == "flower"
    assert verify_run(b).ok


# ---------------------------------------------------------------------------------------------- membership attacks
#: the options of every run the membership-attack tests train
MIA_COMMON = ["--no-progress", "--partition", "iid", "--model-group", "homo-cnn4"]
#: 50 training samples per client seen 30 times: an overfitted FedAvg client model, which leaks membership
MIA_OVERFIT = ["fedavg", "--num-clients", "4", "--subsample", "400", "--train-fraction", "0.5", "--local-epochs", "30", "--batch-size", "10"]


# ---------------------------------------------------------------------------------------------- parameter counts from layer shapes
def conv_params(cin: int, cout: int, k: int, bias: bool = True) -> int:
    """A k x k convolution's parameters."""
    return cin * cout * k * k + (cout if bias else 0)


def linear_params(din: int, dout: int) -> int:
    """A Linear layer's parameters."""
    return din * dout + dout


def bn_params(c: int) -> int:
    """A BatchNorm's parameters."""
    return 2 * c  # weight and bias (running statistics are buffers, not parameters)


def cnn4_body_params(channels: int, side: int) -> int:
    """HtFLlib's FedAvgCNN without its last Linear: two 5x5 convs (valid) + 2x2 pools, then Linear(flat, 512)."""
    s = ((side - 4) // 2 - 4) // 2
    return conv_params(channels, 32, 5) + conv_params(32, 64, 5) + linear_params(64 * s * s, 512)


def resnet18_body_params(channels: int) -> int:
    """torchvision ResNet-18 without fc: 7x7 stem + BN, four stages of two BasicBlocks (3x3 convs, BN, 1x1 downsample)."""

    def block(cin: int, cout: int) -> int:
        down = conv_params(cin, cout, 1, bias=False) + bn_params(cout) if cin != cout else 0
        return conv_params(cin, cout, 3, bias=False) + bn_params(cout) + conv_params(cout, cout, 3, bias=False) + bn_params(cout) + down

    stages = sum(block(cin, cout) + block(cout, cout) for cin, cout in ((64, 64), (64, 128), (128, 256), (256, 512)))
    return conv_params(channels, 64, 7, bias=False) + bn_params(64) + stages


# ---------------------------------------------------------------------------------------------- FML and FedAPEN: the shared FedMRL CNN
def fedmrl_cnn_params(c_in: int, size: int, c2: int, fc1: int, classes: int, fc2: int = 500) -> int:
    """FedMRL's CNN-j (Table 2) from its layer sizes: conv 5x5 (c_in -> 16), pool 2, conv 5x5 (16 -> c2), pool 2,
    FC (c2 s^2 -> fc1), FC (fc1 -> fc2 = 500), FC (fc2 -> classes); weights plus biases."""
    s = ((size - 4) // 2 - 4) // 2  # spatial side after two valid 5x5 convs, each followed by 2x2 pooling
    return (c_in * 25 * 16 + 16) + (16 * 25 * c2 + c2) + (c2 * s * s * fc1 + fc1) + (fc1 * fc2 + fc2) + (fc2 * classes + classes)


def assert_shared_model_counts_and_average(run: Any) -> list[dict]:
    """A two-round FML or FedAPEN run (10 clients, CNN-5 shared, lr 0.06). Every round: K uploads and N
    broadcasts of exactly |theta| scalars each; each broadcast is the sample-weighted mean of that round's
    uploads (as received); the messages carry the shared model only."""
    import torch

    from privfl.models.fedmrl_zoo import MRLConvNet

    theta = fedmrl_cnn_params(1, 28, c2=32, fc1=500, classes=10)  # CNN-5 on Fashion-MNIST
    names = MRLConvNet(5, 1, 28, num_classes=10).state_dict()
    rows = read_metrics(run.path)
    for r in rows:
        assert r["upload_scalars"] == r["upload_scalars_full"] == r["broadcast_scalars"] == 10 * theta
        assert r["upload_bytes"] == r["broadcast_bytes"] == 4 * 10 * theta
    recs = run.capture.records()
    assert {r["kind"] for r in recs} == {"shared_model"} and len(recs) == 10 + 2 * 20  # setup broadcast + 2 rounds
    for rec in recs:  # the shared model's tensors, nothing else: no private tensor, no architecture
        assert {k: v["shape"] for k, v in rec["tensors"].items()} == {k: list(v.shape) for k, v in names.items()}
        assert "arch" not in rec["meta"]
    for rnd in range(2):
        ups = [r for r in recs if r["round"] == rnd and r["direction"] == "up"]
        downs = [r for r in recs if r["round"] == rnd and r["direction"] == "down" and r["meta"]["phase"] == "train"]
        assert len(ups) == len(downs) == 10 and all(u["meta"]["lr"] == 0.06 for u in ups)
        weights = [u["meta"]["num_samples"] for u in ups]
        sent = [run.capture.load(u) for u in ups]
        broadcast = [run.capture.load(d) for d in downs]
        for k in names:
            expected = sum(w * s[k].double() for w, s in zip(weights, sent)) / sum(weights)
            assert all(torch.allclose(b[k].double(), expected, atol=1e-6) for b in broadcast), (rnd, k)
        assert any(not torch.equal(sent[0][k], sent[1][k]) for k in names)  # clients really trained differently
    return recs


# ---------------------------------------------------------------------------------------------- small shared checks


def by_round(records: list[dict], rnd: int, direction: str) -> list[dict]:
    """A round's captured records one way (``up``, ``down``), setup broadcasts left out."""
    return [r for r in records if r["round"] == rnd and r["direction"] == direction and r["meta"].get("phase") != "setup"]


def prototype_uploads(capture: Any, rnd: int) -> tuple[Any, Any, list[dict]]:
    """A round's prototype uploads: all their prototypes, their classes, and the records."""
    import torch

    ups = [r for r in capture.records() if r["direction"] == "up" and r["round"] == rnd]
    loaded = [capture.load(r) for r in ups]
    return torch.cat([t["protos"] for t in loaded]).float(), torch.cat([t["classes"] for t in loaded]).long(), ups


def model_broadcasts(capture: Any) -> dict[tuple[int, str, str], dict]:
    """(round, phase, receiver) -> the ``model`` broadcast record."""
    return {(r["round"], r["meta"]["phase"], r["receiver"]): r for r in capture.records() if r["kind"] == "model"}


def seeded_resnet18() -> Any:
    """torchvision's ResNet-18 at 3x32x32, 10 classes, seed 0: the papers' shape for message counts."""
    import torch

    from privfl.models import build_model

    torch.manual_seed(0)
    return build_model("resnet18", in_channels=3, num_classes=10, image_size=32)


def mlp_pair(seed: int = 0) -> tuple[Any, Any]:
    """Two small MLPs (1x4x4 in, 8-d representation, 3 classes) from one seed: a private and a shared model."""
    import torch

    from privfl.models import build_model

    torch.manual_seed(seed)
    return (
        build_model("mlp", in_channels=1, num_classes=3, image_size=4, rep_dim=8),
        build_model("mlp", in_channels=1, num_classes=3, image_size=4, rep_dim=8),
    )


def one_line(reason: str) -> str:
    """``reason``, after checking that it is one non-empty line (how privfl refuses)."""
    assert reason and "\n" not in reason
    return reason
