"""A parameter-like message's context, rebuilt from declared data: its previous state and its module.

A method declares per kind a :class:`privfl.methods.LeakageContext` (which received kind was the
previous state, which submodule of the client model the tensors belong to, how that submodule maps
images to class scores). This module turns the declaration into what gradient leakage differentiates:

- :func:`previous_state`: the state the message was computed from, by the declared rule
  (``last-received``; ``layer-replay`` for single layers that downloads overwrite, FedFree);
- :func:`leakage_module`: the module, built from the client model's *architecture* (the attacker
  knows it, not its weights), wrapped so that its parameter names are the message's tensor names.

Nothing here runs the method's training code.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from attacks.base import AttackNotApplicable
from privfl.kinds import apply_layer_download
from privfl.methods import LeakageContext
from privfl.run import AttackerView
from privfl.seeding import derive_seed


def context_of(view: AttackerView, kind: str) -> LeakageContext:
    ctx = view.leakage_context(kind)
    if ctx is None:
        raise AttackNotApplicable(f"{view.info['method']} declares no leakage context for {kind!r} (not parameter-like)")
    return ctx


# ------------------------------------------------------------------------------------------ previous state
def previous_state(view: AttackerView, record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the message that fixes the previous state, the previous tensors by message tensor name)."""
    ctx = context_of(view, record["kind"])
    if ctx.previous_rule == "layer-replay":
        return _layer_replay(view, record, ctx)
    return _last_received(view, record, ctx)


def previous_record(view: AttackerView, record: dict[str, Any]) -> dict[str, Any] | None:
    """The index record :func:`previous_state` would load, without loading anything (planning)."""
    ctx = context_of(view, record["kind"])
    if ctx.previous_rule == "layer-replay":
        rnd, client = record["round"], record["sender"]
        earlier = [
            r for r in view.messages(ctx.previous) if r["seq"] < record["seq"] and r["round"] == rnd - 1 and client in (r["sender"], r["receiver"])
        ]
        return earlier[-1] if earlier else None
    found = _received(view, record, ctx)
    return found[-1] if found else None


def _received(view: AttackerView, record: dict[str, Any], ctx: LeakageContext) -> list[dict[str, Any]]:
    client = record["sender"]
    want = record.get("meta", {}).get("previous_round")
    return [
        r
        for r in view.records()
        if r["kind"] == ctx.previous and r["receiver"] == client and r["seq"] < record["seq"] and (want is None or r["round"] == want)
    ]


