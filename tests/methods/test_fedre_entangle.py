"""RE mechanisms against the formulas of FedRE [001] App. A, and the server loss identity."""

import pytest
import torch
import torch.nn.functional as F

from privfl.fl.entangle import MECHANISMS, entangle, normalise, random_draws, sample_weights, soft_label_loss
from privfl.fl.method import class_prototypes
from privfl.seeding import torch_generator

C = 5
LABELS = torch.tensor([0, 0, 0, 2, 2, 4, 4, 4, 4, 1])  # classes 0,1,2,4 present; 3 absent
REPS = torch.randn(len(LABELS), 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def weights(mech, dist="uniform", seed=0, negatives="abs"):
    draws = random_draws(mech, LABELS, C, dist, torch_generator(seed, "t"))
    return sample_weights(mech, LABELS, C, draws, negatives), draws


@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize("dist", ["uniform", "gaussian", "laplace"])
def test_weights_are_a_distribution(mech, dist):
    w, _ = weights(mech, dist)
    assert w.shape == LABELS.shape
    assert torch.all(w >= 0) and torch.all(w <= 1)
    assert w.sum().item() == pytest.approx(1.0, abs=1e-12)


def test_each_mechanism_matches_its_equation():
    counts = torch.bincount(LABELS, minlength=C).double()
    # VAR Eq. (8)
    assert torch.allclose(weights("var")[0], torch.full((10,), 0.1, dtype=torch.float64))
    # RSR Eq. (7): exactly one sample gets 1
    w = weights("rsr")[0]
    assert (w == 1).sum() == 1 and (w == 0).sum() == 9
    # RAR Eq. (9): u_i / sum u
    w, u = weights("rar")
    assert torch.allclose(w, u / u.sum())
    # RSP Eq. (10): 1/n_c on one present class
    w = weights("rsp")[0]
    chosen = LABELS[w > 0].unique()
    assert len(chosen) == 1 and torch.allclose(w[w > 0], 1 / counts[chosen].expand(int((w > 0).sum())))
    # VAP Eq. (11): 1/(|C_k| n_c), |C_k| = 4 present classes
    assert torch.allclose(weights("vap")[0], 1 / (4 * counts[LABELS]))
    # RAP Eq. (12): u_c / (n_c sum_{present} u_j)
    w, u = weights("rap")
    present = torch.tensor([0, 1, 2, 4])
    assert torch.allclose(w, u[LABELS] / (counts[LABELS] * u[present].sum()))


def test_rap_equals_weighted_prototype_sum_and_label_is_same_weighting():
    w, u = weights("rap", seed=3)
    rep, label = entangle(REPS, LABELS, C, w)
    classes, protos, _ = class_prototypes(REPS, LABELS, C)
    class_w = u[classes] / u[classes].sum()
    assert torch.allclose(rep, (class_w.unsqueeze(1) * protos).sum(0))  # [000] Eq. (2)
    onehot = F.one_hot(LABELS, C).double()
    assert torch.allclose(label, (w.unsqueeze(1) * onehot).sum(0))  # y~ = sum_i w_i y_i
    assert label[3] == 0 and label.sum().item() == pytest.approx(1.0)


def test_negative_draws_normalisation():
    u = torch.tensor([-2.0, 1.0, 1.0], dtype=torch.float64)
    assert torch.allclose(normalise(u, "abs"), torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    assert torch.allclose(normalise(u, "softmax"), torch.softmax(u, 0))


def test_soft_label_loss_equals_weighted_hard_label_form():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, C, generator=g, dtype=torch.float64)
    soft = torch.rand(4, C, generator=g, dtype=torch.float64)
    soft /= soft.sum(1, keepdim=True)
    # [000] Eq. (3): sum_k sum_c w_k^c CE(f(r_k), c)
    hard = sum(soft[k, c] * F.cross_entropy(logits[k : k + 1], torch.tensor([c])) for k in range(4) for c in range(C))
    assert isinstance(hard, torch.Tensor)
    assert soft_label_loss(logits, soft, "sum").item() == pytest.approx(hard.item(), rel=1e-12)
    assert soft_label_loss(logits, soft, "mean").item() == pytest.approx(hard.item() / 4, rel=1e-12)


def test_draws_are_seeded():
    assert torch.equal(weights("rap", seed=5)[0], weights("rap", seed=5)[0])
    assert not torch.equal(weights("rap", seed=5)[0], weights("rap", seed=6)[0])
