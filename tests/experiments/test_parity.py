"""The HtFLlib parity harness (experiments/parity), without HtFLlib: the export and the parsing.

The export must hand HtFLlib exactly privfl's partition (same samples per client, same order, privfl's
normalised inputs) in HtFLlib's npz layout, and refuse bad input with one line and exit status 2 before
creating anything. Everything runs on a tiny Fashion-MNIST-format dataset written here.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import ROOT, pythonpath

PARITY = ROOT / "experiments" / "parity"
#: HtFLlib's FedAvgCNN(in_features=1, dim=1024) with its fc swapped for Linear(512, 10) (BaseHeadSplit)
FEDAVGCNN_SHAPES = [[32, 1, 5, 5], [32], [64, 32, 5, 5], [64], [512, 1024], [512], [10, 512], [10]]


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PARITY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _write_idx(path: Path, array: np.ndarray) -> None:
    payload = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + np.ascontiguousarray(array, np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """Fashion-MNIST's four IDX files with 200 + 40 random 28x28 images, 10 classes."""
    root = tmp_path_factory.mktemp("fm")
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(240, 28, 28), dtype=np.uint8)
    labels = (np.arange(240) * 7 % 10).astype(np.uint8)
    _write_idx(root / "train-images-idx3-ubyte.gz", imgs[:200])
    _write_idx(root / "train-labels-idx1-ubyte.gz", labels[:200])
    _write_idx(root / "t10k-images-idx3-ubyte.gz", imgs[200:])
    _write_idx(root / "t10k-labels-idx1-ubyte.gz", labels[200:])
    return root


PARTITION = ["--subsample", "180", "--num-clients", "3", "--partition", "iid", "--seed", "3"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_root: Path) -> Path:
    """A one-round privfl run on the tiny data, as the harness trains it (HtFLlib's order and init)."""
    from privfl.train import main as train_main

    out = tmp_path_factory.mktemp("runs")
    argv = ["local", "--dataset", "fashionmnist", "--data-root", str(data_root), *PARTITION, "--rounds", "1", "--batch-size", "16"]
    argv += ["--model-group", "homo-cnn4", "--same-init", "--no-shuffle", "--drop-last", "--device", "cpu", "--no-progress"]
    assert train_main([*argv, "--out-dir", str(out), "--run-name", "r"]) == 0
    return out / "r"


def test_export_holds_exactly_the_runs_partition_in_htfllibs_layout(run_dir: Path, data_root: Path, tmp_path: Path, capsys):
    from privfl.run import Run, load_partition, load_pool

    exporter = _load("export_htfllib")
    out = tmp_path / "dataset" / "fm"
    assert exporter.cli(["--run", str(run_dir), "--out", str(out)]) == 0
    _, images, labels, _ = load_pool(Run(run_dir))
    part = load_partition(run_dir)
    config = json.loads((out / "config.json").read_text())
    assert config["num_clients"] == 3 and config["num_classes"] == 10 and config["partition"] == "iid" and config["batch_size"] == 16
    for k in range(3):
        held = []
        for split in ("train", "test"):
            idx = part[f"{split}_{k}"]
            # HtFLlib's reader: np.load(f, allow_pickle=True)['data'].tolist(), then float32 x and int64 y
            with open(out / split / f"{k}.npz", "rb") as f:
                data = np.load(f, allow_pickle=True)["data"].tolist()
            assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64
            assert np.array_equal(data["y"], labels[idx].numpy())
            # privfl's normalisation (x/255 - 0.5)/0.5, bit for bit, in privfl's --no-shuffle order (ascending)
            assert torch.equal(torch.from_numpy(data["x"]), (images[idx].float() / 255.0 - 0.5) / 0.5)
            assert torch.equal(idx, idx.sort().values)
            held.append(len(idx))
        stat = dict(map(tuple, config["Size of samples for labels in clients"][k]))
        assert sum(stat.values()) == sum(held)
    assert "wrote 3 clients" in capsys.readouterr().out


def test_export_from_train_options_draws_the_same_partition_as_training(run_dir: Path, data_root: Path, tmp_path: Path):
    exporter = _load("export_htfllib")
    a, b = tmp_path / "a", tmp_path / "b"
    assert exporter.cli(["--run", str(run_dir), "--out", str(a)]) == 0
    assert exporter.cli(["--out", str(b), "local", "--dataset", "fashionmnist", "--data-root", str(data_root), *PARTITION, "--batch-size", "16"]) == 0
    for split in ("train", "test"):
        for k in range(3):
            x, y = exporter.read_htfllib_client(a, k, split), exporter.read_htfllib_client(b, k, split)
            assert np.array_equal(x["x"], y["x"]) and np.array_equal(x["y"], y["y"])