def _last_received(view: AttackerView, record: dict[str, Any], ctx: LeakageContext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The last ``previous`` message the sender received before sending; a message whose meta names
    ``previous_round`` (a ring node may already hold the next round's Learngene) takes that round's."""
    earlier = _received(view, record, ctx)
    if not earlier:
        raise AttackNotApplicable(
            f"no {ctx.previous} was sent to {record['sender']} before message {record['seq']}: no previous state to attack from"
        )
    return earlier[-1], view.load(earlier[-1])


def _layer_replay(view: AttackerView, record: dict[str, Any], ctx: LeakageContext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What an honest-but-curious server knows of an uploaded layer's value before the round.

    It is known exactly when the client uploaded the same layer in round t-1 (an upload is the
    post-training value) and the server then either did not overwrite it or overwrote it in a way the
    server can replay (the ``layer`` download semantics with its own download), or when the round t-1
    download replaced every entry of it. Otherwise that layer is left out. Every other layer of the
    client model is filled with the latest value the server saw of it (a stale surrogate), else left at
    its random initialisation.
    """
    if record["receiver"] != "server":
        raise AttackNotApplicable(f"{record['kind']}: gradient leakage applies to uploaded layers, not message {record['seq']}")
    client, rnd = record["sender"], record["round"]
    msgs = [r for r in view.messages(ctx.previous) if r["seq"] < record["seq"] and client in (r["sender"], r["receiver"])]
    state: dict[str, torch.Tensor] = {}
    for r in msgs:  # stale surrogate, in order: later uploads and replayed downloads win
        tensors = view.load(r)
        if r["sender"] == client:
            state.update(tensors)
        else:
            state.update(replay_download(r["meta"], tensors, state))
    ups_prev = [r for r in msgs if r["round"] == rnd - 1 and r["sender"] == client]
    down_prev = [r for r in msgs if r["round"] == rnd - 1 and r["receiver"] == client]
    uploaded_prev = {k: v for r in ups_prev for k, v in view.load(r).items()}
    replayed = replay_download(down_prev[0]["meta"], view.load(down_prev[0]), uploaded_prev) if down_prev else {}
    prev: dict[str, torch.Tensor] = {}
    unknown = []
    layers = record["meta"]["layers"]
    for lm in layers:
        names = [f"{lm['name']}.weight"] + ([f"{lm['name']}.bias"] if lm["bias"] else [])
        known = {n: replayed.get(n, uploaded_prev.get(n)) for n in names}
        if all(v is not None for v in known.values()):
            prev.update(cast(dict[str, torch.Tensor], known))
        else:
            unknown.append(lm["name"])
    if not prev:
        raise AttackNotApplicable(
            f"the server does not know the start-of-round state of {client}'s uploaded layers {', '.join(unknown)} in round {rnd} "
            f"(not uploaded, nor fully sent to it, in round {rnd - 1}); no update to invert, try a later round"
        )
    sent = {lm["name"] for lm in layers}
    surrogate = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] not in sent}
    base = down_prev[-1] if down_prev else ups_prev[-1]
    return base, {**surrogate, **prev}


def replay_download(meta: dict[str, Any], tensors: dict[str, torch.Tensor], local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The receiver's target layer after a ``layer`` download, as far as the sender can compute it: from
    ``local`` (what it knows of the layer before the overwrite), or without it when the download fixes
    every entry (``fill="zero"``, or at least as many entries as the layer has)."""
    g, target, fill = meta["global_layer"], meta["target"], meta["fill"]
    shapes = {"weight": meta["target_shape"], "bias": [meta["target_shape"][0]] if meta["target_bias"] else None}
    out = {}
    for part, shape in shapes.items():
        if shape is None:
            continue
        name, incoming = f"{target}.{part}", tensors.get(f"{g}.{part}")
        before = local.get(name)
        complete = fill == "zero" or (incoming is not None and incoming.numel() >= math.prod(shape))
        if before is None and not complete:
            continue
        before = before if before is not None else torch.zeros(shape)
        if incoming is None:
            out[name] = torch.zeros_like(before) if fill == "zero" else before
        else:
            out[name] = apply_layer_download(before, incoming, fill)
    return out


# ------------------------------------------------------------------------------------------ the module
class LeakageModule(nn.Module):
    """Images -> class scores through the declared submodule, named like the message's tensors.

    ``body`` is the client-model submodule; a message tensor ``prefix + name`` is its parameter
    ``body.name`` (:meth:`to_module_names`). ``output`` picks one element of a tuple output; a ``probe``
    readout appends the attacker's own randomly initialised classifier (``probe.*``)."""

    def __init__(self, body: nn.Module, ctx: LeakageContext, num_classes: int, example: torch.Tensor):
        super().__init__()
        self.body, self.prefix, self.output = body, ctx.prefix, ctx.output
        self.probe: nn.Module | None = None
        if ctx.readout == "probe":
            body.eval()  # a shape probe must not move normalisation statistics
            with torch.no_grad():
                width = self._features(example).shape[1]
            self.probe = nn.Sequential(nn.Linear(width, ctx.probe_hidden), nn.ReLU(), nn.Linear(ctx.probe_hidden, num_classes))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.output is not None:
            out = out[self.output]
        return out.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self._features(x)
        return self.probe(feats) if self.probe is not None else feats

    def to_module_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Message tensors (with the declared prefix) under this module's parameter/buffer names."""
        p = self.prefix
        return {f"body.{k[len(p) :]}": v for k, v in tensors.items() if k.startswith(p)}

    def message_names(self, names: list[str]) -> list[str]:
        """This module's names that a message would carry (the body's, with the prefix)."""
        return [self.prefix + n.removeprefix("body.") for n in names if n.startswith("body.")]


def leakage_module(view: AttackerView, record: dict[str, Any], seed: int = 0) -> LeakageModule:
    """The module a ``record`` message's tensors parameterise, freshly built (random weights, seeded),
    eval mode. Load the previous state into it before attacking."""
    ctx = context_of(view, record["kind"])
    client = record["sender"]
    req = view.model_request(client)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "leakage-module", int(record["seq"])))
        model = view.method_cls.build_client_model(req)
        try:
            body = model.get_submodule(ctx.module) if ctx.module else model
        except AttributeError:
            raise AttackNotApplicable(
                f"{view.info['method']} declares module {ctx.module!r} for {record['kind']}, which its "
                f"client model {type(model).__name__} does not have"
            ) from None
        ds = view.dataset
        example = torch.zeros(2, ds["channels"], ds["image_size"], ds["image_size"])
        return LeakageModule(body, ctx, int(ds["num_classes"]), example).eval()


