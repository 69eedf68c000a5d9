"""The Flower engine: the same run as in-process, bit for bit, through Flower's simulation.

A run with ``--engine flower`` must be indistinguishable from the in-process one for verify, attacks and
the audit: the tests compare the capture, ground-truth and knowledge stores file by file and the metrics
entry by entry (wall time aside). The simulation tests need the ``flower`` extra (CI installs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from privfl.capture.message import Message
from privfl.errors import ConfigError
from privfl.methods import METHODS
from privfl.train import main as train_main
from tests.helpers import FLOWER_TINY, assert_flower_equals_inprocess, assert_same_tree, metrics_without_time


def test_methods_in_roles_are_declared_by_their_hooks() -> None:
    """Every built-in method is in roles; a subclass that overrides run_round is not (its round is no longer
    the composition), nor is a method that only has run_round."""
    from privfl.fl.method import FLMethod
    from privfl.methods.simple import FedAvg

    assert all(METHODS.get(m).in_roles() for m in METHODS.names())

    class OwnRound(FedAvg):
        def run_round(self, rnd, selected):
            return super().run_round(rnd, selected)

    class OnlyRound(FLMethod):
        def run_round(self, rnd, selected):
            return {}

    assert not OwnRound.in_roles() and not OnlyRound.in_roles() and not OnlyRound.gossips()


def test_records_round_trip_exactly() -> None:
    pytest.importorskip("flwr")
    from flwr.app import RecordDict

    from privfl.flower.records import get_messages, put_messages

    tensors = {
        "w": torch.randn(3, 4),
        "half": torch.randn(5).half(),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    msgs = [Message(4, "client2", "server", "ent_rep", tensors, {"arch": "cnn4", "nested": {"a": [1, 2]}}, ("ids",))]
    content = RecordDict()
    put_messages(content, "up", msgs)
    (back,) = get_messages(content, "up")
    assert (back.round, back.sender, back.receiver, back.kind, back.meta, back.aux) == (4, "client2", "server", "ent_rep", msgs[0].meta, ("ids",))
    assert list(back.tensors) == list(tensors)
    for k, t in tensors.items():
        assert back.tensors[k].dtype == t.dtype and back.tensors[k].shape == t.shape and torch.equal(back.tensors[k], t)


def test_engine_refusals_are_one_line_and_create_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("flwr")  # the first refusals come after the check that Flower is installed
    out = tmp_path / "runs"
    common = [*FLOWER_TINY, "--engine", "flower", "--out-dir", str(out)]
    (tmp_path / "own_round_method.py").write_text(
        "from privfl.methods.simple import FedAvg\n\n\nclass OwnRound(FedAvg):\n"
        "    def run_round(self, rnd, selected):\n        return super().run_round(rnd, selected)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="written in roles"):
        train_main(["own_round_method:OwnRound", "--model-group", "homo-cnn4", *common])
    with pytest.raises(ConfigError, match="schedule token"):
        train_main(["drdfl", "--schedule", "token", *common])
    with pytest.raises(ConfigError, match="--flower-insecure"):
        train_main(["fedavg", "--model-group", "homo-cnn4", "--flower-mode", "deployment", *common])
    with pytest.raises(ConfigError, match="HOST:PORT"):
        train_main(["fedavg", "--model-group", "homo-cnn4", "--flower-mode", "deployment", "--flower-insecure", "--flower-superlink", "x", *common])
    monkeypatch.setitem(sys.modules, "flwr", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match="uv sync --extra flower"):
        train_main(["fedavg", "--model-group", "homo-cnn4", *common])
    assert not out.exists()


@pytest.mark.slow
def test_killed_flower_run_resumes_to_the_inprocess_run(tmp_path: Path) -> None:
    """A Flower simulation stopped after its second message of round 1 (round 0 checkpointed, each node's
    model and client_state with it) resumes with ``--resume`` on Flower; the finished run equals the
    in-process run byte for byte. FedALA: each client keeps its ALA weights in its client_state."""
    pytest.importorskip("flwr")
    from tests.killer import InterruptAfter, Interrupted

    torch.set_num_threads(1)
    out = tmp_path / "runs"
    args = ["fedala", *FLOWER_TINY, "--rounds", "3", "--model-group", "homo-cnn4", "--out-dir", str(out)]
    assert train_main([*args, "--run-name", "inprocess"]) == 0
    with pytest.raises(Interrupted):  # raised in the ServerApp, which Flower's simulation passes on
        train_main([*args, "--engine", "flower", "--run-name", "flower"], callbacks=[InterruptAfter(1, 2)])
    assert json.loads((out / "flower" / "checkpoint" / "checkpoint.json").read_text())["round"] == 0
    assert train_main(["--resume", str(out / "flower"), "--no-progress"]) == 0
    a, b = out / "inprocess", out / "flower"
    assert metrics_without_time(a) == metrics_without_time(b)
    for store in ("capture", "truth", "knowledge"):
        assert_same_tree(a / store, b / store)
    from privfl.verify import verify_run

    assert verify_run(b).ok


#: client-level DP on the uploads (defended on each node, accounted on the server) and noise on the broadcasts
DEFENDED = ["--defense", "dp:max_norm=1,noise_multiplier=0.5", "--defense", "gaussian:sigma=0.001,directions=down"]


#: FedAvg with defenses stays in the default suite; FedRE on heterogeneous models (38 s) is slow, run by .ci/run
@pytest.mark.parametrize(
    "method, extra",
    [
        ("fedavg", ["--model-group", "homo-cnn4", *DEFENDED]),
        pytest.param("fedre", ["--model-group", "cpu5", "--rep-dim", "64"], marks=pytest.mark.slow),
    ],
)
def test_flower_simulation_equals_inprocess(tmp_path: Path, method: str, extra: list[str]) -> None:
    """Same seed, same numbers: accuracy per round, and the capture, truth and knowledge stores byte for
    byte; with defenses, the same defended messages and the same privacy accounting."""
    assert_flower_equals_inprocess(tmp_path, method, extra)
    if "--defense" in extra:  # the nodes' defense references are not checkpointed: refused, in one line
        with pytest.raises(ConfigError, match="without --defense"):
            train_main(["--resume", "--run", str(tmp_path / "runs" / "flower")])


@pytest.mark.slow
def test_flower_deployment_on_localhost(tmp_path: Path) -> None:
    """A SuperLink and two SuperNodes as separate processes: the run equals the in-process one, and
    stopping the federation ends exactly the processes it started (Flower's helpers included). About
    100 s: Flower 1.41 starts a ClientApp process per message and a SuperNode polls every 3 s. Slow, so
    outside the default suite; ``.ci/run`` runs it after the suite."""
    pytest.importorskip("flwr")
    from privfl.flower.deploy import LocalFederation, alive

    with LocalFederation(2, tmp_path / "federation") as fed:
        started = fed.pids()
        assert len(started) >= 3  # the SuperLink and two SuperNodes (and the helpers they start)
        deploy = ("--flower-mode", "deployment", "--flower-insecure", "--flower-superlink", fed.address)
        assert_flower_equals_inprocess(tmp_path, "fedavg", ["--model-group", "homo-cnn4", "--num-clients", "2"], deploy)
        started |= fed.pids()
    assert [pid for pid in started if alive(pid)] == []
    assert json.loads((tmp_path / "runs" / "flower" / "config.json").read_text())["flower_mode"] == "deployment"


@pytest.mark.slow
def test_flower_gossip_on_a_graph_equals_inprocess(tmp_path: Path) -> None:
    """DFedPGP on a random time-varying graph with a node down and client DP on the peer messages: the
    ServerApp routes every hop (captured as the peer message it is, sender to receiver), same bytes.
    About 35 s: slow, run by ``.ci/run`` after the default suite."""
    extra = ["--model-group", "homo-cnn4", "--topology", "random", "--degree", "2", "--failures", "1@1"]
    assert_flower_equals_inprocess(tmp_path, "dfedpgp", [*extra, "--defense", "dp:max_norm=1,noise_multiplier=0.5,directions=peer"])
    index = [json.loads(line) for line in (tmp_path / "runs" / "flower" / "capture" / "index.jsonl").read_text().splitlines()]
    assert index and all(r["direction"] == "peer" and r["sender"] != r["receiver"] for r in index)


def test_route_gossip_keeps_edge_order_and_refuses_a_non_neighbour() -> None:
    from privfl.errors import PrivflError
    from privfl.fl.method import route_gossip
    from privfl.topology import Ring

    ring = Ring(3)
    t = {"w": torch.zeros(1)}
    sent: dict[int, list[tuple[Message, dict[str, torch.Tensor] | None]]]
    sent = {k: [(Message(0, f"client{k}", f"client{(k + 1) % 3}", "model", t), None)] for k in (2, 0, 1)}
    assert [(r, m.sender) for r, m, _ in route_gossip(ring, 0, sent)] == [(1, "client0"), (2, "client1"), (0, "client2")]
    with pytest.raises(PrivflError, match="not one of its out-neighbours"):
        route_gossip(ring, 0, {0: [(Message(0, "client0", "client2", "model", t), None)]})
