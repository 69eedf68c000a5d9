"""Side-by-side parity table: privfl and a reference library trained on the same partition with the same settings.

The reference (``--reference``) is HtFLlib (default; the heterogeneous-model methods, map ``PARITY``) or
PFLlib (FedAvg and the personalised baselines, map ``PFLLIB``: Local, FedAvg, FedProx, Per-FedAvg =
``PerAvg``, FedRep, FedBN, FedALA, FedAvgDBE = ``FedDBE``). Both libraries share one code base, dataset
layout, results file and round loop; the steps below say HtFLlib, and the differences for PFLlib follow.

For every method of ``--methods`` and every seed of ``--seeds``, one after the other (never two at once),
each with one torch thread (``OMP_NUM_THREADS=MKL_NUM_THREADS=1`` and ``torch.set_num_threads(1)``; ``--threads N``
gives both sides N, with which privfl trains N clients at once, ``--client-workers auto``, and the reference
splits each torch operation N ways):

1. **privfl**: ``python -m privfl.train METHOD`` with the table's setting (default: Fashion-MNIST, a seeded
   3,000-sample subset, 10 clients, Dir(0.1), ``homo-cnn4``, SGD lr 0.01, batch 10, 1 local epoch, 20
   rounds, join ratio 1) in HtFLlib's data order and initialisation (``--same-init --no-shuffle
   --drop-last``), ``--eval both``, ``--device cpu``; plus the method options that make privfl behave as
   HtFLlib where privfl offers a choice (``PARITY`` below: FedProto's uniform prototype average, FD's raw
   logit targets, ...). ``--set METHOD.KEY=VALUE`` changes a method option (it then reaches HtFLlib too).
2. **export**: that run's partition, written in HtFLlib's dataset layout by ``export_htfllib.py`` (same
   samples, same order, privfl's normalised float32 inputs), once per partition.
3. **HtFLlib**: its unchanged ``system/main.py`` through ``htfllib_launch.py`` in a scratch working
   directory under ``--out`` (nothing is written into ``--htfllib``), ``-algo`` from ``PARITY`` and every
   hyperparameter from the privfl run's resolved config: ``-lr -lbs -ls -gr -nc -jr 1 -fd`` and the
   method's own (FedProto ``-lam``, FedGH ``-slr -se``, FedTGP ``-lam -se -mart``, FedKD ``-mlr -Ts -Te``,
   FedGen ``-nd -hd -glr -se``, FD ``-lam``, FML ``-al -bt``). The homogeneous CNN is HtFLlib's
   ``FedAvgCNN(in_features=C, dim=64*s*s)``, pinned by the launcher (no ``-m`` family holds it alone).
4. **parse**: privfl's ``metrics.jsonl`` and HtFLlib's results file (``rs_test_acc``) and printed
   ``time cost`` per round.

**Round alignment.** HtFLlib evaluates at the *start* of each round: with ``-gr R`` it evaluates R+1 times,
``rs_test_acc[0]`` being the untrained models and ``rs_test_acc[r]`` the models after r rounds of
training (it then trains an (R+1)-th round that is never evaluated). privfl evaluates at the *end* of
each round: its round r (0-based, ``metrics.jsonl``) is the models after r+1 rounds. So privfl's
end-of-round-r evaluation corresponds to HtFLlib's evaluation at the start of round r+1; "final" is
privfl's round R-1 against HtFLlib's ``rs_test_acc[R]``, and "best" is the maximum over those R aligned
evaluations (HtFLlib's own "best accuracy" also counts the untrained round 0, which never wins here).

**Accuracy.** Both sides: correct / total test samples over all clients (sample-weighted). privfl's
global protocol scores each client with the latest global part it received, as HtFLlib does;
privfl's personal protocol (own parts after local training) has no HtFLlib counterpart. Besides final
and best, the table gives the mean of the last 5 aligned evaluations: under Dir(0.1) a server-trained
head (FedGH) moves the accuracy by several points from one round to the next on both sides, so one
round's difference says little. ``--seeds 0,1,2`` adds a mean row per method (and its std in the JSON):
each seed is its own partition and initialisation, so the spread of the per-seed differences is the
noise a difference has to beat.

**Time per round.** privfl: ``metrics.jsonl`` ``seconds`` (local training, server, every evaluation of
``--eval both``, checkpoint and capture writes). HtFLlib: its printed per-round ``time cost`` (evaluation
at the start, local training, server, and its per-round torch.save/torch.load of every model in
``temp/``). The ``s/round`` columns are each side's mean over its rounds after the first, as HtFLlib's own
``Average time cost per round`` leaves its first round out: privfl's first round pays one-off costs, above
all the ~2.8 s import of ``torch._dynamo`` that torch 2.15 performs when a process builds its first
``torch.optim`` optimizer (measured here), which HtFLlib and PFLlib pay before their first round (their
first round is as long as the others), so averaging privfl's with it would charge that cost to privfl
alone. The ``incl. 1st`` columns are the means over every round. Both in one process with the same threads, on the same machine;
other load on it shows in both.

**PFLlib** (``--reference pfllib --pfllib PATH``, ``pfllib_launch.py``): the same steps, with these
differences. (a) PFLlib's train loader shuffles (torch's global RNG) and drops the last partial batch,
so privfl runs ``--shuffle`` (its own seeded order) instead of ``--no-shuffle``: the same batches per
epoch in another order. (b) PFLlib builds ``-m CNN`` from the dataset *name* (``MNIST`` in it:
``FedAvgCNN(1, dim=1024)``; ``Cifar10``: ``FedAvgCNN(3, dim=1600)``), so the export is named
``FashionMNIST_privfl_s<S>`` (``PFLLIB_DATASETS``) and nothing is pinned; the launcher prints the model
PFLlib built and the table checks its shapes against privfl's (``model_check``), as for HtFLlib.
(c) Per method (``PFLLIB``): FedProx ``-mu``; Per-FedAvg ``-bt`` (ignored by PFLlib, whose beta is
``-lr``: privfl's ``beta`` is set to lr), and PFLlib's server calls ``train()`` twice per round, so privfl
runs twice ``--local-epochs`` while PFLlib keeps ``-ls``; Per-FedAvg is compared under privfl's
*personal* protocol (PFLlib's ``evaluate_one_step`` scores the global model after one alpha-step on a
train batch), every other method under the global one (PFLlib evaluates right after its broadcast:
FedRep's global body + own head, FedALA's merged model, DBE's model + own PRBM); FedRep ``-pls`` = head
epochs, ``-ls`` = body epochs; FedALA ``-et -s -p`` (its threshold 0.1 and 10 losses are fixed in PFLlib);
FedAvgDBE ``-mo`` = ``mean_momentum``, ``-klw`` = ``kappa``; FedBN has no flag (``-m CNN`` has no
BatchNorm, so it is FedAvg on both sides). A privfl option PFLlib cannot express refuses the row. The
PFLlib side runs in ``--out``/``pfllib/seed<S>/``; it needs ``h5py`` and ``calmsize``
(``--pfllib-pythonpath``); FedPAC's server (``cvxpy``) is stubbed by the launcher.

Methods the reference does not have (HtFLlib: ``fedavg``; ``fedre`` unless ``--fedre PATH`` gives its authors'
code, a ``Source`` in the map) are trained on privfl's side only. Outputs under
``--out`` (a new or empty folder): ``table.json``, ``table.csv``, ``table.txt``, ``privfl/`` (the runs),
``htfllib/seed<S>/`` or ``pfllib/seed<S>/`` (``dataset/``, ``results/``, one log and result JSON per
method). The reference side's columns and JSON keys are ``htfllib_*`` for either library (``reference``
names it), so older tables still render; ``--render`` merges tables of one setting and one reference::

    python -m experiments.parity.run_parity --htfllib PATH/TO/HtFLlib --methods local,fedavg,fedproto,fedgh,fedre
    python -m experiments.parity.run_parity --htfllib PATH --methods fedproto --set fedproto.lamda=10 --rounds 5
    python -m experiments.parity.run_parity --render runs/parity/table.json,runs/parity-s12/table.json --out runs/parity-all
    python -m experiments.parity.run_parity --reference pfllib --pfllib PATH/TO/PFLlib --pfllib-pythonpath DEPS \\
        --methods fedavg,fedprox,perfedavg,fedrep,fedbn,fedala,fedavgdbe --out runs/parity-pfllib

``PATH/TO/HtFLlib`` (``PATH/TO/PFLlib``) is a clone (the folder holding ``system/``). Either needs torch,
torchvision, numpy, scikit-learn, h5py and calmsize; ``--htfllib-python`` / ``--pfllib-python`` (default:
this interpreter) and ``--htfllib-pythonpath DIR`` / ``--pfllib-pythonpath DIR`` (prepended to its
``PYTHONPATH``, e.g. a ``pip install --target DIR --no-deps h5py calmsize``) choose where they come from;
a missing one is a one-line error before anything runs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privfl.cli import ArgumentParser, run_cli
from privfl.errors import ConfigError

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "htfllib_launch.py"


def thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a side ``threads`` torch threads (``--threads``; default 1)."""
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


