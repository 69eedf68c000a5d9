"""``--memory-format``: a model computes in channels-last only while it trains or is evaluated; everywhere
else its tensors are contiguous; a user's own module is left in NCHW under ``auto``; a bound client model
is bound to its broadcast again afterwards; a run saved before the option resumes in NCHW."""

from __future__ import annotations

import json

import torch
from torch import nn

from privfl.fl.layout import compute_layout, wants_channels_last
from privfl.fl.shared import SharedTensors, bind_shared
from privfl.models import build_model
from privfl.run import Run, load_checkpoint_state, read_checkpoint
from tests.helpers import cli_error, metrics_without_time, needs_fmnist, read_metrics, train

TINY = ["--subsample", "300", "--partition", "iid", "--num-clients", "3", "--batch-size", "32", "--no-progress", "--model-group", "homo-cnn4"]


class Reshapes(nn.Module):
    """A user's module that flattens with ``.view``, which a channels-last activation refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return h.view(h.shape[0], -1)


def _cnn4() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn4", in_channels=1, num_classes=10, image_size=28)


def test_which_models_compute_in_channels_last():
    cnn, mlp, own = _cnn4(), build_model("mlp", in_channels=1, num_classes=10, image_size=28), Reshapes()
    assert wants_channels_last(cnn, "auto") and wants_channels_last(cnn, "channels_last")
    assert not wants_channels_last(cnn, "contiguous")
    assert not wants_channels_last(mlp, "auto") and not wants_channels_last(mlp, "channels_last")  # no 4-D tensor
    assert not wants_channels_last(own, "auto") and wants_channels_last(own, "channels_last")
    with compute_layout(own, "auto"):  # left in NCHW: its .view works
        own(torch.randn(2, 1, 8, 8))


def test_layout_holds_only_inside_the_block():
    """Inside: channels-last, the same parameter objects (an optimizer made before stays valid), the same
    values; after: contiguous again, values as training left them."""
    model = _cnn4()
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 1, 28, 28)
    expected = model(x)
    with compute_layout(model, "auto"):
        conv = model.get_parameter("features.3.weight")
        assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
        assert list(model.parameters()) == params
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)  # another summation order, same function
        with torch.no_grad():
            conv.add_(1.0)
    assert all(v.is_contiguous() for v in model.state_dict().values())
    assert list(model.parameters()) == params
    assert torch.equal(conv, before["features.3.weight"] + 1.0)


def test_a_bound_model_is_bound_again_after_evaluation():
    source = _cnn4()
    shared = SharedTensors({k: v.detach().clone() for k, v in source.state_dict().items()})
    with torch.device("meta"):
        model = build_model("cnn4", in_channels=1, num_classes=10, image_size=28)
    bind_shared(model, shared)
    with torch.no_grad(), compute_layout(model.eval(), "channels_last"):
        model(torch.randn(2, 1, 28, 28))
    shared.check()
    state = model.state_dict()
    assert all(state[k].data_ptr() == v.data_ptr() for k, v in shared.tensors.items())  # views of the one copy, no own copy


@needs_fmnist
def test_channels_last_runs_are_deterministic_and_store_contiguous_tensors(tmp_path):
    """Same seed, same numbers in either layout; the layouts differ only by summation order (close accuracy);
    checkpoint tensors are contiguous (as every message)."""
    torch.set_num_threads(1)
    args = [*TINY, "--rounds", "2"]
    a = train(tmp_path, "fedavg", *args, "--memory-format", "channels_last", name="cl-a")
    b = train(tmp_path, "fedavg", *args, "--memory-format", "channels_last", name="cl-b")
    c = train(tmp_path, "fedavg", *args, "--memory-format", "contiguous", name="nchw")

    assert metrics_without_time(a) == metrics_without_time(b)
    assert metrics_without_time(a) != metrics_without_time(c)  # the layout is in effect: the losses differ in the last bits
    assert abs(read_metrics(a)[-1]["acc"] - read_metrics(c)[-1]["acc"]) < 0.1
    pointer = read_checkpoint(a)
    assert pointer is not None
    assert all(t.is_contiguous() for t in load_checkpoint_state(a, pointer).values())


@needs_fmnist
def test_a_run_saved_before_the_option_keeps_nchw(tmp_path):
    """config.json without memory_format (a run from before 2026-11-26): reopened or resumed, it computes in
    NCHW as it did, so a resumed old run continues with the numbers it would have had."""
    run = train(tmp_path, "fedavg", *TINY, "--rounds", "1", name="old")
    path = run / "config.json"
    config = json.loads(path.read_text())
    assert config["memory_format"] == "auto"
    del config["memory_format"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    assert Run(run).cfg.memory_format == "contiguous"
    from privfl.config import load_saved_config

    assert load_saved_config(run)["memory_format"] == "contiguous"


def test_memory_format_is_checked_before_anything_is_created(tmp_path, capsys):
    from privfl.train import main

    err = cli_error(capsys, main, ["fedavg", "--memory-format", "nhwc", "--out-dir", str(tmp_path)])
    assert "memory" in err and not any(tmp_path.iterdir())