def test_export_refuses_bad_input_with_one_line_and_creates_nothing(run_dir: Path, data_root: Path, tmp_path: Path, capsys):
    exporter = _load("export_htfllib")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    not_run = tmp_path / "not_a_run"
    not_run.mkdir()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((run_dir / "config.json").read_text())
    (damaged / "truth").mkdir()
    (damaged / "truth" / "partition.safetensors").write_bytes(b"\x00garbage")
    out = tmp_path / "new" / "fm"
    cases = [
        ["--run", str(tmp_path / "missing"), "--out", str(out)],  # no such run
        ["--run", str(not_run), "--out", str(out)],  # a folder that is not a run
        ["--run", str(damaged), "--out", str(out)],  # a damaged partition file
        ["--run", str(run_dir), "--out", str(busy)],  # an output folder that holds something
        ["--run", str(run_dir), "--out", str(a_file)],  # an output that is a file
        ["--run", str(run_dir), "--out", str(out), "--rounds", "3"],  # --run with privfl.train options
        ["--out", str(out), "--dataset", "fashionmnist", "--data-root", str(data_root), "--subsample", "50", "--num-clients", "40"],  # impossible
        ["--out", str(out), "--dataset", "nosuchset"],  # unknown dataset
        ["--out", str(out), "--no-such-flag"],  # unknown option
        ["--run", str(run_dir)],  # no --out
    ]
    for argv in cases:
        capsys.readouterr()
        assert exporter.cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err, (argv, err)
        assert not (tmp_path / "new").exists(), argv
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"] and (busy / "keep.txt").read_text() == "mine"
    assert a_file.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "damaged", "file.txt", "not_a_run"]  # no temporary folder left


def test_privfl_cnn4_has_htfllibs_fedavgcnn_shapes():
    from privfl.models import build_model

    model = build_model("cnn4", in_channels=1, num_classes=10, image_size=28, rep_dim=512, mapping="ap")
    assert [list(p.shape) for p in model.parameters()] == FEDAVGCNN_SHAPES
    parity = _load("run_parity")
    assert parity.cnn_flat_dim(28) == 1024 and parity.cnn_flat_dim(32) == 1600  # HtFLlib's dim for 28x28 and 32x32 inputs


def test_htfllib_output_is_aligned_to_privfl_rounds(tmp_path: Path):
    parity = _load("run_parity")
    model = {"constructor": "FedAvgCNN(...)", "params": [[f"p{i}", s] for i, s in enumerate(FEDAVGCNN_SHAPES)]}
    result = {"threads": 1, "runs": [{"file": "x.h5", "rs_test_acc": [0.1, 0.5, 0.7, 0.6]}]}
    log = tmp_path / "m.log"
    lines = ["Averaged Test Accuracy: 0.1000", "------------------------- time cost ------------------------- 3.0"]
    lines += ["-" * 50 + " 2.0", "-" * 50 + " 4.0", "-" * 50 + " 9.0"]
    log.write_text("\n".join([f"PARITY-MODEL {json.dumps(model)}", *lines, f"PARITY-RESULT {json.dumps(result)}"]) + "\n")
    side = parity.htfllib_side(log, rounds=3)
    assert side["acc_untrained"] == 0.1 and side["acc"] == [0.5, 0.7, 0.6]  # start of round r+1 = privfl's round r
    assert side["final_acc"] == 0.6 and side["best_acc"] == 0.7 and side["best_round"] == 1
    assert side["s_per_round"] == 5.0  # rounds 1..R, as HtFLlib's own average (round 0 left out)
    with pytest.raises(ValueError, match="evaluated 4 times"):
        parity.htfllib_side(log, rounds=5)
    check = parity.compare_models([[f"q{i}", s] for i, s in enumerate(FEDAVGCNN_SHAPES)], side["model"])
    assert check["same_shapes_in_order"] and check["privfl_params"] == check["htfllib_params"] == 582026
    mine = {"acc": [0.6, 0.75, 0.65], "final_acc": 0.65, "best_acc": 0.75, "s_per_round": 1.0}
    row = parity.flat_row({"method": "m", "seed": 0, "privfl": mine, "htfllib": side})
    assert row["diff_final"] == pytest.approx(0.05) and row["diff_best"] == pytest.approx(0.05)
    assert row["htfllib_last5"] == pytest.approx(0.6) and row["diff_last5"] == pytest.approx(2 / 3 - 0.6)  # all 3 rounds when R < 5
    assert parity.flat_row({"method": "m", "seed": 0, "privfl": mine})["diff_last5"] is None  # privfl only (fedavg, fedre)
    assert "+5.00" in parity.render([row])
    # a run that stopped (HtFLlib's FD ends in NaN and sklearn's AUC refuses it): what it printed, and why, in the note
    assert parity.printed_accuracies(log) == [0.1]
    failed = {"method": "fd", "seed": 0, "privfl": mine, "htfllib_error": "Traceback | ValueError: Input contains NaN.", "htfllib_partial_acc": [0.1]}
    assert parity.flat_row(failed)["note"] == "HtFLlib failed after 1 evaluations (10.00): ValueError: Input contains NaN."