Options = Mapping[str, Any]


@dataclass(frozen=True)
class Source:
    """A method's reference code that lives outside the reference library, in a checkout of its own given
    with ``--OPTION PATH`` (FedRE: the authors' repository, whose ``HtFLlib/system`` is a self-contained
    partial HtFLlib). ``subdir``: the folder under PATH that holds ``system/``; ``family``: its ``main.py``'s
    ``-m`` (the pinned model replaces the family's list); ``rename``: shared flags its ``main.py`` spells
    otherwise; ``launcher``: flags for ``htfllib_launch.py`` (e.g. ``--complete-fedre``)."""

    option: str
    subdir: str
    family: str
    rename: Mapping[str, str] = field(default_factory=dict)
    launcher: tuple[str, ...] = ()
    repository: str = ""


@dataclass(frozen=True)
class Parity:
    """How one privfl method is run on the reference library's side (HtFLlib or PFLlib).

    ``algo``: the reference's ``-algo`` (None: it has no such method). ``privfl``: method options that make
    privfl do what the reference does where privfl offers a choice (a function of the run's settings; an
    option the method does not have is skipped and reported). ``flags``: the reference's flags from the
    privfl run's resolved options and config (a flag the shared ones also set, such as ``-ls``, replaces
    the shared value). ``mismatch``: what the reference cannot express for those options (the row is then
    refused). ``setting``: shared settings privfl runs with instead of the table's (a function of the
    table's setting, e.g. PFLlib's Per-FedAvg trains two epochs per ``-ls``). ``protocol``: which privfl
    evaluation the reference's accuracy is compared with: ``global`` (the latest global part received,
    what both libraries score right after their broadcast) or ``personal`` (privfl's personalised
    model, e.g. Per-FedAvg's one adaptation step, which PFLlib's ``evaluate_one_step`` takes)."""

    algo: str | None
    privfl: Callable[[Options], dict[str, Any]] = lambda cfg: {}
    flags: Callable[[Options, Options], list[str]] = lambda opts, cfg: []
    mismatch: Callable[[Options, Options], list[str]] = lambda opts, cfg: []
    note: str = ""
    setting: Callable[[Options], dict[str, Any]] = lambda setting: {}
    protocol: str = "global"
    source: Source | None = None


def _f(x: Any) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _need(cond: bool, text: str) -> list[str]:
    return [] if cond else [text]


PARITY: dict[str, Parity] = {
    "local": Parity("Local"),
    "fedavg": Parity(None, note="HtFLlib has no FedAvg (its sibling PFLlib has)"),
    "fedre": Parity(
        "FedRE",
        flags=lambda o, cfg: ["-slr", _f(o["server_lr"]), "-hbs", str(o["server_batch"])],
        mismatch=lambda o, cfg: (
            _need(o["re"] == "rap", "the authors' FedRE entangles class prototypes with random weights: fedre.re=rap")
            + _need(o["weight_dist"] == "uniform", "the authors' FedRE draws torch.rand weights: fedre.weight_dist=uniform")
            + _need(o["sampling"] == "resample", "the authors' FedRE draws new weights every round: fedre.sampling=resample")
            + _need(o["server_epochs"] == 1, "the authors' FedRE server trains one epoch per round: fedre.server_epochs=1")
            + _need(o["server_reduction"] == "sum", "the authors' FedRE server sums its loss over a batch: fedre.server_reduction=sum")
            + _need(cfg.get("mapping", "ap") == "ap", "the authors' FedRE maps representations with AdaptiveAvgPool1d: --mapping ap")
        ),
        note="the authors' code (--fedre), completed by the launcher: head broadcast, evaluation and results each round as in "
        "HtFLlib's FedGH; its prototypes skip each client's last partial batch (drop_last), privfl's use every train sample",
        source=Source("fedre", "HtFLlib", "HtM10", rename={"-ncl": "-nb"}, launcher=("--complete-fedre",), repository="AIResearch-Group/FedRE"),
    ),
    "fedproto": Parity(
        "FedProto",
        # HtFLlib averages the clients' prototypes unweighted, each the mean of its training steps' representations
        privfl=lambda cfg: {"weighting": "uniform", "prototypes": "training"},
        flags=lambda o, cfg: ["-lam", _f(o["lamda"])],
        note="both average the training steps' representations (privfl prototypes=training); privfl's default, "
        "the paper's Eq. 4 pass after training (--set fedproto.prototypes=pass), adds a forward over the train split",
    ),
    "fedgh": Parity(
        "FedGH",
        flags=lambda o, cfg: ["-slr", _f(o["server_lr"]), "-se", _f(o["server_epochs"])],
        mismatch=lambda o, cfg: _need(o["server_batch"] == cfg["batch_size"], "HtFLlib's FedGH server batch is -lbs: set fedgh.server_batch"),
        note="HtFLlib's prototypes skip each client's last partial batch (drop_last); privfl's use every train sample",
    ),
    "lgfedavg": Parity("LG-FedAvg", privfl=lambda cfg: {"weighting": "samples"}),
    "fedtgp": Parity(
        "FedTGP",
        privfl=lambda cfg: {"server_lr": cfg["lr"], "server_batch_size": cfg["batch_size"]},  # HtFLlib: the server uses -lr and -lbs
        flags=lambda o, cfg: ["-lam", _f(o["lamda"]), "-se", _f(o["server_epochs"]), "-mart", _f(o["margin_threshold"])],
        mismatch=lambda o, cfg: (
            _need(o["server_lr"] == cfg["lr"], "HtFLlib's FedTGP server lr is -lr: set fedtgp.server_lr = lr")
            + _need(o["server_batch_size"] == cfg["batch_size"], "HtFLlib's FedTGP server batch is -lbs")
            + _need(o.get("hidden_dim") in (None, cfg["rep_dim"]), "HtFLlib's FedTGP generator is d wide: leave fedtgp.hidden_dim unset")
        ),
    ),
    "fedkd": Parity(
        "FedKD",
        privfl=lambda cfg: {"mentee_arch": "client0", "weighting": "uniform", "conv_svd": "htfllib", "kl_reduction": "mean", "grad_clip": 10.0},
        flags=lambda o, cfg: ["-mlr", _f(o["mentee_lr"]), "-Ts", _f(o["t_start"]), "-Te", _f(o["t_end"])],
    ),
    "fedgen": Parity(
        "FedGen",
        # HtFLlib's FedGen uploads and averages heads only, also when every client has the same model
        # (privfl's share=auto would share the whole model there, as FedGen's paper and PFLlib do)
        privfl=lambda cfg: {"diversity_weight": 0.0, "ensemble_weighting": "samples", "client_labels": "global", "gen_weight": 1.0, "share": "head"},
        flags=lambda o, cfg: ["-nd", _f(o["noise_dim"]), "-hd", _f(o["hidden_dim"]), "-glr", _f(o["generator_lr"]), "-se", _f(o["server_epochs"])],
        mismatch=lambda o, cfg: _need(o.get("gen_batch_size") in (None, cfg["batch_size"]), "HtFLlib's FedGen draws -lbs labels per step"),
    ),
    "fd": Parity(
        "FD",
        privfl=lambda cfg: {"distill_loss": "raw_ce", "collect": "during", "global_logits": "all"},  # HtFLlib HEAD
        flags=lambda o, cfg: ["-lam", _f(o["lamda"])],
    ),
    "fml": Parity(
        "FML",
        privfl=lambda cfg: {"shared_arch": "client0", "inference": "local", "grad_clip": 10.0},
        flags=lambda o, cfg: ["-al", _f(o["local_alpha"]), "-bt", _f(o["meme_beta"])],
    ),
}