def trained_module(view: AttackerView, record: dict[str, Any], seed: int = 0) -> tuple[LeakageModule, dict[str, Any]]:
    """The sender's declared module *after* its local training, as the attacker rebuilds it: full
    parameters as sent, or an update ``d = (previous - new) / a`` applied to the previous state. A
    gradient carries no trained model (AttackNotApplicable). Returns the module (eval mode) and what is
    known of it: ``coverage``, the share of the body's parameters the message or the previous state
    fixes (the rest stay at the attacker's random initialisation: a result on such a module is a guess
    and is reported as one), the ``unknown`` names, and the ``readout`` (a ``probe`` readout is the
    attacker's own random classifier, so the module's class scores are not the client's)."""
    from privfl.kinds import KINDS, ParamForm

    form = KINDS.get(record["kind"]).form
    if form is ParamForm.GRADIENT:
        raise AttackNotApplicable(f"a {record['kind']} message is one batch's gradient at the state the sender received: it carries no trained model")
    _, prev = previous_state(view, record)
    tensors = view.load(record)
    if form is ParamForm.UPDATE:
        a = float(record.get("meta", {}).get("a", 1.0))
        state = dict(prev)
        for k, v in tensors.items():
            if v.is_floating_point() and k in prev:
                state[k] = prev[k].to(v.dtype) - a * v
            elif not v.is_floating_point():
                state[k] = v  # integer buffers travel as they are (FedNova's counters)
    else:
        state = {**prev, **tensors}
    module = leakage_module(view, record, seed)
    own = module.state_dict()
    mapped = {k: v for k, v in module.to_module_names(state).items() if k in own}
    module.load_state_dict(mapped, strict=False)
    body = [n for n, _ in module.named_parameters() if n.startswith("body.")]
    unknown = [n.removeprefix("body.") for n in body if n not in mapped]
    ctx = context_of(view, record["kind"])
    return module.eval(), {"coverage": 1 - len(unknown) / max(len(body), 1), "unknown": unknown, "readout": ctx.readout}


def module_tensor_names(view: AttackerView, record: dict[str, Any]) -> set[str]:
    """The message-side names of the declared module's state (parameters and buffers), for planning."""
    module = leakage_module(view, record)
    return set(module.message_names(list(module.state_dict())))


__all__ = [
    "LeakageModule",
    "context_of",
    "leakage_module",
    "module_tensor_names",
    "previous_record",
    "previous_state",
    "replay_download",
    "trained_module",
]
