"""A trained run's client models and client data, rebuilt from the run directory alone.

Analysis needs the models as they ended training, so it reads ``checkpoint/`` (the latest round:
``clientK.<param>`` keys), rebuilds each client's module with its method's own
:meth:`FLMethod.build_client_model` (so a method with its own model structure, built-in or a user's
``pkg.mod:Class``, works unchanged) and the client's train/test images from ``truth/partition``.
Nothing here is special to one method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from privfl.errors import CaptureError, ConfigError, UnknownNameError
from privfl.runfiles import load_checkpoint_state, load_pool, read_checkpoint

if TYPE_CHECKING:
    from privfl.fl.method import FLMethod

Predictor = Callable[[torch.Tensor], torch.Tensor]


def parse_client_ids(text: str | None, num_clients: int) -> list[int] | None:
    """``0,3`` or ``client0,client3`` -> [0, 3]; None when not given. Checks the range."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("client")
        if not part.isdigit():
            raise ConfigError(f"--clients takes ids like 0,3 or client0,client3; got {text!r}")
        k = int(part)
        if k >= num_clients:
            raise ConfigError(f"client {k} does not exist; the run has clients 0..{num_clients - 1}")
        out.append(k)
    return list(dict.fromkeys(out))


def resolve_class(text: str, class_names: list[str]) -> int:
    """A class given by name (case-insensitive) or index -> its index."""
    lowered = [c.lower() for c in class_names]
    if text.strip().lower() in lowered:
        return lowered.index(text.strip().lower())
    if text.strip().isdigit() and int(text) < len(class_names):
        return int(text)
    raise UnknownNameError("class", text, [*class_names, f"0..{len(class_names) - 1}"])


@dataclass
class ClientData:
    """One client's images of one split: model inputs, [0,1] images for display, labels, dataset ids."""

    x: torch.Tensor  # (n, C, H, W) normalised model input
    images: torch.Tensor  # (n, C, H, W) in [0, 1]
    labels: torch.Tensor  # (n,)
    ids: torch.Tensor  # (n,) indices into the run's (subsampled) pool


