"""Defenses as channel mods: what reaches the receiver and the capture, and how they are configured."""

from __future__ import annotations

import math

import pytest
import torch

from defenses import DEFENSES, ClientAccountant, build_defenses, parse_defense
from defenses.transforms import ClientDP, Clip, GaussianNoise, Quantize, RepNoise, TopK, global_norm
from privfl.capture import Message, TensorStore
from privfl.channel import Channel
from privfl.errors import ConfigError, UnknownNameError
from privfl.kinds import kinds_of

#: what each kind's uploads must say (privfl.kinds): the samples behind an update, the batch of a gradient
REQUIRED_META = {"grad": {"batch_size": 1}, "update": {"num_samples": 1}, "model": {"num_samples": 1}, "head": {"num_samples": 1}}


def up(kind: str, tensors: dict[str, torch.Tensor], *, round: int = 0, sender: str = "client0", aux=()) -> Message:
    return Message(round, sender, "server", kind, tensors, {"note": "x", **REQUIRED_META.get(kind, {})}, tuple(aux))


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- gaussian ------------------------------------------------------------------------------------


def test_gaussian_std_and_reproducible():
    x = torch.zeros(200_000)
    ch = Channel(mods=[GaussianNoise(sigma=0.05, seed=3)])
    got = ch.send(up("update", {"w": x}))
    assert got.tensors["w"].std().item() == pytest.approx(0.05, rel=0.02)
    assert abs(got.tensors["w"].mean().item()) < 1e-3
    again = Channel(mods=[GaussianNoise(sigma=0.05, seed=3)]).send(up("update", {"w": x}))
    assert torch.equal(got.tensors["w"], again.tensors["w"])
    other_seed = Channel(mods=[GaussianNoise(sigma=0.05, seed=4)]).send(up("update", {"w": x}))
    other_round = ch.send(up("update", {"w": x}, round=1))
    assert not torch.equal(got.tensors["w"], other_seed.tensors["w"])
    assert not torch.equal(got.tensors["w"], other_round.tensors["w"])


def test_new_message_keeps_header_and_sender_tensors():
    x = torch.ones(10)
    msg = up("update", {"w": x})
    got = GaussianNoise(sigma=1.0)(msg, Channel().context)
    assert got is not msg
    assert (got.round, got.sender, got.receiver, got.kind, got.meta, got.aux) == (
        0,
        "client0",
        "server",
        "update",
        {"note": "x", "num_samples": 1},
        (),
    )
    assert torch.equal(msg.tensors["w"], torch.ones(10))  # the sender's tensors are not modified in place
    assert not torch.equal(got.tensors["w"], x)


def test_aux_and_integer_tensors_untouched():
    tensors = {
        "w": torch.zeros(50),
        "num_batches_tracked": torch.tensor(7),
        "label": torch.arange(5).float(),
        "ids": torch.arange(5),
    }
    got = Channel(mods=[GaussianNoise(sigma=1.0)]).send(up("grad", tensors, aux=("label",)))
    assert not torch.equal(got.tensors["w"], tensors["w"])
    for k in ("num_batches_tracked", "label", "ids"):
        assert torch.equal(got.tensors[k], tensors[k]) and got.tensors[k].dtype == tensors[k].dtype


def test_half_precision_keeps_dtype():
    got = Channel(mods=[GaussianNoise(sigma=0.1)]).send(up("update", {"w": torch.zeros(100, dtype=torch.float16)}))
    assert got.tensors["w"].dtype == torch.float16 and got.tensors["w"].abs().sum() > 0


# --- updates, not parameters ---------------------------------------------------------------------


def test_parameter_message_is_defended_as_update():
    ch = Channel(mods=[Clip(max_norm=0.5)])
    g = {"a": randn(20, 10, seed=1), "b": randn(10, seed=2)}
    ch.broadcast(0, ["client0", "client1"], "model", g)  # down: untouched by default
    local = {k: v + randn(*v.shape, seed=5) for k, v in g.items()}  # update norm ~ 15 > 0.5
    got = ch.send(up("model", local))
    delta = {k: got.tensors[k] - g[k] for k in g}
    assert global_norm(delta) == pytest.approx(0.5, rel=1e-4)
    # direction of the update is kept
    raw = {k: local[k] - g[k] for k in g}
    scale = global_norm(raw) / 0.5
    for k in g:
        torch.testing.assert_close(delta[k] * scale, raw[k], rtol=1e-4, atol=1e-4)


