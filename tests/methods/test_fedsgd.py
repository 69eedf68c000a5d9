"""FedSGD: a ``grad`` message is the gradient of one captured batch at the captured global model, and the
server takes one step with what it received."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from privfl.capture import TensorStore
from privfl.models import build_model
from tests.helpers import QUICK, model_broadcasts, needs_fmnist, train

HOMO = ["--model-group", "homo-cnn4"]


# the run computed its gradients on a GPU where there is one, this test recomputes them on the CPU: other
# kernels, other rounding (seen on an H200: 1e-6 apart on gradients of 5e-4)
GRAD_RTOL, GRAD_ATOL = (1e-3, 1e-5) if torch.cuda.is_available() else (1e-4, 1e-6)


@needs_fmnist
def test_fedsgd_grad_is_one_batch_gradient_and_server_takes_one_step(tmp_path):
    from privfl.data import load_dataset

    run = train(tmp_path, "fedsgd", *QUICK, *HOMO, "--server-lr", "0.5")
    capture, truth = TensorStore(run / "capture", "capture"), TensorStore(run / "truth", "truth")
    truth_by_seq = {r["message_seq"]: r for r in truth.records()}
    models = model_broadcasts(capture)
    ups = [r for r in capture.records() if r["kind"] == "grad"]
    assert len(ups) == 10 and all(r["direction"] == "up" for r in ups)

    info = json.loads((run / "run.json").read_text())
    assert info["knowledge"] == {}  # exposes nothing beyond the capture
    ds = info["dataset"]
    model = build_model("cnn4", in_channels=ds["channels"], num_classes=ds["num_classes"], image_size=ds["image_size"])
    start = capture.load(models[(0, "setup", "client0")])
    model.load_state_dict(start)
    model.train()
    data = load_dataset("fashionmnist")
    split = load_file(str(run / "truth" / "partition.safetensors"))
    subset = split["subset"]

    weighted: dict[str, torch.Tensor] = {}
    total = 0
    for rec in ups:
        t = truth.load(truth_by_seq[rec["seq"]])
        idx = t["indices"]
        client = int(rec["sender"].removeprefix("client"))
        # one batch: batch_size distinct samples of the client's own train split
        assert rec["meta"]["batch_size"] == len(idx) == 32 and len(idx.unique()) == 32
        assert rec["meta"]["num_samples"] == len(split[f"train_{client}"])
        assert set(idx.tolist()) <= set(split[f"train_{client}"].tolist())
        assert torch.equal(t["labels"], data.labels[subset[idx]])
        model.zero_grad()
        F.cross_entropy(model(data.normalize(data.images[subset[idx]])), t["labels"]).backward()
        sent = capture.load(rec)
        assert set(sent) == {k for k, _ in model.named_parameters()}
        for k, p in model.named_parameters():
            assert p.grad is not None and torch.allclose(sent[k], p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL), k
            weighted[k] = weighted.get(k, 0) + 32 * sent[k].double()
        total += 32
    # the batches differ between clients (seeded per client)
    assert len({tuple(truth.load(truth_by_seq[r["seq"]])["indices"].tolist()) for r in ups}) == 10

    after = capture.load(models[(0, "train", "client3")])
    for k, x in start.items():
        assert torch.allclose(after[k].double(), x.double() - 0.5 * weighted[k] / total, atol=1e-6), k
