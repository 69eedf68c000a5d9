"""FedAPEN: the adaptive ensemble weight on a constructed case, and a tiny real run: exact capture counts,
a server that averages what it received, held-out samples that fit lambda, and lambda in the checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from privfl import Run
from privfl.methods import Client
from privfl.methods.fedapen import FedAPEN, FedAPENModel, ensemble, fit_shared_weight
from tests.helpers import FMNIST, assert_shared_model_counts_and_average, mlp_pair, needs_fmnist, read_metrics, train

TINY = ["--subsample", "600", "--partition", "iid", "--rounds", "2", "--batch-size", "32", "--no-progress"]


def test_lambda_moves_toward_the_better_model_and_stays_in_0_1():
    """A shared model trained on the task against a private model frozen at its random init: lambda (the
    shared model's weight) goes up; with the roles swapped it goes down; a huge step stops at the bound."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 1, 4, 4, generator=gen)
    y = torch.arange(240) % 3
    x = centres[y] + 0.5 * torch.randn(240, 1, 4, 4, generator=gen)
    private, shared = mlp_pair(1)
    sgd = torch.optim.SGD(shared.parameters(), lr=0.2)
    for _ in range(150):
        sgd.zero_grad()
        F.cross_entropy(shared(x[:200]), y[:200]).backward()
        sgd.step()
    held_x, held_y = x[200:], y[200:]  # held out: neither model saw them
    with torch.no_grad():
        s, p = shared(held_x), private(held_x)
    assert (s.argmax(1) == held_y).float().mean() > 0.9 > 0.6 > (p.argmax(1) == held_y).float().mean()
    fit: dict[str, Any] = {"lr": 0.05, "epochs": 10, "batch_size": 16}
    for mix in ("probs", "logits"):
        up = fit_shared_weight(0.5, s, p, held_y, mix=mix, **fit)
        down = fit_shared_weight(0.5, p, s, held_y, mix=mix, **fit)  # the trained model is now the private one
        assert 0.5 < up <= 1.0 and 0.0 <= down < 0.5, (mix, up, down)
        assert fit_shared_weight(0.5, s, p, held_y, mix=mix, lr=1e3, epochs=1, batch_size=16) == 1.0
        assert fit_shared_weight(0.5, p, s, held_y, mix=mix, lr=1e3, epochs=1, batch_size=16) == 0.0
        assert fit_shared_weight(0.3, s, p, held_y, mix=mix, lr=0.05, epochs=0, batch_size=16) == pytest.approx(0.3)
    # seeded shuffling: the same generator gives the same lambda
    g = lambda epoch: torch.Generator().manual_seed(epoch)  # noqa: E731
    assert fit_shared_weight(0.5, s, p, held_y, generator=g, **fit) == fit_shared_weight(0.5, s, p, held_y, generator=g, **fit)

    # the prediction is the lambda-weighted mix of the two models' distributions (or logits)
    model = FedAPENModel(private, shared, 0.5)
    model.shared_weight.fill_(up)
    method = object.__new__(FedAPEN)  # predict needs only the client's model
    client = Client(0, "mlp", model, torch.arange(4), torch.arange(4))
    with torch.no_grad():
        scores = method.predict(client, held_x)
        mixed = up * F.softmax(s, 1) + (1 - up) * F.softmax(p, 1)
        assert torch.allclose(F.softmax(scores, 1), mixed, atol=1e-6) and torch.allclose(scores.exp(), mixed, atol=1e-6)
        model.mix = "logits"
        assert torch.allclose(method.predict(client, held_x), up * s + (1 - up) * p, atol=1e-6)
        assert torch.allclose(ensemble(s, p, 1.0, "probs").exp(), F.softmax(s, 1), atol=1e-6)  # lambda = 1: the shared model alone
        assert torch.allclose(ensemble(s, p, 0.0, "probs").exp(), F.softmax(p, 1), atol=1e-6)


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def fedapen_run(tmp_path_factory):
    """One two-round run on tiny real data."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("fedapen")
    return Run.open(train(out, "fedapen", *TINY, name="fedapen"))


@needs_fmnist
def test_fedapen_holds_out_samples_fits_lambda_and_checkpoints_it(fedapen_run):
    run = fedapen_run
    recs = assert_shared_model_counts_and_average(run)
    rows = read_metrics(run.path)
    assert all(0.0 <= r["shared_weight"] <= 1.0 for r in rows) and "acc_personal" in rows[-1]
    truth = run.ground_truth()
    for rec in [r for r in recs if r["direction"] == "up"]:
        train_split = truth.client_train(rec["sender"]).long()
        n = len(train_split)
        assert rec["meta"]["num_samples"] == n - min(n - 1, max(1, round(0.05 * n)))  # 5% held out for lambda
        trained = truth.message_truth(rec["seq"])["indices"].long()
        assert len(trained) == rec["meta"]["num_samples"] and set(trained.tolist()) < set(train_split.tolist())
    models = run.models()
    for k in range(10):
        model = models.model(k)
        assert isinstance(model, FedAPENModel)
        lam = float(model.shared_weight)
        assert 0.0 <= lam <= 1.0 and lam != 0.5  # fitted, and restored from the checkpoint
    assert sum(float(models.model(k).shared_weight) for k in range(10)) / 10 == pytest.approx(rows[-1]["shared_weight"], abs=1e-6)
    ctx = FedAPEN.leakage_context("shared_model")
    assert ctx is not None and ctx.module == "shared"
