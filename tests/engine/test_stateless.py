"""Stateless clients and streamed uploads (the 10,000-client memory work): FedAvg, FedProx and FedNova give
the same numbers, capture and final weights as the same method with one model and one upload per client
held in memory; the checkpoint stores the shared broadcast once; a kill resumes exactly; a write around
the copy-on-write, an upload stream read twice or partly, and a wrong declaration are one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel
from privfl.errors import ConfigError, PrivflError
from privfl.fl.shared import SharedTensors, bind_shared, own_tensors
from privfl.methods import check_method_class
from privfl.methods.fednova import FedNova
from privfl.methods.fedprox import FedProx
from privfl.methods.simple import FedAvg, Local
from privfl.models import build_model
from privfl.run import load_checkpoint_state, read_checkpoint
from tests.helpers import metrics_without_time, needs_fmnist, read_metrics, train

TINY = ["--subsample", "400", "--partition", "iid", "--num-clients", "4", "--batch-size", "32", "--no-progress", "--model-group", "homo-cnn4"]


class PlainFedAvg(FedAvg):
    """FedAvg as before the memory work: a model per client, every upload held until the server reads them."""

    stateless_clients = False
    streams_uploads = False


class PlainFedProx(FedProx):
    stateless_clients = False
    streams_uploads = False


class PlainFedNova(FedNova):
    stateless_clients = False


PLAIN = {"fedavg": PlainFedAvg, "fedprox": PlainFedProx, "fednova": PlainFedNova}


def _client_weights(run: Path) -> dict[str, torch.Tensor]:
    """The client models in the run's checkpoint (not what a client keeps beside it: the plain method's
    copies for --eval personal, which the stateless one replaces by scores)."""
    pointer = read_checkpoint(run)
    assert pointer is not None
    state = load_checkpoint_state(run, pointer)
    return {k: v for k, v in state.items() if re.match(r"client\d+\.", k)}


@needs_fmnist
@pytest.mark.parametrize("method", sorted(PLAIN))
def test_stateless_clients_change_no_number(tmp_path, method):
    """Both protocols, every client's accuracy, the capture and the final weights agree exactly; half the
    clients train per round, so cached personal scores of clients that sat out are used too."""
    torch.set_num_threads(1)
    args = [*TINY, "--rounds", "3", "--join-ratio", "0.5"]
    lean = train(tmp_path, method, *args, name="lean")
    plain = train(tmp_path, f"{__name__}:{PLAIN[method].__name__}", *args, name="plain")

    assert metrics_without_time(lean) == metrics_without_time(plain)
    assert all(row["acc_personal"] != row["acc"] for row in read_metrics(lean)[1:])  # the protocols do differ
    records = [{k: v for k, v in r.items() if k != "seq"} for r in TensorStore(lean / "capture", "capture").records()]
    assert records == [{k: v for k, v in r.items() if k != "seq"} for r in TensorStore(plain / "capture", "capture").records()]
    a, b = _client_weights(lean), _client_weights(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the four clients alias one broadcast: stored once, restored as one tensor under every client's name
    assert a["client3.head.weight"] is a["client0.head.weight"]
    size = {run: next((run / "checkpoint").glob("state-r*.safetensors")).stat().st_size for run in (lean, plain)}
    assert size[lean] < 0.5 * size[plain]


@needs_fmnist
def test_stateless_fedavg_resumes_exactly(assert_resumes_exactly):
    """Killed mid-stream in round 1 (after the first of two uploads): the aliased checkpoint and the cached
    personal scores of round 0 bring it back to the uninterrupted run's metrics and stores."""
    records = assert_resumes_exactly(["fedavg", *TINY, "--rounds", "3", "--join-ratio", "0.5"], kill_round=1, kill_after=1)
    assert len(records) == 4 + 3 * (2 + 4)


class WritesAroundCopyOnWrite(FedAvg):
    """A broken method: edits the received model in place before local training took its copy."""

    def client_round(self, rnd, client):
        with torch.no_grad():
            next(client.model.parameters()).mul_(1.0)
        return super().client_round(rnd, client)


class ReadsOneUpload(FedAvg):
    def server_round(self, rnd, uploads):
        next(iter(uploads))
        self.broadcast(rnd)
        return {}


class ReadsUploadsTwice(FedAvg):
    def server_round(self, rnd, uploads):
        sum(1 for _ in uploads)
        return super().server_round(rnd, uploads)


@needs_fmnist
@pytest.mark.parametrize(
    "method, message",
    [
        (WritesAroundCopyOnWrite, "modified in place"),
        (ReadsOneUpload, "stopped reading its uploads after 1 of 4"),
        (ReadsUploadsTwice, "read its uploads twice"),
    ],
)
def test_broken_stateless_or_streaming_methods_fail_in_one_line(tmp_path, method, message):
    from privfl.train import main

    with pytest.raises(PrivflError, match=message) as caught:
        main([f"{__name__}:{method.__name__}", *TINY, "--rounds", "1", "--out-dir", str(tmp_path), "--run-name", "broken"])
    assert "\n" not in str(caught.value)


def test_stateless_clients_is_checked_when_the_method_loads():
    class LocalStateless(Local):
        stateless_clients = True

    class PersonalHead(FedAvg):
        personal_parts = ("head",)

    for cls in (LocalStateless, PersonalHead):
        with pytest.raises(ConfigError, match="stateless_clients needs a GlobalModelServer"):
            check_method_class(cls)
    check_method_class(FedAvg)


def test_copy_on_write_binding():
    """Bound models alias one copy until they train; owning gives a private copy and leaves the shared one alone."""
    torch.manual_seed(0)
    source = build_model("cnn4", in_channels=1, num_classes=10, image_size=28)
    shared = SharedTensors({k: v.detach().clone() for k, v in source.state_dict().items()})
    with torch.device("meta"):
        a, b = (build_model("cnn4", in_channels=1, num_classes=10, image_size=28) for _ in range(2))
    bind_shared(a, shared)
    bind_shared(b, shared)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(a(x), source(x)) and a.state_dict()["head.weight"].data_ptr() == b.state_dict()["head.weight"].data_ptr()
    own_tensors(a)
    with torch.no_grad():
        a.get_parameter("head.weight").add_(1.0)
    shared.check()  # untouched: a wrote its own copy
    assert torch.equal(b(x), source(x)) and not torch.equal(a(x), source(x))
    with torch.no_grad():
        b.get_parameter("head.weight").add_(1.0)  # b writes without owning: caught
    with pytest.raises(PrivflError, match="modified in place"):
        shared.check()


def test_shared_broadcast_gives_one_copy_unless_a_mod_changes_it():
    tensors = {"w": torch.arange(4.0)}
    plain = Channel(sends={"model": "up/down"}).broadcast(0, ["client0", "client1"], "model", tensors, shared=True)
    assert plain["client0"].tensors is plain["client1"].tensors and plain["client0"].tensors["w"] is not tensors["w"]

    def noisy(msg: Message, ctx) -> Message:
        return Message(msg.round, msg.sender, msg.receiver, msg.kind, {"w": msg.tensors["w"] + 1}, msg.meta)

    modded = Channel(mods=[noisy], sends={"model": "up/down"}).broadcast(0, ["client0", "client1"], "model", tensors, shared=True)
    assert modded["client0"].tensors is not modded["client1"].tensors
    assert torch.equal(modded["client1"].tensors["w"], tensors["w"] + 1)
    apart = Channel(sends={"model": "up/down"}).broadcast(0, ["client0", "client1"], "model", tensors)
    assert apart["client0"].tensors["w"] is not apart["client1"].tensors["w"]
