"""Every built-in method written in roles gives on Flower the run it gives in-process (byte for byte).

One Flower simulation per method (tens of seconds each, mostly Ray's start-up): marked slow, run by
``pytest -m slow``; the default suite checks FedAvg and FedRE (tests/engine/test_flower.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import assert_flower_equals_inprocess

HOMO = ["--model-group", "homo-cnn4"]
HETE = ["--model-group", "cpu5", "--rep-dim", "64"]


#: every built-in method but FedAvg and FedRE (tests/engine/test_flower.py), each with a setting that exercises
#: what its roles add (stragglers, partial selection, setup exchange, sharing step, graphs with an outage)
CASES = [
    ("local", HETE),
    ("fedallrep", HETE),
    ("fedgh", HETE),
    ("fedproto", HETE),
    ("fedtgp", HETE),
    ("fpl", HETE),
    ("lgfedavg", HETE),
    ("fednova", HOMO),
    ("fedsgd", HOMO),
    ("fedbn", ["--model-group", "homo-resnet-tiny"]),
    ("dfedpgp", HOMO),
    ("fedprox", [*HOMO, "--stragglers", "0.5", "--local-epochs", "2"]),
    ("fedgen", [*HETE, "--join-ratio", "0.5"]),
    ("fedavgdbe", [*HOMO, "--knowledge-every", "1"]),
    ("fedmrl", ["--model-group", "cpu5", "--join-ratio", "0.5"]),
    ("fedfree", ["--model-group", "cpu5"]),
    ("fedfed", ["--width", "8", "--latent-dim", "16", "--distill-rounds", "1"]),
    ("fedrep", [*HOMO, "--join-ratio", "0.5"]),
    ("perfedavg", [*HOMO, "--eval", "both"]),
    ("pfedla", [*HOMO, "--join-ratio", "0.5"]),
    ("fedala", [*HOMO, "--join-ratio", "0.5"]),
    ("fml", ["--model-group", "cpu5", "--join-ratio", "0.5"]),
    ("fedapen", ["--model-group", "cpu5", "--join-ratio", "0.5"]),
    ("fd", [*HETE, "--join-ratio", "0.5", "--global-logits", "others"]),
    ("fedkd", [*HETE, "--join-ratio", "0.5"]),
    ("dispfl", [*HOMO, "--topology", "random", "--degree", "1", "--failures", "2@1"]),
    ("fedcvae", ["--model-group", "cpu5", "--topology", "random", "--degree", "1", "--failures", "2@1"]),
    ("drdfl", ["--failures", "2@1"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("method, extra", CASES)
def test_flower_equals_inprocess(tmp_path: Path, method: str, extra: list[str]) -> None:
    assert_flower_equals_inprocess(tmp_path, method, extra)


def test_every_method_is_covered() -> None:
    """A new built-in method must be added above (every method is written in roles, so it runs on Flower)."""
    from privfl.methods import METHODS

    assert {m for m, _ in CASES} | {"fedavg", "fedre"} == set(METHODS.names())
    assert all(METHODS.get(m).in_roles() for m in METHODS.names())