#: privfl model group -> (HtFLlib -m family, pinned constructor or None, the data it is meant for)
MODEL_GROUPS: dict[str, tuple[str, str | None]] = {
    "homo-cnn4": ("HtFE-img-2", "FedAvgCNN(in_features={channels}, num_classes=args.num_classes, dim={flat})"),
    "htfe8": ("HtFE-img-8", None),  # same order as privfl's group; HtFLlib's CNN expects 3x32x32 there
    "htm10": ("HtM-img-10", None),
}

#: settings the harness fixes on privfl's side (HtFLlib's loaders and initialisation)
FIXED_PRIVFL = ["--same-init", "--no-shuffle", "--drop-last", "--eval", "both", "--no-progress", "--device", "cpu", "--optimizer", "sgd"]
TIME_LINE = re.compile(r"^-{20,}(?: time cost -{20,})? ([0-9.eE+-]+)\s*$")

#: PFLlib's counterparts of privfl's FedAvg and the personalised baselines (issue 15), with Local as a
#: check of the plumbing. PFLlib evaluates every client right after its broadcast, as HtFLlib does.
PFLLIB: dict[str, Parity] = {
    "local": Parity("Local"),
    "fedavg": Parity("FedAvg"),
    "fedprox": Parity(
        "FedProx",
        flags=lambda o, cfg: ["-mu", _f(o["mu"])],
        mismatch=lambda o, cfg: _need(
            o.get("stragglers", 0) == 0,
            "PFLlib's FedProx has no stragglers (-tsr slows clients, it does not cut their epochs): set fedprox.stragglers=0",
        ),
        note="PFLlib's FedProx model is the unsplit FedAvgCNN (same tensors)",
    ),
    "perfedavg": Parity(
        "PerAvg",
        privfl=lambda cfg: {"beta": cfg["lr"], "variant": "fo", "weighting": "samples"},  # PFLlib: beta = -lr, first order
        # PFLlib's server calls client.train() twice per round: privfl runs twice the epochs, PFLlib's -ls stays
        setting=lambda st: {"local_epochs": 2 * st["local_epochs"]},
        flags=lambda o, cfg: ["-bt", _f(o["beta"]), "-ls", str(cfg["local_epochs"] // 2)],
        mismatch=lambda o, cfg: (
            _need(o["beta"] == cfg["lr"], "PFLlib's Per-FedAvg ignores -bt and takes beta = -lr: set perfedavg.beta = lr")
            + _need(o.get("inner_lr") in (None, cfg["lr"]), "PFLlib's Per-FedAvg alpha is -lr: leave perfedavg.inner_lr unset")
            + _need(o["variant"] == "fo", "PFLlib's Per-FedAvg is first order: perfedavg.variant=fo")
            + _need(o["adapt_steps"] == 1, "PFLlib evaluates after one adaptation step: perfedavg.adapt_steps=1")
            + _need(o["weighting"] == "samples", "PFLlib averages weighted by train-set size: perfedavg.weighting=samples")
            + _need(cfg["local_epochs"] % 2 == 0, "PFLlib trains two epochs per -ls: privfl's local epochs must be even")
        ),
        protocol="personal",
        note=(
            "PFLlib trains 2 x -ls epochs per round (privfl runs 2 x --local-epochs); compared: privfl's personal protocol "
            "(one alpha-step on own train data), as PFLlib's evaluate_one_step"
        ),
    ),
    "fedrep": Parity(
        "FedRep",
        # -pls: the head epochs (first, body frozen); -ls: the body epochs (second, head frozen)
        flags=lambda o, cfg: [
            "-pls",
            str(o["head_epochs"]),
            "-ls",
            str(o["body_epochs"] if o.get("body_epochs") is not None else cfg["local_epochs"]),
        ],
        mismatch=lambda o, cfg: _need(o["weighting"] == "samples", "PFLlib averages the bodies weighted by train-set size: fedrep.weighting=samples"),
    ),
    "fedbn": Parity(
        "FedBN",
        mismatch=lambda o, cfg: _need(o["weighting"] == "samples", "PFLlib averages weighted by train-set size: fedbn.weighting=samples"),
        note="PFLlib keeps tensors whose name holds 'bn' local, privfl BatchNorm modules; -m CNN has none, so both are FedAvg here",
    ),
    "fedala": Parity(
        "FedALA",
        flags=lambda o, cfg: ["-et", _f(o["eta"]), "-s", str(o["rand_percent"]), "-p", str(o["layer_idx"])],
        mismatch=lambda o, cfg: (
            _need(o["threshold"] == 0.1, "PFLlib's ALA threshold is fixed at 0.1: fedala.threshold=0.1")
            + _need(o["num_pre_loss"] == 10, "PFLlib's ALA num_pre_loss is fixed at 10: fedala.num_pre_loss=10")
        ),
        note="PFLlib's first ALA has no epoch cap (privfl max_ala_epochs); its s% sample is a contiguous window",
    ),
    "fedavgdbe": Parity(
        "FedDBE",
        flags=lambda o, cfg: ["-mo", _f(o["mean_momentum"]), "-klw", _f(o["kappa"])],
        mismatch=lambda o, cfg: _need(o.get("train_prbm", True), "PFLlib always trains the PRBM: fedavgdbe.train_prbm=true"),
    ),
}

#: privfl model group -> PFLlib's -m (the constructor follows from -m and the dataset name, below)
PFLLIB_MODELS: dict[str, str] = {"homo-cnn4": "CNN"}
#: privfl dataset -> the token PFLlib's main.py looks for in -data to build -m CNN for that input
#: ("MNIST": FedAvgCNN(1, dim=1024); "Cifar10" (also in "Cifar100"): FedAvgCNN(3, dim=1600); any other
#: name: FedAvgCNN(3, dim=10816), 64x64 inputs)
PFLLIB_DATASETS: dict[str, str] = {
    "fashionmnist": "FashionMNIST",
    "mnist": "MNIST",
    "cifar10": "Cifar10",
    "cifar100": "Cifar100",
    "tinyimagenet": "TinyImagenet",
}


@dataclass(frozen=True)
class Reference:
    """A library the harness runs privfl against: its method map, launcher, what its Python needs and
    which privfl flags reproduce its data loaders (``fixed_privfl``)."""

    key: str  # the --reference value, and the prefix of its --KEY, --KEY-python, --KEY-pythonpath options
    name: str
    methods: dict[str, Parity]
    launcher: Path
    fixed_privfl: list[str]
    packages: tuple[str, ...]

    def dataset_name(self, dataset: str, seed: int) -> str:
        """The exported dataset's folder name (PFLlib picks its CNN's input shape from it)."""
        if self.key == "pfllib":
            return f"{PFLLIB_DATASETS[dataset]}_privfl_s{seed}"
        return f"{dataset}_privfl_s{seed}"

    def model_problem(self, model_group: str, dataset: str) -> str | None:
        """Why this reference has no counterpart of privfl's model group on this dataset (None: it has)."""
        if self.key == "pfllib":
            if model_group not in PFLLIB_MODELS:
                return f"model group {model_group} has no PFLlib counterpart here; mapped: {', '.join(PFLLIB_MODELS)}"
            if dataset not in PFLLIB_DATASETS:
                return f"dataset {dataset} has no PFLlib name here (PFLlib builds its CNN from the name); mapped: {', '.join(PFLLIB_DATASETS)}"
            return None
        if model_group not in MODEL_GROUPS:
            return f"model group {model_group} has no HtFLlib counterpart here; mapped: {', '.join(MODEL_GROUPS)}"
        return None

    def commands(
        self,
        parity: Parity,
        opts: Options,
        cfg: Options,
        *,
        root: Path,
        python: str,
        data: str,
        num_classes: int,
        channels: int,
        image_size: int,
        result: Path,
        threads: int = 1,
    ) -> tuple[list[str], list[str]]:
        """(launcher command, main.py flags) for one method on this reference. The method's own flags come
        last and replace a shared flag they repeat (PFLlib's ``-ls`` for Per-FedAvg and FedRep)."""
        assert parity.algo is not None
        shared: dict[str, str] = {"-data": data}
        if self.key == "pfllib":
            shared["-m"] = PFLLIB_MODELS[cfg["model_group"]]
        else:
            shared["-m"] = MODEL_GROUPS[cfg["model_group"]][0]
        shared |= {"-algo": parity.algo, "-gr": str(cfg["rounds"]), "-lr": _f(cfg["lr"]), "-lbs": str(cfg["batch_size"])}
        shared |= {"-ls": str(cfg["local_epochs"]), "-jr": "1", "-nc": str(cfg["num_clients"]), "-ncl": str(num_classes)}
        if self.key == "htfllib":
            shared["-fd"] = str(cfg["rep_dim"])
        source = parity.source
        if source is not None:
            shared["-m"] = source.family
            shared = {source.rename.get(k, k): v for k, v in shared.items()}
        shared |= {"-dev": "cpu", "-go": "parity", "-t": "1", "-eg": "1"}
        own = parity.flags(opts, cfg)
        if len(own) % 2:
            raise ValueError(f"{parity.algo}: method flags must come in flag/value pairs, got {own}")
        shared |= dict(zip(own[::2], own[1::2]))
        launcher = [python, str(self.launcher), "--system", str(root / "system"), "--threads", str(threads), "--result", str(result)]
        if source is not None:
            launcher += list(source.launcher)
        if self.key == "htfllib":
            pinned = MODEL_GROUPS[cfg["model_group"]][1]
            if pinned:
                launcher += ["--model", pinned.format(channels=channels, flat=cnn_flat_dim(image_size))]
        return launcher, [x for pair in shared.items() for x in pair]


REFERENCES: dict[str, Reference] = {
    "htfllib": Reference("htfllib", "HtFLlib", PARITY, LAUNCHER, FIXED_PRIVFL, ("torch", "torchvision", "numpy", "sklearn", "h5py", "calmsize")),
    # PFLlib's train loader shuffles (torch's global RNG) and drops the last partial batch: privfl shuffles
    # with its own seeded order, same batches per epoch, other order
    "pfllib": Reference(
        "pfllib",
        "PFLlib",
        PFLLIB,
        HERE / "pfllib_launch.py",
        [f for f in FIXED_PRIVFL if f != "--no-shuffle"] + ["--shuffle"],
        ("torch", "torchvision", "numpy", "sklearn", "h5py", "calmsize"),
    ),
}


def _load_exporter() -> Any:
    """``export_htfllib.py`` beside this script (also when this script is itself loaded by path)."""
    if "export_htfllib" in sys.modules:
        return sys.modules["export_htfllib"]
    spec = importlib.util.spec_from_file_location("export_htfllib", HERE / "export_htfllib.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["export_htfllib"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["export_htfllib"]
        raise
    return module


def cnn_flat_dim(image_size: int) -> int:
    """FedAvgCNN's flattened size: two (5x5 conv, no padding) + 2x2 max-pool stages, 64 channels."""
    s = image_size
    for _ in range(2):
        s = (s - 4) // 2
    return 64 * s * s


def parse_sets(items: Sequence[str], methods: Sequence[str]) -> dict[str, dict[str, str]]:
    """``METHOD.KEY=VALUE`` (repeatable) -> {method: {key: value}} (values stay text: privfl's parser types them)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        head, eq, value = item.partition("=")
        method, dot, key = head.partition(".")
        if not eq or not dot or not method or not key:
            raise ConfigError(f"--set takes METHOD.KEY=VALUE, got {item!r}")
        if method not in methods:
            raise ConfigError(f"--set {item}: {method} is not in --methods ({', '.join(methods)})")
        out.setdefault(method, {})[key.replace("-", "_")] = value
    return out


def option_flags(options: Mapping[str, Any]) -> list[str]:
    flags = []
    for key, value in options.items():
        name = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [name, str(value)]
    return flags


@dataclass
class Setting:
    """The table's shared setting (privfl.train flags) and where things go."""

    dataset: str
    subsample: int | None
    num_clients: int
    partition: str
    alpha: float
    model_group: str
    lr: float
    batch_size: int
    rounds: int
    local_epochs: int
    data_root: str | None
    extra: list[str] = field(default_factory=list)

    def privfl_flags(self, seed: int, fixed: Sequence[str] = FIXED_PRIVFL) -> list[str]:
        """privfl.train's flags for this setting, with ``fixed`` (the reference library's loaders and init)."""
        flags = ["--dataset", self.dataset, "--num-clients", str(self.num_clients), "--partition", self.partition, "--alpha", _f(self.alpha)]
        flags += ["--model-group", self.model_group, "--lr", _f(self.lr), "--batch-size", str(self.batch_size), "--rounds", str(self.rounds)]
        flags += ["--local-epochs", str(self.local_epochs), "--join-ratio", "1", "--seed", str(seed), *fixed]
        if self.subsample is not None:
            flags += ["--subsample", str(self.subsample)]
        if self.data_root is not None:
            flags += ["--data-root", self.data_root]
        return flags + self.extra

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def run_logged(cmd: list[str], log: Path, cwd: Path | None = None, env: Mapping[str, str] | None = None) -> tuple[int, float]:
    """Run ``cmd`` with stdout+stderr into ``log``; returns (exit status, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        done = subprocess.run(cmd, cwd=cwd, env=dict(env) if env is not None else None, stdout=fh, stderr=subprocess.STDOUT, check=False)
    return done.returncode, time.perf_counter() - t0


def tail(path: Path, n: int = 6) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in lines[-n:])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def round_seconds(seconds: Sequence[float]) -> tuple[float, float]:
    """(mean over the rounds after the first, mean over all) of one side's per-round seconds (module
    docstring, "Time per round"); NaN where there are none."""
    if not seconds:
        return float("nan"), float("nan")
    return (statistics.fmean(seconds[1:]) if len(seconds) > 1 else float("nan")), statistics.fmean(seconds)


def privfl_side(run_dir: Path) -> dict[str, Any]:
    """Accuracy (global and personal, final and best) and seconds per round of a finished privfl run."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    acc = [r["acc"] for r in rows]
    best = max(range(len(acc)), key=acc.__getitem__)
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "rounds": len(rows),
        "acc": acc,
        "final_acc": acc[-1],
        "best_acc": acc[best],
        "best_round": rows[best]["round"],
        "s_per_round": round_seconds([r["seconds"] for r in rows])[0],
        "seconds": [r["seconds"] for r in rows],
    }
    if all("acc_personal" in r for r in rows):
        personal = [r["acc_personal"] for r in rows]
        out.update({"acc_personal": personal, "final_acc_personal": personal[-1], "best_acc_personal": max(personal)})
    return out


def htfllib_side(log: Path, rounds: int) -> dict[str, Any]:
    """Accuracy (aligned: HtFLlib's evaluations 1..R) and seconds per round from the launcher's output."""
    text = log.read_text(errors="replace").splitlines()
    result = model = None
    times = []
    for line in text:
        if line.startswith("PARITY-RESULT "):
            result = json.loads(line.removeprefix("PARITY-RESULT "))
        elif line.startswith("PARITY-MODEL "):
            model = json.loads(line.removeprefix("PARITY-MODEL "))
        else:
            found = TIME_LINE.match(line.strip())
            if found:
                times.append(float(found.group(1)))
    if result is None or not result.get("runs"):
        raise ValueError(f"no PARITY-RESULT line in {log}")
    raw = result["runs"][0]["rs_test_acc"]
    if len(raw) < rounds + 1:
        raise ValueError(f"{log}: HtFLlib evaluated {len(raw)} times, expected {rounds + 1} (-gr {rounds})")
    aligned = raw[1 : rounds + 1]  # start of round r+1 = after r+1 rounds of training = privfl's round r
    best = max(range(len(aligned)), key=aligned.__getitem__)
    return {
        "log": str(log),
        "acc_untrained": raw[0],
        "acc": aligned,
        "final_acc": aligned[-1],
        "best_acc": aligned[best],
        "best_round": best,
        "s_per_round": round_seconds(times)[0],
        "seconds": times,
        "threads": result.get("threads"),
        "results_file": result["runs"][0]["file"],
        "model": model,
    }


def printed_accuracies(log: Path) -> list[float]:
    """The ``Averaged Test Accuracy`` lines HtFLlib printed (4 decimals; evaluation 0 = untrained)."""
    return [float(x) for x in re.findall(r"^Averaged Test Accuracy: ([0-9.]+)\s*$", log.read_text(errors="replace"), re.M)]


def outcome_note(row: Mapping[str, Any]) -> str:
    """The row's note plus why a side has no numbers (a failure, or settings the reference cannot express)."""
    parts = [row.get("note", "")]
    ref = row.get("reference", "HtFLlib")
    if row.get("privfl_error"):
        parts.append(f"privfl failed: {row['privfl_error'][-160:]}")
    if row.get("htfllib_error"):
        partial = row.get("htfllib_partial_acc")
        done = f" after {len(partial)} evaluations ({', '.join(f'{100 * a:.2f}' for a in partial)})" if partial else ""
        parts.append(f"{ref} failed{done}: {row['htfllib_error'].split(' | ')[-1][-160:]}")
    return "; ".join(p for p in parts if p)


def privfl_model_params(cfg: Mapping[str, Any], channels: int, image_size: int, num_classes: int) -> list[list[Any]]:
    """Client 0's privfl model: parameter names and shapes."""
    from privfl.models import assign_archs, build_model

    arch = assign_archs(cfg["model_group"], cfg["num_clients"])[0]
    model = build_model(arch, in_channels=channels, num_classes=num_classes, image_size=image_size, rep_dim=cfg["rep_dim"], mapping=cfg["mapping"])
    return [[name, list(p.shape)] for name, p in model.named_parameters()]


def compare_models(privfl_params: list[list[Any]], htfl: Mapping[str, Any] | None) -> dict[str, Any]:
    if not htfl:
        return {"checked": False}
    a = [tuple(s) for _, s in privfl_params]
    b = [tuple(s) for _, s in htfl["params"]]

    def count(shapes: list[tuple[int, ...]]) -> int:
        return sum(math.prod(s) for s in shapes)

    return {
        "checked": True,
        "same_shapes_in_order": a == b,
        "privfl_params": count(a),
        "htfllib_params": count(b),
        "privfl": privfl_params,
        "htfllib": htfl["params"],
        "htfllib_constructor": htfl.get("constructor"),
    }


def pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def secs(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


COLUMNS = [
    ("method", "method"),
    ("seed", "seed"),
    ("privfl_final", "privfl acc final"),
    ("privfl_best", "privfl acc best"),
    ("privfl_personal_final", "privfl personal final"),
    ("htfllib_final", "HtFLlib acc final"),
    ("htfllib_best", "HtFLlib acc best"),
    ("diff_final", "diff final (pp)"),
    ("diff_best", "diff best (pp)"),
    ("privfl_last5", "privfl last-5 mean"),
    ("htfllib_last5", "HtFLlib last-5 mean"),
    ("diff_last5", "diff last-5 (pp)"),
    ("privfl_s_round", "privfl s/round"),
    ("htfllib_s_round", "HtFLlib s/round"),
    ("privfl_s_round_all", "privfl s/round incl. 1st"),
    ("htfllib_s_round_all", "HtFLlib s/round incl. 1st"),
]


LAST = 5  # rounds averaged in the last-k columns: one round's accuracy swings by points under Dir(0.1)


def _last(acc: Sequence[float] | None) -> float | None:
    return statistics.fmean(acc[-LAST:]) if acc else None


def flat_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One table line: final, best and mean-of-the-last-5 aligned accuracies of both sides, their
    differences (privfl - reference) and seconds per round.

    The reference side keeps the ``htfllib*`` keys whichever library it is (``reference`` names it), so
    that tables written before PFLlib was added still render and merge. privfl's accuracy is the one of
    the row's ``protocol`` (``global`` unless the method map says ``personal``)."""
    p, h = row.get("privfl") or {}, row.get("htfllib") or {}
    # from each side's per-round seconds where recorded (tables written before privfl left its first round out too)
    p_warm, p_all = round_seconds(p["seconds"]) if p.get("seconds") else (p.get("s_per_round"), None)
    h_warm, h_all = round_seconds(h["seconds"]) if h.get("seconds") else (h.get("s_per_round"), None)
    personal = row.get("protocol", "global") == "personal"
    acc = p.get("acc_personal") if personal else p.get("acc")
    out = {
        "method": row["method"],
        "seed": row["seed"],
        "privfl_final": p.get("final_acc_personal") if personal else p.get("final_acc"),
        "privfl_best": p.get("best_acc_personal") if personal else p.get("best_acc"),
        "privfl_personal_final": p.get("final_acc_personal"),
        "htfllib_final": h.get("final_acc"),
        "htfllib_best": h.get("best_acc"),
        "diff_final": None,
        "diff_best": None,
        "privfl_last5": _last(acc),
        "htfllib_last5": _last(h.get("acc")),
        "diff_last5": None,
        "privfl_s_round": p_warm,
        "htfllib_s_round": h_warm,
        "privfl_s_round_all": p_all,
        "htfllib_s_round_all": h_all,
        "htfllib_algo": row.get("htfllib_algo"),
        "reference": row.get("reference", "HtFLlib"),
        "protocol": row.get("protocol", "global"),
        "note": outcome_note(row),
    }
    if out["privfl_final"] is not None and out["htfllib_final"] is not None:
        out["diff_final"] = out["privfl_final"] - out["htfllib_final"]
        out["diff_best"] = out["privfl_best"] - out["htfllib_best"]
    if out["privfl_last5"] is not None and out["htfllib_last5"] is not None:
        out["diff_last5"] = out["privfl_last5"] - out["htfllib_last5"]
    return out


def aggregate(flat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds per method (rows with ``seed`` = ``mean``), when more than one seed ran."""
    out = []
    for method in dict.fromkeys(r["method"] for r in flat):
        rows = [r for r in flat if r["method"] == method]
        if len(rows) < 2:
            continue
        agg: dict[str, Any] = {"method": method, "seed": "mean", "htfllib_algo": rows[0]["htfllib_algo"], "note": f"mean of {len(rows)} seeds"}
        agg |= {k: rows[0].get(k) for k in ("reference", "protocol")}
        for key, _ in COLUMNS[2:]:
            values = [r[key] for r in rows if r[key] is not None]
            agg[key] = statistics.fmean(values) if values else None
            if len(values) > 1 and "s_round" not in key:
                agg[key + "_std"] = statistics.stdev(values)
        out.append(agg)
    return out


def render(flat: list[dict[str, Any]]) -> str:
    names = {r.get("reference", "HtFLlib") for r in flat}
    ref = names.pop() if len(names) == 1 else "reference"
    cells = [[label.replace("HtFLlib", ref) for _, label in COLUMNS]]
    for r in flat:
        line = []
        for key, _ in COLUMNS:
            v = r.get(key)
            if key in ("method", "seed"):
                line.append(str(v))
            elif "s_round" in key:
                line.append(secs(v))
            elif key.startswith("diff"):
                line.append("-" if v is None else f"{100 * v:+.2f}")
            else:
                line.append(pct(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    notes = [f"  {r['method']}: {r['note']}" for r in flat if r.get("note") and r.get("seed") != "mean"]
    return "\n".join(lines + (["notes:", *dict.fromkeys(notes)] if notes else []))


def write_table_files(out: Path, protocol: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``table.json`` (protocol, table, every row in full), ``table.csv`` and ``table.txt`` under ``out``."""
    flat = [flat_row(r) for r in rows]
    flat += aggregate(flat)
    (out / "table.json").write_text(json.dumps({"protocol": protocol, "table": flat, "rows": rows}, indent=2, default=str) + "\n")
    with open(out / "table.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, list(dict.fromkeys(k for r in flat for k in r)))
        writer.writeheader()
        writer.writerows(flat)
    (out / "table.txt").write_text(render(flat) + "\n")
    return flat


def rerender(sources: Sequence[Path], out: Path) -> list[dict[str, Any]]:
    """The tables of finished harness runs (their ``table.json``; several are merged, e.g. runs of other
    seeds), recomputed into ``out``. Nothing is trained."""
    protocol: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for source in sources:
        try:
            saved = json.loads(source.read_text())
            setting = saved["protocol"]["setting"]
            rows += list(saved["rows"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--render {source}: not a table.json written by run_parity.py ({exc})") from None
        if protocol and setting != protocol["setting"]:
            raise ConfigError(f"--render {source}: its setting differs from {sources[0]}'s; merge only runs of one setting")
        if protocol and saved["protocol"].get("reference", "htfllib") != protocol.get("reference", "htfllib"):
            raise ConfigError(f"--render {source}: its reference library differs from {sources[0]}'s; merge only runs against one")
        protocol = protocol or dict(saved["protocol"])
    protocol["merged_from"] = [str(s) for s in sources]
    protocol["seeds"] = sorted({r["seed"] for r in rows})
    out.mkdir(parents=True, exist_ok=True)
    return write_table_files(out, protocol, rows)


def check_reference(ref: Reference, root: Path, python: str, env: Mapping[str, str], source: Source | None = None, given: str = "") -> str | None:
    """One line on what keeps the reference library (or a method's ``source`` checkout ``given``, whose
    ``system/`` is under ``root``) from running here (None: all there)."""
    if not (root / "system" / "main.py").is_file():
        if source is not None:
            return f"--{source.option} {given}: no {source.subdir}/system/main.py there (give a clone of {source.repository})"
        return f"--{ref.key} {root}: no system/main.py there (give the folder that holds {ref.name}'s system/)"
    needed = ref.packages
    probe = f"import importlib.util as u; print(' '.join(n for n in {needed!r} if u.find_spec(n) is None))"
    try:
        done = subprocess.run([python, "-c", probe], env=dict(env), capture_output=True, text=True, check=False, timeout=300)
    except OSError as exc:
        return f"--{ref.key}-python {python} cannot be run ({exc})"
    if done.returncode != 0:
        return f"--{ref.key}-python {python} failed: {tail_text(done.stderr)}"
    missing = done.stdout.split()
    if missing:
        return (
            f"{ref.name}'s Python lacks {', '.join(missing)}: install them (pip install --target DIR {' '.join(missing)}, "
            f"then --{ref.key}-pythonpath DIR) or give --{ref.key}-python"
        )
    return None


def tail_text(text: str) -> str:
    return " ".join(text.strip().splitlines()[-1:])


def git_commit(path: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=False, timeout=30)
    except OSError:
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def partition_digest(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "truth" / "partition.safetensors").read_bytes()).hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m experiments.parity.run_parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--methods", default="local,fedavg,fedproto,fedgh,fedre", help="comma list of privfl method names")
    p.add_argument("--seeds", default="0", help="comma list of seeds (each: its own partition, both sides)")
    p.add_argument(
        "--reference", default="htfllib", choices=tuple(REFERENCES), help="the library privfl is compared with (method map: PARITY or PFLLIB)"
    )
    p.add_argument("--htfllib", help="HtFLlib checkout (the folder holding system/); required for --reference htfllib unless --sides privfl")
    p.add_argument("--htfllib-python", default=sys.executable, help="Python that runs HtFLlib (default: this one)")
    p.add_argument("--htfllib-pythonpath", default="", help="prepended to HtFLlib's PYTHONPATH (e.g. where h5py and calmsize were installed)")
    p.add_argument("--pfllib", help="PFLlib checkout (the folder holding system/); required for --reference pfllib unless --sides privfl")
    p.add_argument("--pfllib-python", default=sys.executable, help="Python that runs PFLlib (default: this one)")
    p.add_argument("--pfllib-pythonpath", default="", help="prepended to PFLlib's PYTHONPATH (e.g. where h5py and calmsize were installed)")
    p.add_argument(
        "--fedre",
        help="the FedRE authors' repository (AIResearch-Group/FedRE, the folder holding HtFLlib/): with --reference htfllib, "
        "FedRE's row runs its code (with HtFLlib's Python options)",
    )
    p.add_argument("--sides", help="which sides to run: privfl, the reference (htfllib or pfllib) or both (default: both)")
    p.add_argument("--out", default="runs/parity", help="output folder (new or empty)")
    p.add_argument("--dataset", default="fashionmnist")
    p.add_argument("--subsample", type=int, default=3000)
    p.add_argument("--num-clients", type=int, default=10)
    p.add_argument("--partition", default="dir")
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--model-group", default="homo-cnn4")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads each side computes with (default 1); with more, privfl trains that many clients at once "
        "(--client-workers auto) and the reference splits each operation over them",
    )
    p.add_argument("--data-root", help="privfl's --data-root")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE", help="a method option, on both sides (repeatable)")
    p.add_argument("--privfl-arg", action="append", default=[], help="an extra privfl.train argument (repeatable; e.g. --privfl-arg=--no-capture)")
    p.add_argument("--render", metavar="TABLE_JSON[,...]", help="only recompute the tables of finished runs' table.json (merged) into --out")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.render is not None:
        out = Path(args.out)
        if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
            raise ConfigError(f"--out {out} exists and is not an empty folder; give a new one (nothing is overwritten)")
        print(render(rerender([Path(t) for t in args.render.split(",") if t], out)))
        return 0

    from privfl.methods import METHODS

    ref = REFERENCES[args.reference]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; privfl has: {', '.join(METHODS.names())}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds takes a comma list of integers, got {args.seeds!r}") from None
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"--seeds takes non-negative integers, got {args.seeds!r}")
    sides = {s.strip() for s in (args.sides or f"privfl,{ref.key}").split(",") if s.strip()}
    if not sides or sides - {"privfl", ref.key}:
        raise ConfigError(f"--sides takes privfl, {ref.key} or both with --reference {ref.key}, got {args.sides!r}")
    run_ref = ref.key in sides
    sets = parse_sets(args.set, methods)
    if run_ref:
        problem = ref.model_problem(args.model_group, args.dataset)
        if problem:
            raise ConfigError(problem)
    fixed = (
        "--optimizer",
        "--momentum",
        "--weight-decay",
        "--shuffle",
        "--no-shuffle",
        "--no-drop-last",
        "--no-same-init",
        "--join-ratio",
        "--seed",
        "--out-dir",
    )
    for bad in (*fixed, "--run-name", "--local-epochs", "--eval"):
        if any(a == bad or a.startswith(bad + "=") for a in args.privfl_arg):
            raise ConfigError(
                f"--privfl-arg {bad}: the harness sets it (the reference's plain SGD, batch order, drop_last, one init, join ratio 1, "
                "epochs per method, both evaluations)"
            )

    if args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {args.threads}")
    out = Path(args.out)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ConfigError(f"--out {out} exists and is not an empty folder; give a new one (nothing is overwritten)")
    out = out.absolute()  # the reference side runs in a working directory of its own
    given_root = getattr(args, ref.key)
    ref_root = Path(given_root).resolve() if given_root else None
    ref_python = getattr(args, f"{ref.key}_python")
    extra_path = [p for p in getattr(args, f"{ref.key}_pythonpath").split(os.pathsep) if p]
    ref_env = {**os.environ, **thread_env(args.threads), "PYTHONPATH": os.pathsep.join([*extra_path, *filter(None, [os.environ.get("PYTHONPATH")])])}
    # methods whose reference code is a checkout of its own (Source): --OPTION PATH -> the folder holding system/
    sources = {spec.source.option: spec.source for spec in PARITY.values() if spec.source}
    source_roots: dict[str, Path] = {}
    for option, source in sources.items():
        given = getattr(args, option)
        if given is None:
            continue
        if ref.key != "htfllib":
            raise ConfigError(f"--{option} runs with --reference htfllib (its code is HtFLlib-based), not --reference {ref.key}")
        source_roots[option] = Path(given).resolve() / source.subdir
    if run_ref:
        in_library = [m for m in methods if m in ref.methods and ref.methods[m].algo and ref.methods[m].source is None]
        if ref_root is None and in_library:
            raise ConfigError(f"--{ref.key} PATH is required to run {ref.name}'s side of {', '.join(in_library)} (or --sides privfl)")
        if ref_root is not None:
            problem = check_reference(ref, ref_root, ref_python, ref_env)
            if problem:
                raise ConfigError(problem)
        for option, root in source_roots.items():
            problem = check_reference(ref, root, ref_python, ref_env, sources[option], getattr(args, option))
            if problem:
                raise ConfigError(problem)

    setting = Setting(
        args.dataset,
        args.subsample,
        args.num_clients,
        args.partition,
        args.alpha,
        args.model_group,
        args.lr,
        args.batch_size,
        args.rounds,
        args.local_epochs,
        args.data_root,
        list(args.privfl_arg),
    )
    out.mkdir(parents=True, exist_ok=True)
    exporter = _load_exporter()
    privfl_env = {**os.environ, **thread_env(args.threads)}
    cfg_base = {"lr": args.lr, "batch_size": args.batch_size}
    rows: list[dict[str, Any]] = []

    protocol = {
        "setting": setting.as_dict(),
        "seeds": seeds,
        "reference": ref.key,
        "privfl_fixed_flags": ref.fixed_privfl,
        "alignment": f"privfl round r (0-based, end of round) = {ref.name} rs_test_acc[r+1] (start of round r+1); rs_test_acc[0] is untrained",
        "threads": args.threads,
        ref.key: str(ref_root) if ref_root else None,
        f"{ref.key}_commit": git_commit(ref_root) if ref_root else None,
        **{option: str(root.parent) for option, root in source_roots.items()},
        **{f"{option}_commit": git_commit(root.parent) for option, root in source_roots.items()},
        "python": sys.version.split()[0],
        "torch": __import__("torch").__version__,
    }

    def write_tables() -> list[dict[str, Any]]:
        return write_table_files(out, protocol, rows)

    for seed in seeds:
        datasets: dict[str, str] = {}  # partition digest -> exported dataset name
        work = out / ref.key / f"seed{seed}"
        for method in methods:
            parity = ref.methods.get(method, Parity(None, note=f"not mapped to {ref.name} by this harness"))
            row: dict[str, Any] = {"method": method, "seed": seed, "reference": ref.name, "htfllib_algo": parity.algo, "note": parity.note}
            if parity.protocol != "global":
                row["protocol"] = parity.protocol
            rows.append(row)
            # ---- privfl
            fields_ = set(getattr(METHODS.get(method).Options, "__dataclass_fields__", {}))
            wanted = {**parity.privfl({**cfg_base, "rep_dim": 512}), **sets.get(method, {})}
            skipped = sorted(k for k in wanted if k not in fields_)
            options = {k: v for k, v in wanted.items() if k in fields_}
            row["privfl_options"] = options
            if skipped:
                row["note"] = (row["note"] + "; " if row["note"] else "") + f"privfl {method} has no option(s) {', '.join(skipped)}"
            method_setting = dataclasses.replace(setting, **parity.setting(setting.as_dict())) if parity.algo else setting
            if method_setting != setting:
                row["privfl_setting"] = {k: v for k, v in method_setting.as_dict().items() if v != getattr(setting, k)}
            run_dir = out / "privfl" / f"{method}-s{seed}"
            if "privfl" in sides:
                (out / "privfl").mkdir(exist_ok=True)
                cmd = [sys.executable, "-m", "privfl.train", method, *method_setting.privfl_flags(seed, ref.fixed_privfl), *option_flags(options)]
                cmd += ["--out-dir", str(out / "privfl"), "--run-name", run_dir.name]
                row["privfl_cmd"] = cmd
                print(f"[seed {seed}] privfl {method} ...", flush=True)
                rc, wall = run_logged(cmd, out / "privfl" / f"{method}-s{seed}.log", env=privfl_env)
                if rc != 0:
                    row["privfl_error"] = tail(out / "privfl" / f"{method}-s{seed}.log")
                    print(f"[seed {seed}] privfl {method} FAILED (exit {rc}): {row['privfl_error']}", flush=True)
                else:
                    row["privfl"] = privfl_side(run_dir)
                    row["privfl"]["wall_seconds"] = wall
                    row["privfl"]["loadavg_after"] = list(os.getloadavg())  # other work on the machine shows in s/round
                    done = row["privfl"]
                    final = done.get("final_acc_personal") if parity.protocol == "personal" else done["final_acc"]
                    print(f"[seed {seed}] privfl {method}: final {pct(final)} ({parity.protocol}), {secs(done['s_per_round'])} s/round", flush=True)
            write_tables()
            # ---- the reference library (or the method's own reference code, Source)
            if not run_ref or parity.algo is None:
                continue
            method_root = ref_root
            if parity.source is not None:
                method_root = source_roots.get(parity.source.option)
                if method_root is None:
                    row["note"] = (
                        f"{ref.name} has no {parity.algo}; --{parity.source.option} PATH ({parity.source.repository}) runs the authors' code"
                    )
                    write_tables()
                    continue
            assert method_root is not None
            if "privfl" in row:
                resolved = json.loads((run_dir / "config.json").read_text())
            elif "privfl" in sides:
                continue  # privfl failed: nothing to compare against
            else:  # reference only: the options privfl would resolve
                from privfl.config import build_config

                values = {
                    "method": method,
                    "dataset": method_setting.dataset,
                    "subsample": method_setting.subsample,
                    "num_clients": method_setting.num_clients,
                    "partition": method_setting.partition,
                    "alpha": method_setting.alpha,
                    "model_group": method_setting.model_group,
                    "lr": method_setting.lr,
                    "batch_size": method_setting.batch_size,
                    "rounds": method_setting.rounds,
                    "local_epochs": method_setting.local_epochs,
                    "seed": seed,
                    "options": options,
                }
                resolved = dataclasses.asdict(build_config(values, METHODS.get(method).Options))
            opts = resolved.get("options") or {}
            problems = parity.mismatch(opts, resolved)
            if problems:
                row["htfllib_error"] = "; ".join(problems)
                print(f"[seed {seed}] {ref.name} {parity.algo}: not comparable: {row['htfllib_error']}", flush=True)
                write_tables()
                continue
            # the partition, exported once per distinct partition
            work.mkdir(parents=True, exist_ok=True)
            digest = partition_digest(run_dir) if "privfl" in row else f"args-seed{seed}"
            if digest not in datasets:
                name = ref.dataset_name(setting.dataset, seed) + (f"_{len(datasets)}" if datasets else "")
                if "privfl" in row:
                    export = exporter.from_run(run_dir, setting.data_root)
                else:  # reference only: the partition privfl.train would draw for these options
                    export = exporter.from_train_args([method, *method_setting.privfl_flags(seed, ref.fixed_privfl)])
                exporter.write(export, work / "dataset" / name)
                datasets[digest] = name
                (work / "cwd").mkdir(exist_ok=True)
                (work / "results").mkdir(exist_ok=True)
                row["export"] = {"name": name, "folder": str(work / "dataset" / name)}
            name = datasets[digest]
            data_cfg = json.loads((work / "dataset" / name / "config.json").read_text())
            sample = exporter.read_htfllib_client(work / "dataset" / name, 0, "test")
            channels, image_size = int(sample["x"].shape[1]), int(sample["x"].shape[2])
            launcher, flags = ref.commands(
                parity,
                opts,
                resolved,
                root=method_root,
                python=ref_python,
                data=name,
                num_classes=int(data_cfg["num_classes"]),
                channels=channels,
                image_size=image_size,
                result=work / f"{method}.result.json",
                threads=args.threads,
            )
            cmd = [*launcher, "--", *flags]
            row["htfllib_cmd"] = cmd
            print(f"[seed {seed}] {ref.name} {parity.algo} ...", flush=True)
            log = work / f"{method}.log"
            # main.py imports the library's packages (flcore, utils) by their top-level names
            launch_env = {**ref_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(method_root / "system"), ref_env.get("PYTHONPATH")]))}
            rc, wall = run_logged(cmd, log, cwd=work / "cwd", env=launch_env)
            if rc != 0:
                row["htfllib_error"] = tail(log)
                row["htfllib_partial_acc"] = printed_accuracies(log)  # what it evaluated before it stopped (round 0 first)
                print(f"[seed {seed}] {ref.name} {parity.algo} FAILED (exit {rc}): {row['htfllib_error']}", flush=True)
            else:
                try:
                    row["htfllib"] = htfllib_side(log, int(resolved["rounds"]))
                except (ValueError, KeyError, IndexError) as exc:
                    row["htfllib_error"] = str(exc)
                else:
                    row["htfllib"]["wall_seconds"] = wall
                    row["htfllib"]["loadavg_after"] = list(os.getloadavg())
                    params = privfl_model_params(resolved, channels, image_size, int(data_cfg["num_classes"]))
                    row["model_check"] = compare_models(params, row["htfllib"].pop("model"))
                    print(
                        f"[seed {seed}] {ref.name} {parity.algo}: final {pct(row['htfllib']['final_acc'])}, "
                        f"{secs(row['htfllib']['s_per_round'])} s/round, same model shapes: {row['model_check'].get('same_shapes_in_order')}",
                        flush=True,
                    )
            write_tables()

    flat = write_tables()
    print()
    print(render(flat))
    print(f"\nwritten: {out / 'table.json'}, {out / 'table.csv'}, {out / 'table.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.parity.run_parity", main))
