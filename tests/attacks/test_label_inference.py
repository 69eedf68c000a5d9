"""Known answers for label inference (attacks/labels.py): the classes a client holds and their shares.

Tiny one-round runs on Fashion-MNIST (600 samples, Dirichlet alpha 0.3 over 10 clients, so clients hold
different class sets), trained once per module. The numbers each test measures are printed (``-s``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from attacks import ATTACKS, AttackReport, Selection, run_attack
from attacks.labels import LabelConfig, class_shares, integer_counts, present_rows, read_classifier, read_representation, representation_reading
from privfl.capture import Message
from privfl.fl.method import Client, module_tensors
from privfl.kinds import KINDS, example_message
from privfl.methods import FLMethod
from privfl.run import Run
from privfl.train import main as train_main
from tests.helpers import one_line

SMALL = ["--subsample", "600", "--partition", "dir", "--alpha", "0.3", "--min-samples", "8", "--rounds", "1", "--no-progress"]
CNN4 = ["--model-group", "homo-cnn4"]  # ReLU features before the head: the sign rule's assumption


class LogitsProbe(FLMethod):
    """A user's method (test only). Each client trains, then sends one ``logits`` message by the rule
    under test (client index mod 3: per-class mean logits with ``classes``; per-sample logits with
    ``labels``; per-sample logits alone), a ``grad`` with no classifier rows and its ``model`` with no
    previous state anywhere in the run."""

    sends = {"logits": "up", "grad": "up", "model": "up"}
    paper = "a test method"

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        for c in selected:
            self.local_train(rnd, c)
            x, y = self.env.data.batch(c.train_idx)
            c.model.eval()
            with torch.no_grad():
                logits = c.model(x).cpu()
            y = y.cpu()
            if c.index % 3 == 0:
                cls = torch.unique(y)
                tensors = {"logits": torch.stack([logits[y == k].mean(0) for k in cls]), "classes": cls}
            elif c.index % 3 == 1:
                tensors = {"logits": logits, "labels": y}
            else:
                tensors = {"logits": logits}
            truth = {"indices": c.train_idx.cpu()}
            self.send(Message(rnd, c.name, "server", "logits", tensors, {"arch": c.arch}), truth)
            self.send(Message(rnd, c.name, "server", "grad", {"proj.weight": torch.zeros(3, 5)}, {"batch_size": 1}), truth)
            self.send(Message(rnd, c.name, "server", "model", module_tensors(c.model), {"num_samples": len(c.train_idx)}), truth)
        return {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """``trained(name, *argv)``: a tiny one-round run of ``argv`` (method first), trained once per module."""
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("labels")
    cache: dict[str, Run] = {}

    def get(name: str, *argv: str) -> Run:
        if name not in cache:
            assert train_main([*argv, *SMALL, "--out-dir", str(out), "--run-name", name]) == 0
            cache[name] = Run.open(out / name)
        return cache[name]

    return get


def attack(run: Run, name: str, kind: str, **options: Any) -> AttackReport:
    report = run_attack(run, name, kind=kind, device="cpu", write=False, options=options or None)
    s = report.summary
    print(
        f"\n{name} on {run.method} {kind} r{report.round} {options or ''}: {s['messages']} messages, precision {s['precision']:.3f}, "
        f"recall {s['recall']:.3f}, exact sets {s['exact']:.2f}, L1 mean {s['l1']:.4f} max {max(r['l1'] for r in report.rows):.4f}"
    )
    return report


# ------------------------------------------------------------------------------------------ gradients and updates
def test_fedsgd_batch_of_8(trained):
    """Sign rule: never a wrong class. Counts at the round-0 model, where pbar is close to uniform: the
    continuous estimate is within L1 0.01 of the batch histogram (measured mean 0.009); rounded to the
    8 samples (at least one per proven class) every histogram came out exact. One misplaced sample of 8
    costs L1 0.25, so a mean below 0.05 allows at most two in the ten messages."""
    run = trained("sgd8", "fedsgd", *CNN4, "--batch-size", "8")
    report = attack(run, "labels", "grad")
    s = report.summary
    assert s["messages"] == 10 and s["precision"] == 1.0 and s["recall"] >= 0.9
    assert s["l1"] < 0.05
    assert all(row["rule"].startswith("rows of the gradient with a negative entry") for row in report.rows)
    continuous = attack(run, "labels", "grad", integer_counts=False).summary
    assert continuous["precision"] == 1.0 and continuous["l1"] < 0.05
    uniform = attack(run, "labels", "grad", integer_counts=False, mean_probs="uniform").summary
    assert uniform["l1"] < 0.05  # at an untrained model the literature's pbar = 1/C is as good


def test_fedsgd_single_sample_label_is_exact(trained):
    report = attack(trained("sgd1", "fedsgd", *CNN4, "--batch-size", "1"), "labels", "grad")
    assert all(row["exact"] and len(row["recovered"]) == 1 and row["l1"] < 1e-6 for row in report.rows)


def test_fednova_update(trained):
    """Precision 1 over a whole local epoch (8-sample batches, several steps): plain SGD keeps the sign.
    The shares of the client's training split are a rougher estimate (pbar moves as the model trains):
    measured recall 1.0, L1 mean 0.15 (0.35-0.42 in later rounds of a longer run); the bound leaves room."""
    run = trained("nova", "fednova", *CNN4, "--batch-size", "8")
    s = attack(run, "labels", "update").summary
    assert s["precision"] == 1.0 and s["recall"] >= 0.8
    assert s["l1"] < 0.4
    assert attack(run, "labels", "update", mean_probs="uniform").summary["l1"] >= s["l1"]  # interpolation helps over an epoch


def test_fedavg_model_by_delta(trained):
    run = trained("avg", "fedavg", *CNN4, "--batch-size", "8")
    report = attack(run, "labels-delta", "model")
    s = report.summary
    assert s["precision"] == 1.0 and s["recall"] >= 0.8 and s["l1"] < 0.4
    assert report.rows[0]["rule"].startswith("rows of the previous model - model with a negative entry")
    # the eavesdropper attack does not take full parameters: the reason names the family
    plan = ATTACKS.get("labels")().plan(run.attacker, Selection(kind="model"))
    assert not plan and "parameters" in one_line(plan.reason)


# ------------------------------------------------------------------------------------------ representations
@pytest.mark.parametrize("method", ["fedproto", "fedgh"])
def test_prototypes_with_counts_are_exact(trained, method):
    run = trained(method, method, *CNN4)
    s = attack(run, "labels", "proto").summary
    assert s["precision"] == 1.0 and s["recall"] == 1.0 and s["exact"] == 1.0 and s["l1"] < 1e-6


def test_global_prototypes_name_every_client_class(trained):
    """A server's broadcast: the target is the receiver, the classes are those of every client's data."""
    run = trained("fedproto", "fedproto", *CNN4)
    labels = ATTACKS.get("labels")()
    plan = labels.plan(run.attacker, Selection(kind="global_proto"))
    assert plan and {t.client for t in plan.targets} == {f"client{i}" for i in range(10)}
    truth = run.ground_truth()
    everyone = set(truth.labels[torch.cat(list(truth.train.values()))].unique().tolist())
    for recon in labels.run_batch(plan.targets):
        assert recon.labels is not None and set(recon.labels.tolist()) == everyone and recon.label_distribution is None


def test_fedallrep_labels_give_the_exact_histogram(trained):
    s = attack(trained("allrep", "fedallrep", *CNN4), "labels", "rep").summary
    assert s["precision"] == 1.0 and s["recall"] == 1.0 and s["l1"] < 1e-6


def test_fedre_entangled_label_gives_the_set(trained):
    report = attack(trained("fedre", "fedre", *CNN4), "labels", "ent_rep")
    s = report.summary
    assert s["precision"] == 1.0 and s["recall"] == 1.0 and s["exact"] == 1.0
    assert all(r.label_distribution is None for r in report.reconstructions)  # random RE weights: the set only
    assert "random weights" in report.rows[0]["proportions"]


# ------------------------------------------------------------------------------------------ logits, runner, refusals
def test_logits_rules_and_refusals(trained):
    run = trained("probe", "tests.attacks.test_label_inference:LogitsProbe", *CNN4)
    report = attack(run, "labels", "logits")
    rows = {r["client"]: r for r in report.rows}
    for i in range(10):
        row = rows[f"client{i}"]
        if i % 3 == 0:  # per-class rows with classes: the set
            assert row["exact"] and row["rule"] == "per-class rows (classes)"
        elif i % 3 == 1:  # per-sample rows with labels: the histogram
            assert row["exact"] and row["l1"] < 1e-6
        else:  # logits alone: the argmax histogram, an estimate that says so
            assert row["rule"] == "argmax of per-sample logits" and "estimate" in row["proportions"] and row["warning"]
            print(f"  argmax estimate {row['client']}: precision {row['precision']:.2f} recall {row['recall']:.2f} L1 {row['l1']:.3f}")
    # a gradient with no classifier rows, a model with no previous state: one-line reasons
    plan = ATTACKS.get("labels")().plan(run.attacker, Selection(kind="grad"))
    assert not plan and "no (10, d) float tensor named '*weight'" in one_line(plan.reason)
    plan = ATTACKS.get("labels-delta")().plan(run.attacker, Selection(kind="model"))
    assert not plan and "previous_state" in one_line(plan.reason)


def test_example_logits_message_with_labels_reads_the_histogram():
    msg = example_message("logits", num_classes=5)  # logits (3, 4), classes and labels 0, 1, 2
    index = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in msg.tensors.items()}
    reading = representation_reading(KINDS.get("logits"), index, 5)
    assert reading == {"read": "histogram", "rows": "labels"}
    est = read_representation(msg.tensors, reading, 5)
    assert (
        est.labels.tolist() == [0, 1, 2]
        and est.distribution is not None
        and torch.allclose(est.distribution.double(), torch.tensor([1.0, 1, 1, 0, 0], dtype=torch.float64) / 3)
    )
    per_class = {k: v for k, v in index.items() if k != "labels"}
    assert representation_reading(KINDS.get("logits"), per_class, 5) == {"read": "set", "rows": "classes"}


def test_runner_writes_the_label_grid_and_metrics(trained):
    report = run_attack(trained("sgd8", "fedsgd", *CNN4, "--batch-size", "8"), "labels", kind="grad", clients=[0, 1], device="cpu")
    assert report.folder is not None and (report.folder / "labels.png").stat().st_size > 0
    saved = json.loads((report.folder / "metrics.json").read_text())
    assert saved["protocol"]["threat_model"] == "eavesdropper" and saved["protocol"]["family"] == "gradient"
    rows = saved.get("images", saved.get("rows"))
    assert len(rows) == 2 and {"recovered", "true", "precision", "recall", "l1", "rule", "proportions"} <= set(rows[0])


def test_delta_refuses_a_broadcast_head_in_one_line(trained):
    plan = ATTACKS.get("labels-delta")().plan(trained("fedre", "fedre", *CNN4).attacker, Selection(kind="head"))
    assert not plan and "reads what clients send" in one_line(plan.reason)


# ------------------------------------------------------------------------------------------ the rules on a known gradient
def _linear_relu_gradient(labels: torch.Tensor, classes: int = 6, bias: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(labels), 12, generator=gen)
    body, head = torch.nn.Linear(12, 16), torch.nn.Linear(16, classes, bias=bias)
    loss = F.cross_entropy(head(torch.relu(body(x))), labels)
    grads = torch.autograd.grad(loss, list(head.parameters()))
    return dict(zip(["weight", "bias"], grads))


def test_rules_on_a_known_gradient():
    labels = torch.tensor([0, 0, 0, 2, 2, 5])
    truth = torch.bincount(labels, minlength=6).double() / 6
    g = _linear_relu_gradient(labels)
    present = present_rows(g["weight"], g["bias"])
    assert present.nonzero().flatten().tolist() == [0, 2, 5]
    est = read_classifier(g["weight"], g["bias"], mean_scale=1.0, total=6, config=LabelConfig())
    assert est.distribution is not None and torch.allclose(est.distribution.double(), truth)  # counts rounded to 6 samples
    share, _ = class_shares(g["weight"], g["bias"], present, scale=1.0)
    scaled, how = class_shares(g["weight"] * 37, g["bias"] * 37, present, scale=None)  # an update of unknown lr and steps
    assert share is not None and scaled is not None and torch.allclose(share, scaled) and "absorbs" in how
    assert float((share - truth).abs().sum()) < 0.2
    nb = _linear_relu_gradient(labels, bias=False)  # no bias: row sums over a fitted feature scale (LLG's impact)
    share_nb, how_nb = class_shares(nb["weight"], None, present_rows(nb["weight"], None))
    assert share_nb is not None and "impact" in how_nb and float((share_nb - truth).abs().sum()) < 0.6
    print(f"\nknown gradient: L1 with bias {float((share - truth).abs().sum()):.3f}, without {float((share_nb - truth).abs().sum()):.3f}")
    distinct = _linear_relu_gradient(torch.tensor([1, 3, 4]))  # Yin et al.'s batch rule, for distinct labels
    est = read_classifier(distinct["weight"], distinct["bias"], mean_scale=1.0, total=3, config=LabelConfig(batch_rule=True), batch_size=3)
    assert est.labels.tolist() == [1, 3, 4] and "most negative minima" in est.rule
    assert integer_counts(torch.tensor([0.5, 0.0, 0.5]), torch.tensor([True, False, True]), 1) is None  # more classes than samples
