"""DisPFL on the neighbour graph: the per-message count at the paper's ResNet-18 (and how it explains
DRDFL's "#Comm" column), and the known properties on tiny real data (homo-cnn4): a message holds the
sender's weights at its mask only and counts those; aggregation averages each weight over the masks that
cover it (a weight held by one client keeps that client's value); mask evolution keeps every layer's
density; messages go along the round's graph edges only (``privfl verify`` agrees), a down node sends,
receives and trains nothing, and a killed run resumes to the same metrics and capture."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel
from privfl.kinds import KINDS
from privfl.methods.dispfl import (
    KIND,
    DisPFL,
    aggregate_sparse,
    drop_rate,
    erk_densities,
    evolve_mask,
    init_masks,
    pack_mask,
    sparse_aux,
    sparse_decode,
    sparse_encode,
    sparse_masks,
    unpack_mask,
)
from privfl.topology import Graph, parse_failures
from privfl.train import main as train_main
from privfl.verify import verify_run
from tests.helpers import FMNIST, ClientSpy, client_index, edges_of, metrics_without_time, read_metrics, seeded_resnet18
from tests.killer import InterruptAfter as KillAt
from tests.killer import Interrupted as Kill

TINY = ["--subsample", "300", "--partition", "iid", "--batch-size", "32", "--no-progress", "--model-group", "homo-cnn4"]
RANDOM = ["--num-clients", "5", "--rounds", "2", "--topology", "random", "--degree", "3", "--failures", "1@1"]
MI = 2**20  # DRDFL's "#Comm" column counts in units of 2^20 (see the counts tests)


def dis_snapshot(method: DisPFL, client: Any) -> dict[str, Any]:
    return {
        "params": {k: p.detach().clone() for k, p in client.model.named_parameters()},
        "mask": {k: m.clone() for k, m in method.masks[client.index].items()},
    }


def run_spied(out: Path, name: str, argv: list[str]) -> tuple[Path, ClientSpy]:
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    spy = ClientSpy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DisPFL, "train_client", spy.wrap(DisPFL.train_client, dis_snapshot))
        assert train_main(["dispfl", *TINY, *argv, "--out-dir", str(out), "--run-name", name]) == 0
    return out / name, spy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str], tuple[Path, ClientSpy]]:
    """Each tiny run trained once for the module: (run folder, what each client held around its training)."""
    out = tmp_path_factory.mktemp("graph-runs")
    plans = {
        "dis-ring": ["--num-clients", "3", "--rounds", "3"],
        "dis-random": RANDOM,
    }
    cache: dict[str, tuple[Path, ClientSpy]] = {}

    def get(name: str) -> tuple[Path, ClientSpy]:
        if name not in cache:
            cache[name] = run_spied(out, name, plans[name])
        return cache[name]

    return get


# ------------------------------------------------------------------------------------------ counts at ResNet-18


def test_dispfl_sends_the_weights_at_its_mask_and_explains_drdfls_106_65m():
    """ERK at density 0.5 keeps 5,590,818 of ResNet-18's 11,181,642 parameters (1-d ones dense); a message
    counts exactly those (the mask and shapes are aux), 20 per round on DRDFL's ring: 106.64 "M" against
    the printed 106.65M, half of DFedPGP's 213.36M."""
    model = seeded_resnet18()
    params = {k: p.detach() for k, p in model.named_parameters()}
    dens = erk_densities({k: tuple(p.shape) for k, p in params.items()}, 0.5)
    assert all(dens[k] == 1.0 for k, p in params.items() if p.dim() == 1) and min(dens.values()) < 0.5
    masks = init_masks(params, dens, torch.Generator().manual_seed(0))
    kept = sum(int(m.sum()) for m in masks.values())
    assert kept == sum(p.numel() if dens[k] == 1 else int(dens[k] * p.numel()) for k, p in params.items()) == 5_590_818
    assert abs(kept / sum(p.numel() for p in params.values()) - 0.5) < 1e-6
    tensors = sparse_encode(params, masks)
    msg = Channel(method="dispfl", sends=DisPFL.sends).send(Message(0, "client0", "client1", KIND, tensors, {"num_samples": 7}, sparse_aux(tensors)))
    mask_bytes = sum(-(-p.numel() // 8) for p in params.values())
    dims = sum(p.dim() for p in params.values())
    assert msg.paper_scalars == kept and msg.scalars == kept + mask_bytes + dims
    assert msg.nbytes == 4 * kept + mask_bytes + 8 * dims  # ~ half a dense model's 4 bytes per weight, plus 1 bit per weight
    assert round(20 * msg.paper_scalars / MI, 2) == 106.64 and abs(20 * kept / MI - 106.65) < 0.02
    dense = KINDS.get(KIND).dense(msg.tensors)  # what the receiver and an attacker work with
    for k, p in params.items():
        assert torch.equal(dense[k], p * masks[k])


# ------------------------------------------------------------------------------------------ DisPFL mechanics, exactly
def test_sparse_codec_round_trips_and_packs_the_mask_as_numpy():
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(1)
    w = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen), "dense": torch.randn(2)}
    m = {"a": torch.rand(3, 5, generator=gen) > 0.4, "b": torch.zeros(7, dtype=torch.bool)}
    enc = sparse_encode(w, m)
    assert torch.equal(enc["a@mask"], torch.from_numpy(np.packbits(m["a"].numpy().reshape(-1))))
    assert torch.equal(unpack_mask(enc["a@mask"], 15).reshape(3, 5), m["a"])
    assert enc["a@values"].numel() == int(m["a"].sum()) and enc["b@values"].numel() == 0
    dec = sparse_decode(enc)
    assert torch.equal(dec["a"], w["a"] * m["a"]) and torch.equal(dec["b"], torch.zeros(7)) and torch.equal(dec["dense"], w["dense"])
    assert set(sparse_masks(enc)) == {"a", "b"} and set(sparse_aux(enc)) == {"a@mask", "a@shape", "b@mask", "b@shape"}
    with pytest.raises(ValueError, match="values"):
        sparse_decode({**enc, "a@values": enc["a@values"][:-1]})