#: -algo values of the main.py of each Source checkout (the FedRE authors' HtFLlib/system/main.py: FedRE only)
SOURCE_ALGOS = {"fedre": {"FedRE"}}


def test_every_mapped_method_names_an_htfllib_algorithm_and_options_privfl_has():
    from privfl.methods import METHODS

    parity = _load("run_parity")
    algos = {"Local", "FedProto", "FedGH", "LG-FedAvg", "FedTGP", "FedKD", "FedGen", "FD", "FML"}  # main.py's -algo choices used here
    cfg = {"lr": 0.01, "batch_size": 10, "rep_dim": 512}
    for name, spec in parity.PARITY.items():
        # a method whose reference code is its authors' checkout (Source) names that main.py's -algo
        assert spec.algo is None or spec.algo in (SOURCE_ALGOS.get(spec.source.option, set()) if spec.source else algos), name
        if name in METHODS:  # a method another change has not registered yet is only mapped
            fields = set(getattr(METHODS.get(name).Options, "__dataclass_fields__", {}))
            assert set(spec.privfl(cfg)) <= fields, name
    # HtFLlib's heterogeneous-model methods exchange heads or prototypes even between identical models
    assert parity.PARITY["fedgen"].privfl(cfg)["share"] == "head"


def test_run_parity_refuses_bad_input_before_writing(tmp_path: Path, capsys):
    parity = _load("run_parity")
    out = tmp_path / "out"
    cases = [
        ["--methods", "nosuchmethod", "--sides", "privfl", "--out", str(out)],
        ["--methods", "local", "--htfllib", str(tmp_path), "--out", str(out)],  # no system/main.py there
        ["--methods", "local", "--out", str(out)],  # HtFLlib's side needs --htfllib
        ["--methods", "local", "--sides", "privfl", "--set", "local.x", "--out", str(out)],
        ["--methods", "local", "--sides", "privfl", "--privfl-arg=--optimizer=adam", "--out", str(out)],
        ["--methods", "local", "--sides", "privfl", "--seeds", "a", "--out", str(out)],
        ["--render", str(tmp_path / "no-table.json"), "--out", str(out)],
    ]
    for argv in cases:
        capsys.readouterr()
        assert parity.run_cli("run_parity.py", lambda argv=argv: parity.main(argv)) == 2, argv
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        assert not out.exists(), argv


# ---- PFLlib as the reference (--reference pfllib): the map, the flags, the launcher, the table

#: PFLlib main.py's -algo values the map uses (system/main.py's if-chain)
PFLLIB_ALGOS = {"Local", "FedAvg", "FedProx", "PerAvg", "FedRep", "FedBN", "FedALA", "FedDBE"}
SETTING = {"model_group": "homo-cnn4", "rounds": 20, "lr": 0.01, "batch_size": 10, "local_epochs": 1, "num_clients": 10, "rep_dim": 512}


def _resolved(parity_mod, method: str) -> tuple[dict, dict]:
    """(options, config) privfl would resolve for ``method`` under the harness: the Options defaults with
    the map's privfl options, and the table's setting with the map's setting changes."""
    import dataclasses

    from privfl.methods import METHODS

    spec = parity_mod.PFLLIB[method]
    cls = METHODS.get(method).Options
    opts = {**(dataclasses.asdict(cls()) if dataclasses.is_dataclass(cls) else {}), **spec.privfl(SETTING)}
    return opts, {**SETTING, **spec.setting(SETTING)}