def test_without_reference_acts_on_tensors():
    got = Channel(mods=[Clip(max_norm=1.0)]).send(up("head", {"w": torch.full((4,), 3.0)}))
    assert global_norm(got.tensors) == pytest.approx(1.0, rel=1e-6)


def test_update_kind_ignores_reference():
    ch = Channel(mods=[Clip(max_norm=1.0)])
    ch.broadcast(0, ["client0"], "update", {"w": torch.full((4,), 100.0)})
    got = ch.send(up("update", {"w": torch.full((4,), 3.0)}))
    assert global_norm(got.tensors) == pytest.approx(1.0, rel=1e-6)


# --- clip ----------------------------------------------------------------------------------------


def test_clip_bounds_norm_and_keeps_small_updates():
    ch = Channel(mods=[Clip(max_norm=1.0)])
    big = {"a": randn(100, seed=1) * 5, "b": randn(3, 3, seed=2) * 5, "n": torch.tensor(3)}
    got = ch.send(up("grad", big))
    float_part = {k: v for k, v in got.tensors.items() if k != "n"}
    assert global_norm(float_part) <= 1.0 + 1e-6
    assert global_norm(float_part) == pytest.approx(1.0, rel=1e-5)
    small = {"a": torch.full((4,), 0.1)}
    got = ch.send(up("grad", small))
    assert torch.equal(got.tensors["a"], small["a"])


# --- topk ----------------------------------------------------------------------------------------