def test_aggregation_with_disjoint_masks_leaves_each_weight_at_its_owners_value():
    gen = torch.Generator().manual_seed(2)
    ma = torch.rand(4, 6, generator=gen) > 0.5
    mb = ~ma
    mb[0, 0] = mb[0, 1] = False  # covered by nobody (if a lacks them) -> 0
    wa, wb = torch.randn(4, 6, generator=gen) * ma, torch.randn(4, 6, generator=gen) * mb
    out = aggregate_sparse([({"w": wa}, {"w": ma}), ({"w": wb}, {"w": mb})])["w"]
    assert torch.equal(out, wa + wb)  # each weight is its sole owner's value, 0 where no mask covers it
    both = ma.clone()
    both[1] = True  # row 1 now covered by both: the mean there
    wa2 = torch.randn(4, 6, generator=gen) * both
    out = aggregate_sparse([({"w": wa2}, {"w": both}), ({"w": wb}, {"w": mb})])["w"]
    shared = both & mb
    assert torch.allclose(out[shared], (wa2[shared] + wb[shared]) / 2) and torch.equal(out[both & ~mb], wa2[both & ~mb])


def test_mask_evolution_prunes_smallest_regrows_largest_gradient_and_keeps_density():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(10, 10, generator=gen) > 0.5
    w, g = torch.randn(10, 10, generator=gen) * mask, torch.randn(10, 10, generator=gen)
    k = math.ceil(0.3 * int(mask.sum()))
    new = evolve_mask(mask, w, 0.3, g)
    assert int(new.sum()) == int(mask.sum())
    pruned, grown = mask & ~new, new & ~mask
    assert int(pruned.sum()) == int(grown.sum()) == k
    assert w[pruned].abs().max() <= w[mask & new].abs().min()  # the smallest active magnitudes went
    assert g[grown].abs().min() >= g[~mask & ~new].abs().max()  # the largest inactive gradients came
    rand = evolve_mask(mask, w, 0.3, None, torch.Generator().manual_seed(4))
    assert int(rand.sum()) == int(mask.sum()) and torch.equal(rand, evolve_mask(mask, w, 0.3, None, torch.Generator().manual_seed(4)))
    dense = torch.ones(5, dtype=torch.bool)
    assert torch.equal(evolve_mask(dense, torch.randn(5), 0.5, torch.randn(5)), dense)  # nothing to regrow: stays dense
    assert drop_rate(0, 10, 0.5) == 0.5 and drop_rate(5, 10, 0.5) == pytest.approx(0.25) and drop_rate(10, 10, 0.5) == pytest.approx(0)


