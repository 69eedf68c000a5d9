"""Run HtFLlib's unchanged ``system/main.py`` in this process, as ``run_parity.py``'s subprocess.

    PYTHONPATH=HTFLLIB/system python experiments/parity/htfllib_launch.py --system HTFLLIB/system \\
        [--model EXPR]... [--threads 1] [--result FILE] -- MAIN.PY ARGS

It runs under HtFLlib's Python, which need not have privfl, so it is started by its path, not with
``python -m``. ``main.py`` imports HtFLlib's packages (``flcore``, ``utils``) by their top-level names:
``system/`` must come first on ``PYTHONPATH`` (``run_parity.py`` puts it there; the launcher checks and
refuses otherwise, exit status 2).

What this adds around ``main.py`` (which is executed as ``__main__`` with ``runpy``, from HtFLlib's own
files; nothing of HtFLlib is copied or edited):

* ``--model EXPR`` pins ``args.models`` (HtFLlib's list of model constructor strings, evaluated in
  ``flcore/trainmodel/models.py``). ``main.py`` sets ``args.models`` from the ``-m`` family in ``run()``,
  and no family holds a single 1-channel 28x28 ``FedAvgCNN`` (its families are heterogeneous or for
  3-channel 32x32 images), so the namespace ``parse_args`` returns keeps the pinned list when
  ``run()`` assigns the family's. Give ``-m`` any family that sets neither ``global_model`` nor
  ``heads`` (``HtFE-img-2``).
* ``main.py`` imports every server, among them FedKTL's, whose StyleGAN helpers need ``click`` and
  ``requests`` and a working directory inside ``system/``, and FedL2G's, which needs ``higher``. Such a
  server module that cannot be imported is replaced by a stub that refuses to run (neither method is
  part of the parity table); every other import error still stops main.py.
* torch's thread count (``--threads``, default 1), before anything runs.
* ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: HtFLlib keeps every client and server object as a pickled
  module in its ``temp/`` folder (``torch.save``/``torch.load`` of whole models) and was written for
  torch < 2.6, where ``torch.load`` unpickled by default; torch >= 2.6 refuses such files unless told.
  The files are the ones this very process wrote a moment earlier.
* main.py's own ``torch.set_num_threads`` calls are ignored (one ``PARITY-THREADS`` line says so): the
  FedRE authors' ``main.py`` sets one thread in its ``set_random_seed``, and both sides of a row must
  compute with the same ``--threads``.
* ``--complete-fedre`` (the FedRE authors' code, AIResearch-Group/FedRE, whose ``HtFLlib/system`` is a
  self-contained partial HtFLlib: ``main.py``, ``serverre.py``, ``clientre.py`` and the base classes).
  Its server's round trains the clients, uploads one entangled representation each and trains the global
  head, but it never sends the head back to the clients, never evaluates and never saves results, so its
  ``train()`` fails at the end on ``max([])`` and ``main.py``'s ``average_data`` finds no results file
  (as read at the repository's commit b9b1e9c: ``serverre.py`` calls neither ``send_parameters`` nor
  ``evaluate``). The flag wraps two of its methods at run time, as HtFLlib's other
  servers (FedGH's ``train``) do each round: after ``select_clients``, ``send_parameters()`` (every
  client loads the server's head, the base class's method) and, every ``-eg`` rounds, ``evaluate()``,
  both inside the round's timed span as in FedGH; after ``train()``, ``save_results()``. Nothing else of
  its round changes (one line ``PARITY-PATCHED`` says what was wrapped).
* Before training, one line ``PARITY-MODEL {json}``: client 0's ``BaseHeadSplit`` parameter names and
  shapes, built on a forked RNG (nothing of HtFLlib's seeding changes). After training, one line
  ``PARITY-RESULT {json}`` with the results file's ``rs_test_acc`` (read with h5py, which HtFLlib needs
  anyway), also written to ``--result`` if given.

Run it with HtFLlib's data and results reachable from the working directory as ``../dataset/<NAME>``
and ``../results`` (``run_parity.py`` uses a scratch folder, so nothing is written into HtFLlib's copy).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import runpy
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: servers that need packages or files beyond torch/numpy/sklearn/h5py (FedKTL: StyleGAN helpers with
#: click/requests and a working directory inside system/; FedL2G: ``higher``). main.py imports them all,
#: the parity table runs none of them: the class each module exports, by module
OPTIONAL_SERVERS = {
    "flcore.servers.serverktl_stylegan_xl": "FedKTL",
    "flcore.servers.serverktl_stylegan_3": "FedKTL",
    "flcore.servers.serverktl_stable_diffusion": "FedKTL",
    "flcore.servers.serverl2g_feat": "FedL2G",
    "flcore.servers.serverl2g_logit": "FedL2G",
}


def _stub(name: str, cls_name: str, reason: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{name} could not be imported here ({reason}); the parity harness does not run {cls_name}")

    setattr(module, cls_name, type(cls_name, (), {"__init__": refuse}))
    return module


def stub_optional_servers() -> list[str]:
    """Import the optional server modules, or put a stub that refuses to run in their place; returns
    the stubbed names with the reason."""
    stubbed = []
    for name, cls_name in OPTIONAL_SERVERS.items():
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing package, or a cwd outside system/
            reason = f"{type(exc).__name__}: {exc}"
            sys.modules[name] = _stub(name, cls_name, reason)
            stubbed.append(f"{name} ({reason})")
    return stubbed


def importable_from(system: Path) -> bool:
    """Whether ``flcore`` (the package ``main.py`` imports first) resolves to ``system/flcore``, i.e. whether
    ``system`` is ahead of any other ``flcore`` on the import path (``PYTHONPATH``)."""
    try:
        spec = importlib.util.find_spec("flcore")
    except (ImportError, ValueError):
        return False
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(Path(place).resolve() == system / "flcore" for place in places)


def describe_model(args: argparse.Namespace) -> dict[str, Any]:
    """Client 0's model as HtFLlib builds it: parameter names and shapes (on a forked RNG)."""
    import torch
    from flcore.trainmodel.models import BaseHeadSplit  # type: ignore[import-not-found]  # HtFLlib's, on PYTHONPATH at run time

    with torch.random.fork_rng():
        model = BaseHeadSplit(args, 0)
    return {
        "constructor": args.models[0],
        "params": [[name, list(p.shape)] for name, p in model.named_parameters()],
        "modules": repr(model),
    }