def test_topk_keeps_exact_count_of_largest():
    x = randn(1000, seed=7)
    y = randn(7, 3, seed=8)
    got = Channel(mods=[TopK(keep=0.1)]).send(up("grad", {"x": x, "y": y}))
    gx = got.tensors["x"]
    assert int((gx != 0).sum()) == 100
    kept = gx != 0
    assert torch.equal(gx[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()
    assert int((got.tensors["y"] != 0).sum()) == math.ceil(0.1 * 21)
    full = Channel(mods=[TopK(keep=1.0)]).send(up("grad", {"x": x}))
    assert torch.equal(full.tensors["x"], x)


def test_topk_on_model_keeps_reference_elsewhere():
    ch = Channel(mods=[TopK(keep=0.25)])
    g = {"w": randn(40, seed=1)}
    ch.broadcast(0, ["client0"], "model", g)
    local = {"w": g["w"] + randn(40, seed=2)}
    got = ch.send(up("model", local))
    changed = ~torch.isclose(got.tensors["w"], g["w"], atol=1e-7, rtol=0)
    assert int(changed.sum()) == 10
    torch.testing.assert_close(got.tensors["w"][changed], local["w"][changed])


# --- quantize ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_quantize_levels_and_error(bits: int):
    x = randn(5000, seed=bits)
    got = Channel(mods=[Quantize(bits=bits)]).send(up("update", {"x": x, "c": torch.full((5,), 2.0)}))
    q = got.tensors["x"]
    assert q.unique().numel() <= 2**bits
    step = (x.max() - x.min()) / (2**bits - 1)
    assert (q - x).abs().max() <= step / 2 + 1e-5
    assert torch.equal(got.tensors["c"], torch.full((5,), 2.0))  # constant tensor: nothing to quantise


# --- repnoise ------------------------------------------------------------------------------------


def test_repnoise_changes_rep_not_label():
    rep, label = randn(128, seed=1), torch.softmax(randn(10, seed=2), dim=0)
    ch = Channel(mods=[RepNoise(sigma=0.1)])
    got = ch.send(up("ent_rep", {"rep": rep, "label": label}))  # the kind makes "label" aux
    assert not torch.equal(got.tensors["rep"], rep)
    assert (got.tensors["rep"] - rep).std().item() == pytest.approx(0.1, rel=0.25)
    assert torch.equal(got.tensors["label"], label)
    # parameter kinds are not repnoise's by default
    head = {"w": randn(4, seed=3)}
    assert torch.equal(ch.send(up("head", head)).tensors["w"], head["w"])


# --- kinds / directions --------------------------------------------------------------------------


def test_kinds_and_directions_filtering():
    head = {"w": randn(10, seed=1)}
    ch = Channel(mods=[GaussianNoise(sigma=1.0)])
    sent = ch.broadcast(0, ["client0"], "head", head)
    assert torch.equal(sent["client0"].tensors["w"], head["w"])  # server broadcast: untouched by default
    protos = {"protos": randn(3, 4, seed=2), "classes": torch.arange(3)}
    assert torch.equal(ch.send(up("proto", protos)).tensors["protos"], protos["protos"])  # not a parameter kind
    peer = Message(0, "client0", "client1", "head", head, {"num_samples": 1})
    assert torch.equal(ch.send(peer).tensors["w"], head["w"])

    both = Channel(mods=[parse_defense("gaussian:sigma=1,directions=up+down,kinds=head")])
    assert not torch.equal(both.broadcast(0, ["client0"], "head", head)["client0"].tensors["w"], head["w"])
    g = {"w": randn(10, seed=4)}
    assert torch.equal(both.send(up("grad", g)).tensors["w"], g["w"])  # grad not in kinds=head


# --- parsing -------------------------------------------------------------------------------------


def test_registry_names():
    assert DEFENSES.names() == ["clip", "dp", "gaussian", "quantize", "repnoise", "topk"]
    for name in DEFENSES:
        cls = DEFENSES.get(name)
        assert cls.name == name and cls.paper and cls.__doc__ and cls.families and cls.default_kinds()


def test_parse_round_trip():
    d = parse_defense("gaussian:sigma=0.01,kinds=update+model")
    assert isinstance(d, GaussianNoise)
    assert d.params.sigma == 0.01 and d.params.seed == 0
    assert d.kinds == {"update", "model"} and d.directions == {"up"}
    assert parse_defense(d.spec).params == d.params
    q = parse_defense(" quantize : bits=4 , directions=up+down ")
    assert q.params.bits == 4 and isinstance(q.params.bits, int) and q.directions == {"up", "down"}
    dp = parse_defense("dp:max_norm=2,noise_multiplier=0.5,delta=1e-6,sample_rate=0.1,seed=9")
    assert (dp.params.max_norm, dp.params.noise_multiplier, dp.params.delta, dp.params.sample_rate, dp.params.seed) == (
        2.0,
        0.5,
        1e-6,
        0.1,
        9,
    )
    for name in DEFENSES:
        default = parse_defense(name)
        assert parse_defense(default.spec).params == default.params
        assert default.kinds == default.default_kinds() == kinds_of(default.families)
    assert [type(x) for x in build_defenses(["clip", "topk:keep=0.5"])] == [Clip, TopK]


@pytest.mark.parametrize(
    "spec, error, text",
    [
        ("nope:sigma=1", UnknownNameError, "accepted: clip, dp, gaussian, quantize, repnoise, topk"),
        ("gaussian:foo=1", ConfigError, "accepted: kinds, directions, sigma, seed"),
        ("gaussian:sigma=-1", ConfigError, "sigma must be in [0, inf)"),
        ("gaussian:sigma=abc", ConfigError, "sigma must be a number"),
        ("clip:max_norm=-0.5", ConfigError, "max_norm must be in (0, inf)"),
        ("dp:max_norm=-1", ConfigError, "max_norm must be in (0, inf)"),
        ("dp:delta=2", ConfigError, "delta must be in (0, 1)"),
        ("dp:sample_rate=0", ConfigError, "sample_rate must be in (0, 1]"),
        ("topk:keep=0", ConfigError, "keep must be in (0, 1]"),
        ("topk:keep=1.5", ConfigError, "keep must be in (0, 1]"),
        ("quantize:bits=0", ConfigError, "bits must be in [1, 16]"),
        ("quantize:bits=17", ConfigError, "bits must be in [1, 16]"),
        ("quantize:bits=2.5", ConfigError, "bits must be an integer"),
        ("clip:kinds=model+weights", ConfigError, "unknown kinds weights; accepted: ent_rep"),
        ("clip:directions=sideways", ConfigError, "accepted: down, peer, up"),
        ("gaussian:sigma", ConfigError, "expected key=value"),
        ("gaussian:sigma=1,sigma=2", ConfigError, "given twice"),
        ("", ConfigError, "empty defense spec"),
    ],
)
def test_parse_errors_are_one_line(spec: str, error: type, text: str):
    with pytest.raises(error) as info:
        parse_defense(spec)
    message = str(info.value)
    assert "\n" not in message and text in message


def test_constructor_rejects_unknown_params():
    with pytest.raises(ConfigError, match="accepted: kinds, directions, max_norm"):
        Clip(norm=1.0)
    assert Clip(max_norm=2).params.max_norm == 2.0
    assert Clip(kinds=["grad"]).kinds == {"grad"}


# --- dp ------------------------------------------------------------------------------------------


def test_dp_clips_then_noises():
    x = {"w": torch.full((100_000,), 1.0)}  # norm ~316 -> clipped to max_norm
    got = Channel(mods=[ClientDP(max_norm=2.0, noise_multiplier=0.5)]).send(up("grad", x))
    clipped = 2.0 / math.sqrt(100_000)
    residual = got.tensors["w"] - clipped
    assert residual.std().item() == pytest.approx(1.0, rel=0.02)  # z * max_norm
    assert abs(residual.mean().item()) < 0.02


def test_dp_accounting_matches_opacus():
    from opacus.accountants import RDPAccountant

    dp = ClientDP(max_norm=1.0, noise_multiplier=1.1, delta=1e-5, sample_rate=0.2)
    ch = Channel(mods=[dp])
    for rnd in range(3):
        ch.broadcast(rnd, ["client0", "client1"], "head", {"w": torch.zeros(4)})
        ch.send(up("head", {"w": torch.ones(4)}, round=rnd))
        ch.send(up("grad", {"g": torch.ones(4)}, round=rnd))  # second message this round: no extra step
        if rnd == 0:
            ch.send(up("head", {"w": torch.ones(4)}, round=rnd, sender="client1"))
    rep = dp.report()
    assert rep["accountant"] == "opacus RDP" and rep["delta"] == 1e-5
    assert rep["steps"] == {"client0": 3, "client1": 1}
    eps = rep["epsilon"]
    assert set(eps) == {"client0", "client1"}
    assert eps["client0"] > eps["client1"] > 0

    direct = RDPAccountant()
    for _ in range(3):
        direct.step(noise_multiplier=1.1, sample_rate=0.2)
    assert eps["client0"] == pytest.approx(direct.get_epsilon(delta=1e-5), rel=1e-12)


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    def eps(noise: float, steps: int) -> float:
        acc = ClientAccountant(noise, 0.1, 1e-5)
        for r in range(steps):
            acc.record("c", r)
            acc.record("c", r)  # same round twice counts once
        assert acc.steps("c") == steps
        return acc.epsilon("c")

    assert eps(1.0, 1) < eps(1.0, 5) < eps(1.0, 20)
    assert eps(2.0, 5) < eps(1.0, 5) < eps(0.7, 5)
    assert ClientAccountant(1.0, 1.0, 1e-5).epsilon("never") == 0.0


# --- capture -------------------------------------------------------------------------------------


def test_capture_records_defended_tensors(tmp_path):
    store = TensorStore(tmp_path / "capture", "capture", create=True)
    ch = Channel(capture=store, mods=build_defenses(["clip:max_norm=0.5", "gaussian:sigma=0.01"]))
    g = {"w": randn(30, seed=1), "n": torch.tensor(2)}
    ch.broadcast(0, ["client0"], "model", g)
    local = {"w": g["w"] + randn(30, seed=2), "n": torch.tensor(3)}
    delivered = ch.send(up("model", local))
    ch.end_round()
    records = TensorStore(tmp_path / "capture", "capture").records()
    assert [r["kind"] for r in records] == ["model", "model"]
    captured_down = store.load(records[0])
    captured_up = store.load(records[1])
    assert torch.equal(captured_down["w"], g["w"])
    assert torch.equal(captured_up["w"], delivered.tensors["w"])
    assert not torch.equal(captured_up["w"], local["w"])
    assert torch.equal(captured_up["n"], torch.tensor(3))
    # clipped to 0.5, then noise of std 0.01 on 30 entries: norm stays close to 0.5
    assert global_norm({"w": captured_up["w"] - g["w"]}) == pytest.approx(0.5, abs=0.15)