@dataclass
class RunModels:
    """A run opened for analysis (a view of :class:`privfl.Run`): config, method class, dataset pool,
    client split, checkpointed models. Built by ``Run.models()`` (or ``RunModels(run)`` on an opened run)."""

    run: Any  # a privfl.run.Run (this module sits below privfl.run, which builds it: no import of it here)
    data_root: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if not hasattr(self.run, "method_cls"):
            raise TypeError(f"RunModels needs an opened run (privfl.Run.open(path).models()), got {type(self.run).__name__}")
        self.run_dir = self.run.path
        self.config: dict[str, Any] = self.run.config
        self.info: dict[str, Any] = self.run.info
        if not self.info:
            raise CaptureError(f"{self.run_dir} cannot be analysed: run.json is missing")
        pointer = read_checkpoint(self.run_dir)
        if pointer is None:
            raise CaptureError(
                f"{self.run_dir} cannot be analysed: checkpoint/checkpoint.json is missing (a run that finished at least one round has it)"
            )
        self._pointer = pointer
        self.round: int = pointer["round"]
        self._ckpt_path = self.run_dir / "checkpoint" / pointer["file"]
        self._models: dict[int, nn.Module] = {}

    # ------------------------------------------------------------------ what the run is
    @property
    def method(self) -> str:
        return str(self.info.get("method", self.run.method))

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def num_clients(self) -> int:
        return self.run.num_clients

    @property
    def class_names(self) -> list[str]:
        names = self.run.dataset.get("class_names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CaptureError(f"{self.run_dir}/run.json: the dataset's class_names are not a list of names")
        return list(names)

    @property
    def method_cls(self) -> type[FLMethod]:
        return self.run.method_cls

    @property
    def cfg(self) -> Any:
        return self.run.cfg

    def model_request(self, k: int) -> Any:
        return self.run.model_request(k)

    # ------------------------------------------------------------------ models
    @cached_property
    def _state(self) -> dict[str, torch.Tensor]:
        return load_checkpoint_state(self.run_dir, self._pointer)

    def model(self, k: int) -> nn.Module:
        """Client ``k``'s model with its final checkpointed weights, eval mode, on ``self.device``.

        Built under the engine's init seed so that anything random a model keeps outside its
        state dict is the same as in training.
        """
        if k not in self._models:
            from privfl.seeding import seed_global

            seed_global(self.cfg.seed, "init", k)
            model = self.method_cls.build_client_model(self.model_request(k))
            prefix = f"client{k}."
            state = {key[len(prefix) :]: v for key, v in self._state.items() if key.startswith(prefix)}
            if not state:
                raise CaptureError(f"checkpoint {self._ckpt_path.name} holds no weights of client{k}")
            try:
                model.load_state_dict(state, strict=True)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()
                raise CaptureError(
                    f"checkpoint weights of client{k} do not fit its rebuilt {self.info['archs'][k]} model: {' '.join(s.strip() for s in first[:3])}"
                ) from None
            self._models[k] = model.to(self.device).eval()
        return self._models[k]

    def predictor(self, k: int, target: str = "auto") -> tuple[Predictor, str]:
        """A function images -> class scores for client ``k``, and a note on what it is.

        ``model``: the module's own forward. ``predict``: the method's ``predict`` (e.g. FedProto's
        nearest-prototype scores), which is only possible when it needs nothing but the client's
        model; the method object is not re-created (that would need the engine), so ``predict`` is
        called on a bare instance holding only the run's config. ``auto``: ``predict`` when that
        works, else ``model``.
        """
        from privfl.methods import Client, FLMethod

        if target not in ("auto", "model", "predict"):
            raise UnknownNameError("--target", target, ["auto", "model", "predict"])
        model = self.model(k)
        num_classes = int(self.info["dataset"]["num_classes"])
        probe = self.probe_input()

        def check(out: Any, what: str) -> None:
            if not (isinstance(out, torch.Tensor) and out.shape == (probe.shape[0], num_classes)):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ConfigError(
                    f"{what} of client{k} ({self.method}) gives {got}, not class scores (batch, {num_classes}); "
                    f"use --target {'model' if what.startswith('predict') else 'predict'}"
                )

        def forward(x: torch.Tensor) -> torch.Tensor:
            return model(x)

        if target != "model" and self.method_cls.predict is not FLMethod.predict:
            shell = object.__new__(self.method_cls)
            shell.cfg, shell.opts = self.cfg, self.method_cls.Options(**self.cfg.options)
            empty = torch.empty(0, dtype=torch.long)
            client = Client(k, self.info["archs"][k], model, empty, empty)
            try:
                with torch.no_grad():
                    out = shell.predict(client, probe)
            except (AttributeError, KeyError, NotImplementedError) as exc:
                if target == "predict":
                    raise ConfigError(
                        f"{self.method}.predict needs more than client{k}'s model ({type(exc).__name__}: {exc}); use --target model"
                    ) from None
            else:
                check(out, "predict")
                return (lambda x: shell.predict(client, x)), f"{self.method_cls.__name__}.predict (client model only)"
        with torch.no_grad():
            check(forward(probe), "model(x)")
        note = "model(x)"
        if self.method_cls.predict is not FLMethod.predict:
            note += f" ({self.method_cls.__name__}.predict needs the method's server-side state)"
        return forward, note

    # ------------------------------------------------------------------ data
    @cached_property
    def _loaded(self) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return load_pool(self.run, self.data_root)

    @property
    def dataset(self) -> Any:
        return self._loaded[0]

    @property
    def _pool(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(images uint8, labels, partition tensors) of the run's (possibly subsampled) sample pool."""
        return self._loaded[1], self._loaded[2], self._loaded[3]

    def client_ids(self, k: int, split: str) -> torch.Tensor:
        """Pool indices of client ``k``'s ``train`` or ``test`` samples."""
        key = f"{split}_{k}"
        part = self._pool[2]
        if key not in part:
            raise CaptureError(f"{self.run_dir}/truth/partition.safetensors has no {key}")
        return part[key].long()

    def labels_of(self, ids: torch.Tensor) -> torch.Tensor:
        return self._pool[1][ids]

    def client_data(self, ids: torch.Tensor) -> ClientData:
        images_u8 = self._pool[0][ids]
        x = self.dataset.normalize(images_u8).to(self.device)
        return ClientData(x, images_u8.float() / 255.0, self._pool[1][ids], ids)

    def probe_input(self, n: int = 2) -> torch.Tensor:
        """A small real batch (the first pool images) for finding module outputs and checking forwards."""
        return self.dataset.normalize(self._pool[0][:n]).to(self.device)


def sample_ids(ids: torch.Tensor, n: int | None, rng: np.random.Generator) -> torch.Tensor:
    """At most ``n`` of ``ids``, drawn without replacement by ``rng`` and kept in pool order."""
    if n is None or len(ids) <= n:
        return ids
    pick = np.sort(rng.choice(len(ids), n, replace=False))
    return ids[torch.from_numpy(pick)]


__all__ = ["ClientData", "Predictor", "RunModels", "parse_client_ids", "resolve_class", "sample_ids"]