def test_pfllib_map_names_pfllib_algorithms_and_options_privfl_has():
    from privfl.methods import METHODS

    parity = _load("run_parity")
    issue15 = {"fedavg", "fedprox", "perfedavg", "fedrep", "fedbn", "fedala", "fedavgdbe"}
    assert issue15 <= set(parity.PFLLIB)
    for name, spec in parity.PFLLIB.items():
        assert spec.algo in PFLLIB_ALGOS and spec.protocol in ("global", "personal"), name
        if name not in METHODS:  # a method another change has not registered yet is only mapped
            continue
        fields = set(getattr(METHODS.get(name).Options, "__dataclass_fields__", {}))
        assert set(spec.privfl(SETTING)) <= fields, name
        opts, cfg = _resolved(parity, name)
        # privfl's defaults, with what the harness sets, are comparable (reads only option names privfl has)
        assert spec.mismatch(opts, cfg) == [], name
        flags = spec.flags(opts, cfg)
        assert len(flags) % 2 == 0 and all(f.startswith("-") for f in flags[::2]), name
    # the HtFLlib map and its behaviour are unchanged: HtFLlib is still the default reference
    assert parity.REFERENCES["htfllib"].methods is parity.PARITY and parity.PARITY["fedavg"].algo is None
    assert parity.PFLLIB["perfedavg"].protocol == "personal" and parity.PFLLIB["fedrep"].protocol == "global"


def _commands(ref, spec, opts: dict, cfg: dict, *, root: Path, data: str = "fashionmnist_privfl_s0", threads: int = 1):
    """``Reference.commands`` for a 1x28x28, 10-class export named ``data``, with interpreter ``py``."""
    return ref.commands(
        spec, opts, cfg, root=root, python="py", data=data, num_classes=10, channels=1, image_size=28, result=Path("/w/r.json"), threads=threads
    )


def test_pfllib_flags_follow_privfl_options_and_replace_shared_ones():
    parity = _load("run_parity")
    ref = parity.REFERENCES["pfllib"]

    def flags(method: str, opts: dict, cfg: dict | None = None) -> dict[str, str]:
        cfg = {**SETTING, **(cfg or {})}
        launcher, argv = _commands(ref, parity.PFLLIB[method], opts, cfg, root=Path("/p"), data="FashionMNIST_privfl_s0")
        assert launcher[:4] == ["py", str(PARITY / "pfllib_launch.py"), "--system", "/p/system"] and "--model" not in launcher
        keys = argv[::2]
        assert len(keys) == len(set(keys)), argv  # a method flag replaces the shared one, never repeats it
        return dict(zip(keys, argv[1::2]))

    base = flags("fedavg", {})
    assert base["-algo"] == "FedAvg" and base["-m"] == "CNN" and base["-data"] == "FashionMNIST_privfl_s0"
    assert (base["-gr"], base["-lr"], base["-lbs"], base["-ls"], base["-jr"], base["-nc"], base["-ncl"]) == ("20", "0.01", "10", "1", "1", "10", "10")
    assert "-fd" not in base and base["-dev"] == "cpu" and base["-t"] == "1" and base["-eg"] == "1"
    assert flags("fedprox", {"mu": 0.1, "stragglers": 0.0})["-mu"] == "0.1"
    # Per-FedAvg: PFLlib runs train() twice per round, so privfl ran 2 epochs and PFLlib gets -ls 1
    assert parity.PFLLIB["perfedavg"].setting(SETTING) == {"local_epochs": 2}
    per = flags("perfedavg", {"beta": 0.01}, {"local_epochs": 2})
    assert (per["-algo"], per["-ls"], per["-bt"]) == ("PerAvg", "1", "0.01")
    # FedRep: -pls = head epochs, -ls = body epochs (default: --local-epochs)
    assert (flags("fedrep", {"head_epochs": 2, "body_epochs": 3})["-pls"], flags("fedrep", {"head_epochs": 2, "body_epochs": 3})["-ls"]) == ("2", "3")
    assert flags("fedrep", {"head_epochs": 1, "body_epochs": None}, {"local_epochs": 4})["-ls"] == "4"
    ala = flags("fedala", {"eta": 0.5, "rand_percent": 40, "layer_idx": 4})
    assert (ala["-et"], ala["-s"], ala["-p"]) == ("0.5", "40", "4")
    dbe = flags("fedavgdbe", {"mean_momentum": 0.1, "kappa": 50.0})
    assert (dbe["-algo"], dbe["-mo"], dbe["-klw"]) == ("FedDBE", "0.1", "50.0")
    # PFLlib picks -m CNN's input shape from the dataset name: MNIST -> FedAvgCNN(1, dim=1024)
    assert "MNIST" in ref.dataset_name("fashionmnist", 0) and "Cifar10" in ref.dataset_name("cifar100", 1)
    assert ref.model_problem("homo-cnn4", "fashionmnist") is None and "no PFLlib counterpart" in ref.model_problem("htfe8", "fashionmnist")
    # PFLlib's loaders shuffle; HtFLlib's do not
    assert "--shuffle" in ref.fixed_privfl and "--no-shuffle" not in ref.fixed_privfl and "--drop-last" in ref.fixed_privfl
    assert "--no-shuffle" in parity.REFERENCES["htfllib"].fixed_privfl
    # what PFLlib cannot express is refused, with the option to set
    refused = {
        "fedrep": {"head_epochs": 1, "body_epochs": None, "weighting": "uniform"},
        "fedprox": {"mu": 0.01, "stragglers": 0.5},
        "perfedavg": {"beta": 0.001, "inner_lr": None, "variant": "fo", "adapt_steps": 1, "weighting": "samples"},
        "fedala": {"eta": 1.0, "rand_percent": 80, "layer_idx": 2, "threshold": 0.01, "num_pre_loss": 10},
        "fedbn": {"weighting": "uniform"},
        "fedavgdbe": {"kappa": 50.0, "mean_momentum": 1.0, "train_prbm": False},
    }
    for method, opts in refused.items():
        cfg = {**SETTING, **parity.PFLLIB[method].setting(SETTING)}
        assert len(parity.PFLLIB[method].mismatch(opts, cfg)) == 1, method


