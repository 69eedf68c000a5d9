"""Run PFLlib's unchanged ``system/main.py`` in this process, as ``run_parity.py --reference pfllib``'s subprocess.

    PYTHONPATH=PFLLIB/system python experiments/parity/pfllib_launch.py --system PFLLIB/system \\
        [--threads 1] [--result FILE] -- MAIN.PY ARGS

Started by its path under PFLlib's Python (which need not have privfl), with ``system/`` first on
``PYTHONPATH`` (``run_parity.py`` puts it there; otherwise the launcher refuses with exit status 2).

``main.py`` is executed as ``__main__`` with ``runpy``, from PFLlib's own files (nothing of PFLlib is
copied or edited). What this adds around it:

* torch's thread count (``--threads``, default 1), before anything runs.
* **No model pinning.** PFLlib builds its model in ``run()`` from ``-m`` and the dataset *name*
  (``-m CNN`` with ``MNIST`` in the name is ``FedAvgCNN(in_features=1, dim=1024)``, with ``Cifar10``
  ``FedAvgCNN(3, dim=1600)``, otherwise the 64x64 one), so ``run_parity.py`` names the exported dataset
  accordingly and checks the result: before training, one line ``PARITY-MODEL {json}`` gives client 0's
  model as PFLlib built it (parameter names and shapes, read right after ``Client.__init__``, which
  draws nothing from any RNG here).
* ``main.py`` imports every server, among them FedPAC's, which needs ``cvxpy``. That one module, when it
  cannot be imported, is replaced by a stub that refuses to run (the parity table does not run FedPAC);
  every other import error still stops main.py.
* ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: some PFLlib methods ``torch.load`` the pickled items they
  saved a moment earlier (``save_item``/``load_item``), which torch >= 2.6 refuses unless told.
* After training, one line ``PARITY-RESULT {json}`` with the results file's ``rs_test_acc`` (h5py, which
  PFLlib needs anyway; the file name is HtFLlib's, so ``htfllib_launch.read_results`` reads it), also
  written to ``--result`` if given.

Run it with the data and results reachable from the working directory as ``../dataset/<NAME>`` and
``../results`` (``run_parity.py`` uses a scratch folder, so nothing is written into PFLlib's copy; PFLlib's
``save_global_model`` writes ``models/<NAME>/`` under the working directory).
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

HERE = Path(__file__).resolve().parent

#: server modules main.py imports that need packages beyond torch/numpy/sklearn/h5py/calmsize, and the
#: class each exports (FedPAC: cvxpy); the parity table runs none of them
OPTIONAL_SERVERS = {"flcore.servers.serverpac": "FedPAC"}


def _sibling(name: str) -> Any:
    """A module beside this file, loaded by its path (this launcher is run by path, not as a package module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stub_optional_servers() -> list[str]:
    """Import the optional server modules, or put a stub that refuses to run in their place; returns the
    stubbed names with the reason."""
    stubbed = []
    for name, cls_name in OPTIONAL_SERVERS.items():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            reason = f"{type(exc).__name__}: {exc}"

            def refuse(self: Any, *args: Any, _name: str = name, _cls: str = cls_name, _why: str = reason, **kwargs: Any) -> None:
                raise RuntimeError(f"{_name} could not be imported here ({_why}); the parity harness does not run {_cls}")

            module = types.ModuleType(name)
            setattr(module, cls_name, type(cls_name, (), {"__init__": refuse}))
            sys.modules[name] = module
            stubbed.append(f"{name} ({reason})")
    return stubbed


def describe(model: Any) -> dict[str, Any]:
    """A model's class (and its ``base``'s for PFLlib's ``BaseHeadSplit``), parameter names and shapes."""
    constructor = type(model).__name__
    if hasattr(model, "base") and hasattr(model, "head"):
        constructor += f"({type(model.base).__name__} + {type(model.head).__name__})"
    return {
        "constructor": constructor,
        "params": [[name, list(p.shape)] for name, p in model.named_parameters()],
        "modules": repr(model),
    }


def watch_clients(seen: dict[str, Any]) -> None:
    """Wrap PFLlib's ``Client.__init__`` so the first client built prints ``PARITY-MODEL`` and hands its
    ``args`` (the parsed namespace, for the results file's name) to ``seen``."""
    clientbase = importlib.import_module("flcore.clients.clientbase")
    original = clientbase.Client.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if "args" not in seen:
            seen["args"] = args[0] if args else kwargs["args"]
            print(f"PARITY-MODEL {json.dumps(describe(self.model))}", flush=True)

    clientbase.Client.__init__ = init


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("pfllib_launch.py: error: give main.py's arguments after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="pfllib_launch.py")
    p.add_argument("--system", required=True, help="PFLlib's system/ folder (holding main.py)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--result", help="also write the PARITY-RESULT JSON here")
    ns = p.parse_args(argv[:cut])
    system = Path(ns.system).resolve()
    main_py = system / "main.py"
    if not main_py.is_file():
        print(f"pfllib_launch.py: error: {main_py} does not exist (--system takes PFLlib's system/ folder)", file=sys.stderr)
        return 2

    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # see the module docstring
    import torch

    if not _sibling("htfllib_launch").importable_from(system):
        print(f"pfllib_launch.py: error: put {system} first on PYTHONPATH (main.py imports flcore and utils from there)", file=sys.stderr)
        return 2
    torch.set_num_threads(ns.threads)
    stubbed = stub_optional_servers()
    if stubbed:
        print(f"PARITY-STUBBED {json.dumps(stubbed)}", flush=True)
    seen: dict[str, Any] = {}
    watch_clients(seen)

    sys.argv = [str(main_py), *argv[cut + 1 :]]
    runpy.run_path(str(main_py), run_name="__main__")
    if "args" not in seen:
        print("pfllib_launch.py: error: main.py built no client", file=sys.stderr)
        return 1
    result = {"threads": torch.get_num_threads(), **_sibling("htfllib_launch").read_results(seen["args"])}
    print(f"PARITY-RESULT {json.dumps(result)}", flush=True)
    if ns.result:
        Path(ns.result).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