# ------------------------------------------------------------------------------------------ DisPFL, trained
def test_dispfl_ring_sends_masked_weights_aggregates_over_masks_and_keeps_density(runs):
    run, spy = runs("dis-ring")
    assert verify_run(run).ok, verify_run(run).lines()
    capture = TensorStore(run / "capture", "capture")
    recs = capture.records()
    method = spy.method
    dens = method.densities
    names = list(dens)
    sizes = {k: p.numel() for k, p in method.env.clients[0].model.named_parameters()}
    kept = {k: sizes[k] if dens[k] == 1 else int(dens[k] * sizes[k]) for k in names}
    for rnd in (0, 1, 2):
        assert edges_of(recs, rnd) == Graph(3, "ring").edges(rnd)
    for rec in recs:
        tensors = capture.load(rec)
        masks = sparse_masks(tensors)
        assert rec["kind"] == KIND and rec["paper_scalars"] == sum(int(m.sum()) for m in masks.values()) == sum(kept.values())
        assert {k: int(m.sum()) for k, m in masks.items()} == kept  # every layer at its density, evolved masks too (round 2)
        i, rnd = client_index(rec["sender"]), rec["round"]
        if rnd:  # the weights and mask of the sender's last training, values only at that mask
            trained = spy.after[(rnd - 1, i)]
            dense = sparse_decode(tensors)
            for k in names:
                assert torch.equal(masks[k], trained["mask"][k]) and torch.equal(dense[k], trained["params"][k])
                assert not trained["params"][k][~trained["mask"][k]].any()
    assert any(not torch.equal(spy.after[(2, 0)]["mask"][k], spy.after[(0, 0)]["mask"][k]) for k in names if dens[k] < 1)  # masks evolved
    for (rnd, i), held in spy.before.items():  # aggregation: own + received, per weight over covering masks, times the own mask
        own = next(r for r in recs if r["round"] == rnd and client_index(r["sender"]) == i)
        got = [r for r in recs if r["round"] == rnd and client_index(r["receiver"]) == i]
        states = [(sparse_decode(t), sparse_masks(t)) for t in (capture.load(r) for r in (own, *got))]
        expected = aggregate_sparse(states)
        for k in names:
            assert torch.equal(held["params"][k], (expected[k] * held["mask"][k]).to(held["params"][k].dtype)), (rnd, i, k)
    for i in range(3):  # after three evolutions every layer still keeps its count
        assert {k: int(m.sum()) for k, m in method.masks[i].items()} == kept
    m = read_metrics(run)
    assert m[0]["drop_rate"] == 0.5 and m[1]["drop_rate"] == pytest.approx(0.375) and m[-1]["sparse_scalars"] == sum(kept.values())


def test_dispfl_random_graph_with_a_down_node(runs):
    run, spy = runs("dis-random")
    assert verify_run(run).ok, verify_run(run).lines()
    recs = TensorStore(run / "capture", "capture").records()
    graph = Graph(5, "random", 3, parse_failures("1@1", 5))
    for rnd in (0, 1):
        assert edges_of(recs, rnd) == graph.edges(rnd)
    assert not [r for r in recs if r["round"] == 1 and "client1" in (r["sender"], r["receiver"])]
    assert (1, 1) not in spy.before and sorted(i for r, i in spy.before if r == 1) == [0, 2, 3, 4]
    assert torch.equal(spy.after[(0, 1)]["params"]["head.weight"], spy.method.env.clients[1].model.head.weight.detach().cpu())  # untouched since


# ------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(
    "name, method, argv, kill_after",
    [("dis-ring", "dispfl", ["--num-clients", "3", "--rounds", "3"], 2)],
)
def test_killed_run_resumes_to_the_same_metrics_and_capture(runs, tmp_path, name, method, argv, kill_after):
    """DisPFL's two masks per node and DFedPGP's push-sum weights live in the checkpoint: a run killed inside
    round 1 and resumed ends as the uninterrupted one."""
    full, _ = runs(name)
    with pytest.raises(Kill):
        train_main([method, *TINY, *argv, "--out-dir", str(tmp_path), "--run-name", "killed"], callbacks=[KillAt(1, kill_after)])
    killed = tmp_path / "killed"
    assert len(read_metrics(killed)) == 1
    assert train_main(["--resume", str(killed), "--no-progress"]) == 0
    assert verify_run(killed).ok

    assert metrics_without_time(full) == metrics_without_time(killed)
    for store in ("capture", "truth"):
        assert TensorStore(full / store, store).records() == TensorStore(killed / store, store).records(), store


def test_mask_packing_pads_to_whole_bytes():
    m = torch.tensor([True] * 9)
    assert pack_mask(m).tolist() == [255, 128] and unpack_mask(pack_mask(m), 9).all()