def pin_models(models: list[str], on_parsed: Any) -> None:
    """Make ``ArgumentParser.parse_args`` return a namespace whose ``models`` stays ``models``."""

    class PinnedNamespace(argparse.Namespace):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "models" and "models" in self.__dict__:
                return  # main.run() assigns its family's list: keep the pinned one
            super().__setattr__(name, value)

    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        if namespace is None and self.prog == "main.py":
            namespace = PinnedNamespace(models=list(models)) if models else PinnedNamespace()
            parsed = original(self, args, namespace)
            on_parsed(parsed)
            return parsed
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign,assignment]


def keep_thread_count(threads: int) -> None:
    """Set torch's thread count and ignore later changes (main.py's own, see the module docstring)."""
    import torch

    torch.set_num_threads(threads)

    def set_num_threads(n: int) -> None:
        if n != threads:
            print(f"PARITY-THREADS main.py set {n} torch thread(s); kept --threads {threads}", flush=True)

    torch.set_num_threads = set_num_threads  # type: ignore[assignment]


def complete_fedre() -> list[str]:
    """Wrap the FedRE authors' server so that each round broadcasts the head and evaluates, and the run
    saves its results (module docstring); returns what was wrapped."""
    server_cls = importlib.import_module("flcore.servers.serverre").FedRE
    select_clients, train = server_cls.select_clients, server_cls.train

    def select_then_broadcast_and_evaluate(self: Any) -> Any:
        selected = select_clients(self)
        rnd = self.__dict__.get("_parity_round", 0)
        self._parity_round = rnd + 1
        self.send_parameters()
        if rnd % self.eval_gap == 0:
            self.evaluate()
        return selected

    def train_then_save(self: Any) -> None:
        train(self)
        self.save_results()

    server_cls.select_clients = select_then_broadcast_and_evaluate
    server_cls.train = train_then_save
    return ["FedRE.select_clients: then send_parameters() and, every eval_gap rounds, evaluate()", "FedRE.train: then save_results()"]


def read_results(args: argparse.Namespace) -> dict[str, Any]:
    """``../results/<dataset>_<algorithm>_<goal>_<times-1>.h5`` as main.py wrote it (run i = 0 .. times-1)."""
    h5py = importlib.import_module("h5py")
    out: dict[str, Any] = {"runs": []}
    for i in range(args.prev, args.times):
        path = Path("..") / "results" / f"{args.dataset}_{args.algorithm}_{args.goal}_{i}.h5"
        with h5py.File(path, "r") as hf:
            out["runs"].append({"file": str(path.resolve()), "rs_test_acc": [float(a) for a in hf["rs_test_acc"][()]]})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("htfllib_launch.py: error: give main.py's arguments after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="htfllib_launch.py")
    p.add_argument("--system", required=True, help="HtFLlib's system/ folder (holding main.py)")
    p.add_argument("--model", action="append", default=[], help="pin args.models to these constructor strings (repeatable)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--result", help="also write the PARITY-RESULT JSON here")
    p.add_argument(
        "--complete-fedre", action="store_true", help="the FedRE authors' main.py: broadcast the head, evaluate and save results (see above)"
    )
    ns = p.parse_args(argv[:cut])
    system = Path(ns.system).resolve()
    main_py = system / "main.py"
    if not main_py.is_file():
        print(f"htfllib_launch.py: error: {main_py} does not exist (--system takes HtFLlib's system/ folder)", file=sys.stderr)
        return 2

    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # see the module docstring
    import torch

    if not importable_from(system):
        print(f"htfllib_launch.py: error: put {system} first on PYTHONPATH (main.py imports flcore and utils from there)", file=sys.stderr)
        return 2
    keep_thread_count(ns.threads)
    stubbed = stub_optional_servers()
    if stubbed:
        print(f"PARITY-STUBBED {json.dumps(stubbed)}", flush=True)
    if ns.complete_fedre:
        print(f"PARITY-PATCHED {json.dumps(complete_fedre())}", flush=True)

    parsed: dict[str, argparse.Namespace] = {}

    def on_parsed(args: argparse.Namespace) -> None:
        parsed["args"] = args
        print(f"PARITY-MODEL {json.dumps(describe_model(args))}", flush=True)

    pin_models(ns.model, on_parsed)  # no --model: nothing pinned, the arguments are still seen

    sys.argv = [str(main_py), *argv[cut + 1 :]]
    runpy.run_path(str(main_py), run_name="__main__")
    result = {"threads": torch.get_num_threads(), **read_results(parsed["args"])}
    print(f"PARITY-RESULT {json.dumps(result)}", flush=True)
    if ns.result:
        Path(ns.result).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