def _fake_h5py(folder: Path) -> Path:
    """A folder holding a stand-in ``h5py`` whose ``File`` reads the JSON the stand-in main.py files write."""
    folder.mkdir()
    (folder / "h5py.py").write_text(
        "import json\nimport numpy as np\n"
        "class File:\n"
        "    def __init__(self, path, mode):\n"
        "        self.data = {k: np.asarray(v) for k, v in json.load(open(path)).items()}\n"
        "    def __enter__(self):\n        return self.data\n"
        "    def __exit__(self, *exc):\n        return False\n"
    )
    return folder


def test_pfllib_launcher_runs_main_py_reports_client_0s_model_and_the_results(tmp_path: Path):
    """pfllib_launch.py on a stand-in for PFLlib's system/ (same file names, the calls the launcher relies
    on) and a stand-in h5py: one thread, FedPAC's server stubbed when cvxpy is missing, PARITY-MODEL from
    the first client built, PARITY-RESULT from ../results/<data>_<algo>_<goal>_0.h5."""
    import importlib.util as iu
    import subprocess

    system = tmp_path / "pfllib" / "system"
    (system / "flcore" / "servers").mkdir(parents=True)
    (system / "flcore" / "clients").mkdir(parents=True)
    (system / "flcore" / "servers" / "serverpac.py").write_text("import cvxpy\nclass FedPAC: pass\n")
    (system / "flcore" / "clients" / "clientbase.py").write_text(
        "import torch\n"
        "class Client:\n"
        "    def __init__(self, args, id, train_samples, test_samples, **kwargs):\n"
        "        torch.manual_seed(0)\n"
        "        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))\n"
    )
    (system / "main.py").write_text(
        "import argparse, json, os, torch\n"
        "from flcore.servers.serverpac import FedPAC\n"
        "from flcore.clients.clientbase import Client\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('-data', '--dataset'); p.add_argument('-algo', '--algorithm'); p.add_argument('-go', '--goal')\n"
        "p.add_argument('-t', '--times', type=int, default=1); p.add_argument('-pv', '--prev', type=int, default=0)\n"
        "args = p.parse_args()\n"
        "clients = [Client(args, id=i, train_samples=5, test_samples=2, train_slow=False, send_slow=False) for i in range(3)]\n"
        "print('threads', torch.get_num_threads())\n"
        "for t in (9.0, 2.0, 4.0):\n"
        "    print('-' * 25, 'time cost', '-' * 25, t)\n"
        "os.makedirs('../results', exist_ok=True)\n"
        "json.dump({'rs_test_acc': [0.1, 0.5, 0.75]}, open(f'../results/{args.dataset}_{args.algorithm}_{args.goal}_0.h5', 'w'))\n"
    )
    fake = _fake_h5py(tmp_path / "fake")
    cwd = tmp_path / "work" / "cwd"
    cwd.mkdir(parents=True)
    log = tmp_path / "work" / "fedavg.log"
    cmd = [sys.executable, str(PARITY / "pfllib_launch.py"), "--system", str(system), "--threads", "1", "--result", str(tmp_path / "r.json")]
    cmd += ["--", "-data", "FashionMNIST_privfl_s0", "-algo", "FedAvg", "-go", "parity"]
    # main.py imports flcore from system/, which must come first on PYTHONPATH (run_parity.py puts it there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(system), pythonpath(fake)]), "OMP_NUM_THREADS": "4"}
    without = {**env, "PYTHONPATH": pythonpath(fake)}
    done = subprocess.run(cmd, cwd=cwd, env=without, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "first on PYTHONPATH" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    with open(log, "w") as fh:
        assert subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False).returncode == 0, log.read_text()
    text = log.read_text()
    assert "threads 1" in text
    assert ("PARITY-STUBBED" in text) == (iu.find_spec("cvxpy") is None)
    assert text.count("PARITY-MODEL ") == 1  # the first client only
    parity = _load("run_parity")
    side = parity.htfllib_side(log, rounds=2)
    assert side["acc_untrained"] == 0.1 and side["acc"] == [0.5, 0.75] and side["s_per_round"] == 3.0 and side["threads"] == 1
    assert side["model"]["params"] == [["0.weight", [3, 4]], ["0.bias", [3]], ["2.weight", [2, 3]], ["2.bias", [2]]]
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["rs_test_acc"] == [0.1, 0.5, 0.75]
    assert not any((system / "..").resolve().glob("results"))  # nothing written next to PFLlib's system/
    # no "--": one line, exit 2
    done = subprocess.run([sys.executable, str(PARITY / "pfllib_launch.py"), "--system", str(system)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_table_compares_the_protocol_the_map_names_and_names_the_reference(tmp_path: Path):
    parity = _load("run_parity")
    mine = {
        "acc": [0.2, 0.3],
        "final_acc": 0.3,
        "best_acc": 0.3,
        "acc_personal": [0.5, 0.7],
        "final_acc_personal": 0.7,
        "best_acc_personal": 0.7,
        "s_per_round": 1.0,
    }
    ref = {"acc": [0.6, 0.65], "final_acc": 0.65, "best_acc": 0.65, "s_per_round": 2.0}
    row = parity.flat_row({"method": "perfedavg", "seed": 0, "reference": "PFLlib", "protocol": "personal", "privfl": mine, "htfllib": ref})
    assert row["privfl_final"] == 0.7 and row["privfl_last5"] == pytest.approx(0.6) and row["diff_final"] == pytest.approx(0.05)
    glob_row = parity.flat_row({"method": "fedavg", "seed": 0, "reference": "PFLlib", "privfl": mine, "htfllib": ref})
    assert glob_row["privfl_final"] == 0.3 and glob_row["protocol"] == "global"
    text = parity.render([row, glob_row])
    assert "PFLlib acc final" in text and "HtFLlib" not in text
    # tables of two references do not merge
    for name, key in (("a", "htfllib"), ("b", "pfllib")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "table.json").write_text(json.dumps({"protocol": {"setting": {"x": 1}, "reference": key}, "rows": []}))
    with pytest.raises(parity.ConfigError, match="reference library differs"):
        parity.rerender([tmp_path / "a" / "table.json", tmp_path / "b" / "table.json"], tmp_path / "merged")


def test_run_parity_refuses_bad_pfllib_input_before_writing(tmp_path: Path, capsys):
    parity = _load("run_parity")
    out = tmp_path / "out"
    cases = [
        ["--reference", "pfllib", "--methods", "fedavg", "--out", str(out)],  # PFLlib's side needs --pfllib
        ["--reference", "pfllib", "--methods", "fedavg", "--pfllib", str(tmp_path), "--out", str(out)],  # no system/main.py there
        ["--reference", "pfllib", "--methods", "fedavg", "--sides", "privfl,htfllib", "--out", str(out)],  # the other reference's side
        ["--reference", "pfllib", "--methods", "fedavg", "--pfllib", str(tmp_path), "--model-group", "htfe8", "--out", str(out)],
        ["--reference", "pfllib", "--methods", "fedavg", "--pfllib", str(tmp_path), "--dataset", "svhn", "--out", str(out)],
        ["--reference", "nosuchlib", "--methods", "fedavg", "--out", str(out)],
        ["--reference", "pfllib", "--methods", "fedavg", "--sides", "privfl", "--privfl-arg=--no-shuffle", "--out", str(out)],
        ["--reference", "pfllib", "--methods", "fedavg", "--sides", "privfl", "--privfl-arg=--local-epochs=2", "--out", str(out)],
    ]
    for argv in cases:
        capsys.readouterr()
        assert parity.run_cli("run_parity.py", lambda argv=argv: parity.main(argv)) == 2, argv
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, argv
        assert not out.exists(), argv


# ---- FedRE against its authors' code (--fedre PATH: AIResearch-Group/FedRE, an HtFLlib-based partial copy)


def test_fedre_row_runs_the_authors_main_py_with_its_flag_names():
    import dataclasses

    from privfl.methods import METHODS

    parity = _load("run_parity")
    spec = parity.PARITY["fedre"]
    assert spec.algo == "FedRE" and spec.source is not None and spec.source.option == "fedre"
    opts = dataclasses.asdict(METHODS.get("fedre").Options())
    cfg = {**SETTING, "mapping": "ap"}
    assert spec.mismatch(opts, cfg) == []  # privfl's defaults are the authors' FedRE
    for key, value in (("re", "rar"), ("weight_dist", "gaussian"), ("sampling", "fixed"), ("server_epochs", 2), ("server_reduction", "mean")):
        assert len(spec.mismatch({**opts, key: value}, cfg)) == 1, key
    assert len(spec.mismatch(opts, {**cfg, "mapping": "fc"})) == 1
    htfllib = parity.REFERENCES["htfllib"]
    launcher, argv = _commands(htfllib, spec, {**opts, "server_lr": 0.05, "server_batch": 7}, cfg, root=Path("/f/HtFLlib"), threads=2)
    assert launcher[:4] == ["py", str(PARITY / "htfllib_launch.py"), "--system", "/f/HtFLlib/system"]
    assert "--complete-fedre" in launcher and launcher[launcher.index("--threads") + 1] == "2"
    assert launcher[launcher.index("--model") + 1] == "FedAvgCNN(in_features=1, num_classes=args.num_classes, dim=1024)"
    flags = dict(zip(argv[::2], argv[1::2]))
    assert len(flags) == len(argv) // 2
    # the authors' main.py knows -m HtM10 only (the pinned model replaces its list) and spells -ncl as -nb
    assert flags["-algo"] == "FedRE" and flags["-m"] == "HtM10" and flags["-nb"] == "10" and "-ncl" not in flags
    assert (flags["-slr"], flags["-hbs"], flags["-fd"], flags["-lbs"], flags["-gr"]) == ("0.05", "7", "512", "10", "20")
    # the other HtFLlib rows keep HtFLlib's own names
    _, local = _commands(htfllib, parity.PARITY["local"], {}, cfg, root=Path("/h"))
    assert "-ncl" in local and "--complete-fedre" not in local and local[local.index("-m") + 1] == "HtFE-img-2"


def _fedre_system(root: Path) -> Path:
    """A stand-in for the authors' HtFLlib/system: the calls the launcher relies on, with the release's
    gaps (no evaluate, no send_parameters, no save_results; main.py pins one torch thread)."""
    system = root / "HtFLlib" / "system"
    (system / "flcore" / "servers").mkdir(parents=True)
    (system / "flcore" / "trainmodel").mkdir(parents=True)
    (system / "flcore" / "trainmodel" / "models.py").write_text(
        "import torch\n"
        "class BaseHeadSplit(torch.nn.Module):\n"
        "    def __init__(self, args, cid):\n"
        "        super().__init__()\n"
        "        self.base, self.head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)\n"
    )
    (system / "flcore" / "servers" / "serverbase.py").write_text(
        "import json, os\n"
        "class Server:\n"
        "    def __init__(self, args):\n"
        "        self.args, self.eval_gap, self.rs_test_acc, self.log = args, args.eval_gap, [], []\n"
        "    def send_parameters(self):\n"
        "        self.log.append('send')\n"
        "    def evaluate(self):\n"
        "        self.log.append('eval')\n"
        "        self.rs_test_acc.append(0.1 * (len(self.rs_test_acc) + 1))\n"
        "    def save_results(self):\n"
        "        os.makedirs('../results', exist_ok=True)\n"
        "        a = self.args\n"
        "        json.dump({'rs_test_acc': self.rs_test_acc}, open(f'../results/{a.dataset}_{a.algorithm}_{a.goal}_0.h5', 'w'))\n"
    )
    (system / "flcore" / "servers" / "serverre.py").write_text(
        "from flcore.servers.serverbase import Server\n"
        "class FedRE(Server):\n"
        "    def select_clients(self):\n"
        "        return [0, 1]\n"
        "    def train(self):\n"
        "        for i in range(self.args.global_rounds + 1):\n"
        "            self.selected_clients = self.select_clients()\n"
        "            self.log.append('train')\n"
        "            print('-' * 25, 'time cost', '-' * 25, 1.0 + i)\n"
        "        print('log', ','.join(self.log))\n"
        "        print(max(self.rs_test_acc))\n"
    )
    (system / "main.py").write_text(
        "import argparse, torch\n"
        "from flcore.servers.serverre import FedRE\n"
        "torch.set_num_threads(1)  # the authors' set_random_seed does this\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('-data', '--dataset'); p.add_argument('-algo', '--algorithm'); p.add_argument('-go', '--goal')\n"
        "p.add_argument('-gr', '--global_rounds', type=int); p.add_argument('-eg', '--eval_gap', type=int, default=1)\n"
        "p.add_argument('-t', '--times', type=int, default=1); p.add_argument('-pv', '--prev', type=int, default=0)\n"
        "args = p.parse_args()\n"
        "FedRE(args).train()\n"
        "print('threads', torch.get_num_threads())\n"
    )
    return system


def test_launcher_completes_the_authors_fedre_and_keeps_the_thread_count(tmp_path: Path):
    """htfllib_launch.py --complete-fedre on a stand-in of the authors' system/: every round sends the head
    then evaluates (before the clients train, as HtFLlib's FedGH), the run saves its results, and main.py's
    own torch.set_num_threads(1) does not override --threads. Without the flag the release fails as it does."""
    import subprocess

    system = _fedre_system(tmp_path / "fedre")
    fake = _fake_h5py(tmp_path / "fake")
    cwd = tmp_path / "work" / "cwd"
    cwd.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(system), pythonpath(fake)])}

    def launch(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(PARITY / "htfllib_launch.py"), "--system", str(system), "--threads", "2", "--model", "Net()", *extra]
        cmd += ["--", "-data", "d", "-algo", "FedRE", "-go", "parity", "-gr", "2"]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)

    done = launch("--complete-fedre")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "log send,eval,train,send,eval,train,send,eval,train" in done.stdout  # R+1 rounds, evaluated at each start
    assert "PARITY-PATCHED" in done.stdout and "PARITY-THREADS main.py set 1 torch thread(s); kept --threads 2" in done.stdout
    assert "threads 2" in done.stdout
    log = tmp_path / "work" / "fedre.log"
    log.write_text(done.stdout)
    side = _load("run_parity").htfllib_side(log, rounds=2)
    assert side["acc_untrained"] == pytest.approx(0.1) and side["acc"] == pytest.approx([0.2, 0.3]) and side["threads"] == 2
    assert side["s_per_round"] == 2.5 and side["seconds"] == [1.0, 2.0, 3.0]
    bare = launch()
    # the release as published (Python 3.12 words the error "max() iterable argument is empty")
    assert bare.returncode != 0 and ("max() arg is an empty sequence" in bare.stderr or "max() iterable argument is empty" in bare.stderr)


