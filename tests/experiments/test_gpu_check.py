"""experiments/bench/gpu_check.py off the GPU: its CIFAR-10-shaped data is what privfl's CIFAR-10 loader reads,
and the script runs its parts (and reports a failed one) on the CPU, where both pairs of its determinism
part agree to the bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.bench.gpu_check import main, report, write_cifar10_shaped
from privfl.data import load_dataset
from tests.helpers import FMNIST


def test_cifar10_shaped_data_is_read_by_the_cifar10_loader_and_has_classes_to_learn(tmp_path: Path) -> None:
    write_cifar10_shaped(tmp_path, train=103, test=20, seed=1)
    ds = load_dataset("cifar10", tmp_path)
    assert len(ds) == 123 and tuple(ds.images.shape[1:]) == (3, 32, 32) and ds.images.dtype == torch.uint8
    assert ds.class_names[0] == "airplane" and ds.num_classes == 10
    train_labels = ds.labels[:103]
    per_batch = torch.stack([torch.bincount(torch.arange(n) % 10, minlength=10) for n in (21, 21, 21, 20, 20)]).sum(0)  # five batches
    assert torch.equal(torch.bincount(train_labels, minlength=10), per_batch)  # each batch balanced
    # a template per class: nearest class mean (from the train part) labels the test part almost perfectly
    x = ds.images.float().flatten(1)
    means = torch.stack([x[:103][train_labels == c].mean(0) for c in range(10)])
    predicted = torch.cdist(x[103:], means).argmin(1)
    assert (predicted == ds.labels[103:]).float().mean() >= 0.9


@pytest.mark.slow
@pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_script_runs_its_demo_part_on_the_cpu_and_reports_a_failed_part(tmp_path: Path) -> None:
    common = ["--device", "cpu", "--subsample", "300", "--steps", "5", "--targets", "1", "--no-cpu-baseline", "--out", str(tmp_path)]
    assert main([*common, "--parts", "demo", "--demo-rounds", "2"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    side = result["demo"]["sides"]["cpu"]
    assert side["train"]["rounds"] == 2 and len(side["train"]["wall_seconds"]) == 2
    assert set(side["invert"]["psnr"]) == {"rep", "proto", "ent_rep"} and side["invert"]["targets"] >= 1
    assert "| FedRE demo (Fashion-MNIST, cpu5) | cpu | 2 |" in (tmp_path / "gpu_check.md").read_text()
    # the determinism part: on the CPU both pairs of runs agree to the bit
    assert main([*common, "--parts", "determinism", "--det-rounds", "1", "--work", str(tmp_path / "work3")]) == 0
    det = json.loads((tmp_path / "gpu_check.json").read_text())["determinism"]
    for label in ("plain", "deterministic"):
        assert det[label]["metrics_equal"] and det[label]["capture_equal"] and det[label]["first_differing_round"] is None
        assert det[label]["messages"] > 0 and len(det[label]["s_per_round"]) == 2
    # no CIFAR-10 where --cifar-root points: the part fails, the script says so and exits 1
    paper = [*common, "--parts", "paper", "--cifar-root", str(tmp_path / "none"), "--paper-rounds", "1"]
    assert main([*paper, "--work", str(tmp_path / "work2")]) == 1
    assert "failed" in json.loads((tmp_path / "gpu_check.json").read_text())["paper"]
    # refused before anything runs (argparse: exit 2): the runs of an earlier check, a CPU without --subsample
    with pytest.raises(SystemExit) as refused:
        main(paper)
    assert refused.value.code == 2
    with pytest.raises(SystemExit) as refused:
        main(["--device", "cpu", "--parts", "paper", "--out", str(tmp_path / "other")])
    assert refused.value.code == 2 and not (tmp_path / "other").exists()


def test_the_report_shows_each_job_a_failed_part_and_a_diverged_training() -> None:
    train = {"rounds": 3, "engine_s_per_round": 34.1, "wall_s_per_round": 36.9, "acc": [0.9, 0.1, 0.2]}
    paper = {
        "data": "CIFAR-10-shaped synthetic",
        "train": {**train, "peak_allocated_bytes": 2**31, "peak_reserved_bytes": 2**32, "nonfinite": {"server_loss": 1}},
        "invert": {"seconds_per_target": 10.7, "psnr": {"best": 9.3, "mean": 9.0}},
    }
    results = {"device": "cuda", "device_type": "cuda", "device_name": "GPU", "torch": "2", "threads": 16, "paper": paper}
    text = report({**results, "demo": {"failed": "Traceback ...\nRuntimeError: broke\n"}})
    assert "| FedRE paper HtM10 (CIFAR-10-shaped synthetic) | cuda | 3 | 34.10 | 36.90 | 2.00 | 4.00 | 0.2000 | 10.70 | best 9.3, mean 9.0 |" in text
    assert "| FedRE demo (Fashion-MNIST, cpu5) | cuda | failed: RuntimeError: broke |" in text
    assert text.endswith("FedRE paper HtM10 (CIFAR-10-shaped synthetic) on cuda: server_loss non-finite from round 1")


def test_the_report_says_which_pair_of_runs_differs_and_from_which_round() -> None:
    side = {"metrics_equal": True, "capture_equal": True, "first_differing_round": None, "s_per_round": [2.0, 2.2], "acc": [0.75, 0.75]}
    plain = {**side, "metrics_equal": False, "capture_equal": False, "first_differing_round": 1, "acc": [0.75, 0.76]}
    det = {"setting": "demo, cpu5", "rounds": 3, "plain": plain, "deterministic": {**side, "nondeterministic_ops": ["op_cuda"]}, "slowdown": 1.25}
    text = report({"device": "cuda", "device_type": "cuda", "device_name": "GPU", "torch": "2", "threads": 16, "determinism": det})
    assert "| job |" not in text  # no paper or demo part: no empty table
    assert "| FedRE demo, cpu5 twice on cuda |" in text
    assert "| plain | False | False | 1 | 2.00 / 2.20 | 0.7500 / 0.7600 |" in text
    assert "| deterministic | True | True | - | 2.00 / 2.20 | 0.7500 / 0.7500 |" in text
    assert "--deterministic / plain seconds per round: 1.25x" in text and text.endswith("(torch warned): op_cuda")