def test_run_parity_refuses_bad_fedre_input_before_writing(tmp_path: Path, capsys):
    parity = _load("run_parity")
    out = tmp_path / "out"
    cases = [
        ["--methods", "fedre", "--fedre", str(tmp_path), "--out", str(out)],  # no HtFLlib/system/main.py there
        ["--reference", "pfllib", "--methods", "fedavg", "--fedre", str(tmp_path), "--sides", "privfl", "--out", str(out)],
    ]
    for argv in cases:
        capsys.readouterr()
        assert parity.run_cli("run_parity.py", lambda argv=argv: parity.main(argv)) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--fedre" in err[0], (argv, err)
        assert not out.exists(), argv


def test_seconds_per_round_leave_each_sides_first_round_out(tmp_path: Path):
    """privfl's first round carries one-off costs the references pay before theirs: ``s/round`` averages both
    sides over the rounds after the first, ``incl. 1st`` over all; older tables are recomputed from their
    per-round seconds; a table with only a mean keeps it."""
    parity = _load("run_parity")
    mine = {"acc": [0.5, 0.6, 0.7], "final_acc": 0.7, "best_acc": 0.7, "seconds": [4.0, 1.0, 2.0], "s_per_round": 7 / 3}
    ref = {"acc": [0.5, 0.6, 0.7], "final_acc": 0.7, "best_acc": 0.7, "seconds": [3.0, 3.0, 5.0, 4.0], "s_per_round": 4.0}
    row = parity.flat_row({"method": "m", "seed": 0, "privfl": mine, "htfllib": ref})
    assert row["privfl_s_round"] == 1.5 and row["privfl_s_round_all"] == pytest.approx(7 / 3)
    assert row["htfllib_s_round"] == 4.0 and row["htfllib_s_round_all"] == 3.75
    old = parity.flat_row({"method": "m", "seed": 0, "privfl": {**mine, "seconds": None, "s_per_round": 2.0}})
    assert old["privfl_s_round"] == 2.0 and old["privfl_s_round_all"] is None
    assert "incl. 1st" in parity.render([row]) and "1.50" in parity.render([row])
    nan_warm, only = parity.round_seconds([5.0])
    assert nan_warm != nan_warm and only == 5.0  # one round: no round after the first
