"""FedFree: layer-wise alignment with Gaussian pseudo-data and Knowledge Gain Entropy.

Du et al., "FedFree: Breaking Knowledge-sharing Barriers through Layer-wise Alignment in Heterogeneous
Federated Learning", NeurIPS 2025. Decisions: docs/methods/fedfree.md.

Per round (Alg. 1), every selected client (stateful, personalised model):
1. trains locally (CE), then scores every Conv2d/Linear layer by its relative squared change
   ``||θ_t - θ_{t-1}||² / (||θ_{t-1}||² + ε)`` (Eq. 2, weight and bias concatenated) and uploads the
   raw post-training weights of the top-k layers as one ``layer`` message (names are the client's own
   parameter names; meta says which layer of which architecture, its type, shape, geometry, score);
2. the server maps each uploaded layer to one same-type layer g_j of its global model (nearest
   relative depth by default) and, for every g_j with uploads S_j, takes ``server_steps`` gradient
   steps of ``mean_{S_j} ||g_j(X) - θ(X)||²`` on fresh X ~ N(0, I) (Eqs. 3-5); or, for the
   ``server_update="average"`` ablation, averages the uploaded layers into g_j directly;
3. the server computes KGE = H(g_j) - H(θ_{i,l}) from 256-bin weight histograms (Eq. 6) and sends each
   client at most one global layer, the argmax pair with KGE > 0 (``layer`` message down);
4. the client overwrites its chosen layer with a flat copy of it (Eq. 7): the first d_min entries from
   the global layer, the rest kept (``fill="keep"``) or zeroed (``fill="zero"``, Eq. 7 literally).

Clients keep their natural classifier (no representation mapping: FedFree exchanges no
representations), so ``--rep-dim``/``--mapping`` do not apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext, ModelRequest, load_module_tensors, module_tensors
from privfl.kinds import apply_layer_download
from privfl.seeding import seed_global, torch_generator

EPS = 1e-12
LAYER_TYPES = {nn.Conv2d: "conv", nn.Linear: "fc"}


# ---------------------------------------------------------------------------------------------- options
@dataclass
class FedFreeOptions:
    k: int = opt(2, "critical layers each client uploads per round (paper: 2)", min=1)
    selection: str = opt("topk", "topk: largest relative change (Eq. 2); random: the Fig. 4(a) ablation", choices=("topk", "random"))
    server_update: str = opt(
        "align",
        "align: Eq. 3-5 on Gaussian pseudo-data; average: plain averaging of the mapped uploads (Fig. 4(b) ablation)",
        choices=("align", "average"),
    )
    server_lr: float = opt(0.01, "server learning rate alpha of Eqs. 4-5", min=0)
    server_steps: int = opt(1, "server gradient steps per global layer per round (paper: 1)", min=0)
    pseudo_batch: int = opt(64, "pseudo-data samples B per step (paper: unspecified)", min=1)
    average_rate: float = opt(
        1.0,
        "average: g <- (1-r) g + r mean(uploads); 1 replaces g by the mean, 2*server_lr is what align does in expectation",
        min_exclusive=0,
        max=1,
    )
    match: str = opt(
        "depth",
        "layer matching: depth (same type, nearest overall relative depth), type_depth "
        "(nearest depth among layers of the type), index (same position and type)",
        choices=("depth", "type_depth", "index"),
    )
    mismatch: str = opt(
        "overlap", "server-side shape mismatch: overlap (shared channels, centred kernel) or flat (Eq. 7 copy)", choices=("overlap", "flat")
    )
    kge_candidates: str = opt("mapped", "KGE pairs: mapped (the layer each upload was mapped to) or same_type (any)", choices=("mapped", "same_type"))
    fill: str = opt("keep", "client overwrite beyond the copied entries: keep local values, or zero (Eq. 7)", choices=("keep", "zero"))
    kge_bins: int = opt(256, "histogram bins of the KGE entropy (paper: 256)", min=2)
    global_arch: str = opt("fedfree-cnn", "architecture of the server's global model (paper: its 5-layer CNN)")


# ---------------------------------------------------------------------------------------------- layers
@dataclass(frozen=True)
class LayerInfo:
    """One candidate layer (Conv2d or Linear) of a model, in definition order."""

    name: str
    module: nn.Conv2d | nn.Linear
    type: str  # "conv" | "fc"
    position: int
    count: int  # candidate layers in the model
    type_position: int
    type_count: int

    @property
    def depth(self) -> float:
        return self.position / max(self.count - 1, 1)

    @property
    def type_depth(self) -> float:
        return self.type_position / max(self.type_count - 1, 1)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{self.name}.weight": self.module.weight.detach()}
        if self.module.bias is not None:
            out[f"{self.name}.bias"] = self.module.bias.detach()
        return out

    def geometry(self) -> dict[str, Any]:
        m = cast(nn.Conv2d, self.module)  # read only when type == "conv"
        if self.type == "conv":
            return {
                "stride": list(m.stride),
                "padding": list(m.padding) if not isinstance(m.padding, str) else m.padding,
                "dilation": list(m.dilation),
                "groups": m.groups,
            }
        return {}


def candidate_layers(model: nn.Module) -> list[LayerInfo]:
    """Every Conv2d and Linear, in module definition order (BatchNorm excluded: the global CNN has none,
    so it could never be matched)."""
    found = [(n, m, LAYER_TYPES[type(m)]) for n, m in model.named_modules() if type(m) in LAYER_TYPES]
    per_type: dict[str, int] = {}
    type_pos = []
    for _, _, t in found:
        type_pos.append(per_type.get(t, 0))
        per_type[t] = per_type.get(t, 0) + 1
    return [LayerInfo(n, m, t, i, len(found), tp, per_type[t]) for i, ((n, m, t), tp) in enumerate(zip(found, type_pos))]


def flat_params(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def change_score(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """Eq. 2: relative squared change of one layer (weight and bias concatenated); ε keeps a zero-filled
    layer finite."""
    b, a = flat_params(before), flat_params(after)
    return float((a - b).pow(2).sum() / (b.pow(2).sum() + EPS))


def entropy(weight: torch.Tensor, bins: int = 256) -> float:
    """Shannon entropy (bits) of the flattened weight in ``bins`` equal bins over its own [min, max]
    (torch.histc); a constant tensor has entropy 0."""
    w = weight.detach().reshape(-1).double().cpu()
    lo, hi = float(w.min()), float(w.max())
    if not hi > lo:
        return 0.0
    counts = torch.histc(w, bins=bins, min=lo, max=hi)
    p = counts[counts > 0] / w.numel()
    return float(-(p * torch.log2(p)).sum())


def kge(global_weight: torch.Tensor, local_weight: torch.Tensor, bins: int = 256) -> float:
    """Eq. 6: Knowledge Gain Entropy H(g_j) - H(θ_{i,l})."""
    return entropy(global_weight, bins) - entropy(local_weight, bins)


def match_layer(depth: float, type_depth: float, position: int, typ: str, globals_: list[LayerInfo], rule: str) -> LayerInfo | None:
    """The global layer an uploaded layer is aggregated into (None: no same-type layer / no index match).
    Ties go to the earlier global layer."""
    same = [g for g in globals_ if g.type == typ]
    if not same:
        return None
    if rule == "index":
        return next((g for g in same if g.position == position), None)
    if rule == "type_depth":
        return min(same, key=lambda g: (abs(g.type_depth - type_depth), g.position))
    return min(same, key=lambda g: (abs(g.depth - depth), g.position))


def densify(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped (e.g. depthwise) conv kernel as the equivalent dense, block-diagonal kernel."""
    if groups == 1:
        return weight
    out_c, in_per, kh, kw = weight.shape
    dense = weight.new_zeros(out_c, in_per * groups, kh, kw)
    per_out = out_c // groups
    for g in range(groups):
        dense[g * per_out : (g + 1) * per_out, g * in_per : (g + 1) * in_per] = weight[g * per_out : (g + 1) * per_out]
    return dense


def _centre(n_src: int, n_dst: int) -> tuple[slice, slice]:
    """(source slice, destination slice) of a centre-aligned crop or zero-pad from n_src to n_dst."""
    if n_src >= n_dst:
        o = (n_src - n_dst) // 2
        return slice(o, o + n_dst), slice(0, n_dst)
    o = (n_dst - n_src) // 2
    return slice(0, n_src), slice(o, o + n_src)


def project_to(
    weight: torch.Tensor, bias: torch.Tensor | None, groups: int, g_weight: torch.Tensor, g_bias: torch.Tensor | None, mode: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A client layer in the global layer's shape, for the server's Eq. 3 and for averaging.

    Returns (weight', bias', weight coverage mask, bias coverage mask, output mask): what the client
    layer defines in the global shape. ``overlap``: the shared output/input channels (features) and the
    centre-aligned kernel overlap, zero elsewhere (equivalent to zeroing the pseudo-data channels the
    client layer does not have); the loss counts the shared outputs only. ``flat``: Eq. 7's copy of
    the first d_min flattened entries, all outputs counted.
    """
    w = densify(weight, groups) if weight.dim() == 4 else weight
    w_out = torch.zeros_like(g_weight)
    w_mask = torch.zeros_like(g_weight, dtype=torch.bool)
    b_out = torch.zeros_like(g_bias) if g_bias is not None else None
    b_mask = torch.zeros_like(g_bias, dtype=torch.bool) if g_bias is not None else None
    out_mask = torch.zeros(g_weight.shape[0], dtype=torch.bool, device=g_weight.device)
    if mode == "flat":
        d = min(w.numel(), g_weight.numel())
        w_out.view(-1)[:d] = w.reshape(-1)[:d]
        w_mask.view(-1)[:d] = True
        if g_bias is not None and bias is not None:
            assert b_out is not None and b_mask is not None  # made when g_bias is not None
            db = min(bias.numel(), g_bias.numel())
            b_out[:db], b_mask[:db] = bias[:db], True
        out_mask[:] = True
        return w_out, b_out, w_mask, b_mask, out_mask
    o, i = min(w.shape[0], g_weight.shape[0]), min(w.shape[1], g_weight.shape[1])
    if w.dim() == 4:
        (sh, dh), (sw, dw) = _centre(w.shape[2], g_weight.shape[2]), _centre(w.shape[3], g_weight.shape[3])
        w_out[:o, :i, dh, dw] = w[:o, :i, sh, sw]
        w_mask[:o, :i, dh, dw] = True
    else:
        w_out[:o, :i] = w[:o, :i]
        w_mask[:o, :i] = True
    if g_bias is not None and bias is not None:
        assert b_out is not None and b_mask is not None  # made when g_bias is not None
        b_out[:o], b_mask[:o] = bias[:o], True
    out_mask[:o] = True
    return w_out, b_out, w_mask, b_mask, out_mask


#: Eq. 7 on one tensor: the first d_min flattened entries from ``incoming``; the rest kept or zeroed
#: (the ``layer`` kind's declared download semantics, shared with the attacker's replay)
overwrite = apply_layer_download


def layer_forward(layer: LayerInfo, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The global layer's own operation with the given parameters (its stride, padding, dilation)."""
    m = cast(nn.Conv2d, layer.module)  # read only when type == "conv"
    if layer.type == "conv":
        return F.conv2d(x, weight, bias, m.stride, m.padding, m.dilation, m.groups)
    return F.linear(x, weight, bias)


def alignment_loss(
    layer: LayerInfo,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
) -> torch.Tensor:
    """Eq. 3: mean over the mapped uploads of ||g(X) - θ(X)||², summed over the (shared) output
    channels and averaged over batch and spatial positions, so a step moves g by about 2α towards the
    uploads for conv and linear layers alike (docs/methods/fedfree.md)."""
    y_g = layer_forward(layer, x, weight, bias)
    total = y_g.new_zeros(())
    for w_c, b_c, out_mask in targets:
        diff = (y_g - layer_forward(layer, x, w_c, b_c))[:, out_mask]
        per_pos = diff.pow(2).sum(1)  # (B,) or (B, H, W)
        total = total + per_pos.mean()
    return total / len(targets)


def align_layer(
    layer: LayerInfo,
    targets: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
    input_shape: tuple[int, ...],
    lr: float,
    steps: int,
    batch: int,
    generators: list[torch.Generator],
) -> list[float]:
    """Eqs. 3-5 in place on ``layer``: ``steps`` plain gradient steps of :func:`alignment_loss`, each on
    fresh pseudo-data X ~ N(0, I) of shape (batch, *input_shape) shared by every target. Returns the losses."""
    weight = layer.module.weight.detach().clone().requires_grad_(True)
    bias = layer.module.bias.detach().clone().requires_grad_(True) if layer.module.bias is not None else None
    params = [weight] + ([bias] if bias is not None else [])
    losses = []
    for step in range(steps):
        x = torch.randn((batch, *input_shape), generator=generators[step]).to(weight.device)
        loss = alignment_loss(layer, x, weight, bias, targets)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, gr in zip(params, grads):
                p -= lr * gr
        losses.append(float(loss.detach()))
    with torch.no_grad():
        layer.module.weight.copy_(weight)
        if bias is not None:
            cast(torch.Tensor, layer.module.bias).copy_(bias)  # bias exists iff the layer has one
    return losses


def rank_top_k(scores: list[float], k: int) -> list[int]:
    """Indices of the k largest scores, largest first; ties go to the earlier layer."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: min(k, len(scores))]


# ---------------------------------------------------------------------------------------------- method
@METHODS.register("fedfree")
class FedFree(FLMethod):
    """Clients upload their k most-changed layers; the server aligns its global layers to them on
    Gaussian pseudo-data and sends each client at most one global layer chosen by KGE."""

    parallel_clients = True
    name = "fedfree"
    sends = {"layer": "up/down"}
    exposes = ()
    Options = FedFreeOptions
    paper = "Du et al., FedFree, NeurIPS 2025"
    #: an uploaded layer's start-of-round value is known to the server only from the client's own
    #: upload of it and the download it applied in the round before (``layer-replay``); the tensors
    #: carry the client model's own parameter names, so the attacker differentiates the whole model,
    #: other layers at the latest value it saw of them (else random init)
    leakage = {
        "layer": LeakageContext(
            previous="layer", previous_rule="layer-replay", note="layers the message does not carry are stale or random in the attacker's model"
        )
    }

    # ------------------------------------------------------------------ models
    @classmethod
    def build_client_model(cls, req: ModelRequest) -> nn.Module:
        """The architecture with its natural classifier Linear(feature_dim, C): the mapping is the
        identity (AP at rep_dim = feature_dim), so the spec rebuilds with ``build_model(**spec)``."""
        from privfl.models import AvgPoolMapping, SplitModel
        from privfl.models.zoo import MODELS

        features, dim = MODELS.get(req.arch)(req.in_channels, req.image_size)
        spec = {
            "arch": req.arch,
            "in_channels": req.in_channels,
            "num_classes": req.num_classes,
            "image_size": req.image_size,
            "rep_dim": dim,
            "mapping": "ap",
        }
        return SplitModel(req.arch, features, dim, AvgPoolMapping(dim, dim), nn.Linear(dim, req.num_classes), spec)

    def __init__(self, env):
        super().__init__(env)
        o = self.opts
        if o.k < 1:
            raise ConfigError(f"fedfree: k must be >= 1, got {o.k}")
        if o.server_steps < 0 or o.pseudo_batch < 1 or o.kge_bins < 2:
            raise ConfigError("fedfree: server_steps >= 0, pseudo_batch >= 1 and kge_bins >= 2 are required")
        if not (0 < o.average_rate <= 1) or not math.isfinite(o.server_lr) or o.server_lr < 0:
            raise ConfigError(f"fedfree: average_rate must be in (0, 1] and server_lr >= 0, got {o.average_rate}, {o.server_lr}")
        from privfl.models import build_model

        seed_global(self.cfg.seed, "init", "server-model")
        self.global_model = build_model(
            o.global_arch,
            in_channels=env.clients[0].model.spec["in_channels"],
            num_classes=env.num_classes,
            image_size=env.clients[0].model.spec["image_size"],
            rep_dim=self._feature_dim(o.global_arch),
            mapping="ap",
        ).to(env.device)
        self.global_layers = candidate_layers(self.global_model)
        self.input_shapes = self._input_shapes()

    def _feature_dim(self, arch: str) -> int:
        from privfl.models.zoo import MODELS

        spec = self.env.clients[0].model.spec
        with torch.random.fork_rng():
            return MODELS.get(arch)(spec["in_channels"], spec["image_size"])[1]

    @torch.no_grad()
    def _input_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per global layer, the shape of one input it sees in the global model (the pseudo-data shape)."""
        shapes: dict[str, tuple[int, ...]] = {}

        def record(name: str):
            def hook(module: nn.Module, args: tuple) -> None:
                shapes.setdefault(name, tuple(args[0].shape[1:]))

            return hook

        hooks = [g.module.register_forward_pre_hook(record(g.name)) for g in self.global_layers]
        spec = self.global_model.spec
        self.global_model.eval()
        self.global_model(torch.zeros(1, spec["in_channels"], spec["image_size"], spec["image_size"], device=self.env.device))
        for h in hooks:
            h.remove()
        return shapes

    # ------------------------------------------------------------------ client side
    def select_layers(self, rnd: int, client: Client, before: dict[str, list[torch.Tensor]]) -> list[tuple[LayerInfo, float]]:
        """Eq. 2 scores and the top-k (ties: definition order), or k at random for the ablation."""
        layers = candidate_layers(client.model)
        scored = [(layer, change_score(before[layer.name], list(layer.tensors().values()))) for layer in layers]
        k = min(self.opts.k, len(scored))
        if self.opts.selection == "random":
            pick = torch.randperm(len(scored), generator=torch_generator(self.cfg.seed, "fedfree-random-k", rnd, client.index))[:k]
            return [scored[int(i)] for i in sorted(pick.tolist())]
        return [scored[i] for i in rank_top_k([sc for _, sc in scored], k)]

    def upload(self, rnd: int, client: Client, chosen: list[tuple[LayerInfo, float]]) -> Message:
        """The chosen layers, with what the server needs to map them (position, type, geometry)."""
        tensors: dict[str, torch.Tensor] = {}
        layers_meta = []
        for rank, (layer, score) in enumerate(chosen):
            tensors.update(layer.tensors())
            layers_meta.append(
                {
                    "name": layer.name,
                    "type": layer.type,
                    "shape": list(layer.module.weight.shape),
                    "bias": layer.module.bias is not None,
                    "score": score,
                    "rank": rank,
                    "position": layer.position,
                    "count": layer.count,
                    "type_position": layer.type_position,
                    "type_count": layer.type_count,
                    "geometry": layer.geometry(),
                }
            )
        meta = {"arch": client.arch, "layers": layers_meta, "num_samples": len(client.train_idx), "lr": self.cfg.lr}
        return Message(rnd, client.name, "server", "layer", tensors, meta)

    def receive(self, client: Client, msg: Message) -> None:
        """Eq. 7: overwrite the target layer with a flat copy of the global one."""
        target = dict(client.model.named_modules())[msg.meta["target"]]
        g = msg.meta["global_layer"]
        with torch.no_grad():
            target.weight.copy_(overwrite(target.weight, msg.tensors[f"{g}.weight"], msg.meta["fill"]))
            if target.bias is not None:
                incoming = msg.tensors.get(f"{g}.bias")
                if incoming is not None:
                    target.bias.copy_(overwrite(target.bias, incoming, msg.meta["fill"]))
                elif msg.meta["fill"] == "zero":
                    target.bias.zero_()

    # ------------------------------------------------------------------ server side
    def map_upload(self, meta: dict[str, Any]) -> LayerInfo | None:
        depth = meta["position"] / max(meta["count"] - 1, 1)
        type_depth = meta["type_position"] / max(meta["type_count"] - 1, 1)
        return match_layer(depth, type_depth, meta["position"], meta["type"], self.global_layers, self.opts.match)

    def aggregate(self, rnd: int, received: list[Message]) -> tuple[dict[str, list[tuple[Message, dict]]], float]:
        """Local -> global: every global layer with mapped uploads is aligned (or averaged) to them."""
        groups: dict[str, list[tuple[Message, dict]]] = {}
        for msg in received:
            for lm in msg.meta["layers"]:
                g = self.map_upload(lm)
                if g is not None:
                    groups.setdefault(g.name, []).append((msg, lm))
        losses = []
        for j, g in enumerate(self.global_layers):
            if g.name not in groups:
                continue
            gw, gb = g.module.weight, g.module.bias
            projected = []
            for msg, lm in groups[g.name]:
                w = msg.tensors[f"{lm['name']}.weight"].to(gw.device, gw.dtype)
                b = msg.tensors.get(f"{lm['name']}.bias")
                b = b.to(gw.device, gw.dtype) if b is not None else None
                projected.append(
                    project_to(w, b, lm["geometry"].get("groups", 1), gw.detach(), gb.detach() if gb is not None else None, self.opts.mismatch)
                )
            if self.opts.server_update == "average":
                self._average(g, projected)
            else:
                losses.extend(self._align(rnd, j, g, projected))
        return groups, (sum(losses) / len(losses) if losses else 0.0)

    def _align(self, rnd: int, j: int, g: LayerInfo, projected: list) -> list[float]:
        """Eqs. 3-5 with pseudo-data seeded by (seed, round, global layer, step)."""
        gens = [torch_generator(self.cfg.seed, "fedfree-pseudo", rnd, j, step) for step in range(self.opts.server_steps)]
        return align_layer(
            g,
            [(w, b, out_mask) for w, b, _, _, out_mask in projected],
            self.input_shapes[g.name],
            self.opts.server_lr,
            self.opts.server_steps,
            self.opts.pseudo_batch,
            gens,
        )

    @torch.no_grad()
    def _average(self, g: LayerInfo, projected: list) -> None:
        """Ablation: each entry of g moves to the mean of the uploads that define it (rate ``average_rate``);
        entries no upload covers are unchanged."""
        r = self.opts.average_rate
        for param, idx_val, idx_mask in ((g.module.weight, 0, 2), (g.module.bias, 1, 3)):
            if param is None:
                continue
            total = torch.zeros_like(param)
            count = torch.zeros_like(param)
            for p in projected:
                if p[idx_val] is None:
                    continue
                total += p[idx_val] * p[idx_mask]
                count += p[idx_mask].to(param.dtype)
            covered = count > 0
            mean = total[covered] / count[covered]
            param[covered] = (1 - r) * param[covered] + r * mean

    def choose_downloads(self, received: list[Message], groups: dict[str, list[tuple[Message, dict]]]) -> dict[str, tuple[LayerInfo, str, float]]:
        """Global -> local (Eq. 6): per client the (global layer, local target) pair of largest KGE > 0."""
        bins = self.opts.kge_bins
        h_global = {g.name: entropy(g.module.weight, bins) for g in self.global_layers}
        by_name = {g.name: g for g in self.global_layers}
        mapped = {(id(msg), lm["name"]): g for g, items in groups.items() for msg, lm in items}
        out = {}
        for msg in received:
            best: tuple[float, LayerInfo, str] | None = None
            for lm in msg.meta["layers"]:
                h_local = entropy(msg.tensors[f"{lm['name']}.weight"], bins)
                if self.opts.kge_candidates == "mapped":
                    cands = [by_name[mapped[(id(msg), lm["name"])]]] if (id(msg), lm["name"]) in mapped else []
                else:
                    cands = [g for g in self.global_layers if g.type == lm["type"]]
                for g in cands:
                    gain = h_global[g.name] - h_local
                    if gain > 0 and (best is None or gain > best[0]):
                        best = (gain, g, lm["name"])
            if best is not None:
                out[msg.sender] = (best[1], best[2], best[0])
        return out

    # ------------------------------------------------------------------ the round, in roles
    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: local training, then its k most-changed layers (Eq. 2) up."""
        layers = candidate_layers(client.model)
        before = {layer.name: [t.clone() for t in layer.tensors().values()] for layer in layers}
        loss = self.local_train(rnd, client)
        msg = self.upload(rnd, client, self.select_layers(rnd, client, before))
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: align the global layers to the uploads, then at most one global layer down to each
        client that uploaded (Eq. 6), which it writes into its model (:meth:`receive`, Eq. 7)."""
        groups, server_loss = self.aggregate(rnd, uploads)
        downloads = self.choose_downloads(uploads, groups)
        gains = []
        for sender, (g, target, gain) in downloads.items():
            tensors = {f"{g.name}.weight": g.module.weight.detach()}
            if g.module.bias is not None:
                tensors[f"{g.name}.bias"] = g.module.bias.detach()
            upload = next(m for m in uploads if m.sender == sender)
            local = next(lm for lm in upload.meta["layers"] if lm["name"] == target)
            meta = {
                "arch": upload.meta["arch"],
                "global_arch": self.opts.global_arch,
                "global_layer": g.name,
                "type": g.type,
                "shape": list(g.module.weight.shape),
                "target": target,
                "target_shape": local["shape"],
                "target_bias": local["bias"],
                "kge": gain,
                "fill": self.opts.fill,
            }
            self.deliver({sender: self.send(Message(rnd, "server", sender, "layer", tensors, meta))})
            gains.append(gain)
        return {"server_loss": server_loss, "downloads": float(len(downloads)), "mean_kge": sum(gains) / len(gains) if gains else 0.0}

    # ------------------------------------------------------------------ state
    def server_state(self) -> dict[str, torch.Tensor]:
        return {f"global.{k}": v for k, v in module_tensors(self.global_model).items()}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        load_module_tensors(self.global_model, {k.removeprefix("global."): v for k, v in state.items() if k.startswith("global.")})


__all__ = [
    "FedFree",
    "FedFreeOptions",
    "LayerInfo",
    "align_layer",
    "alignment_loss",
    "candidate_layers",
    "change_score",
    "entropy",
    "kge",
    "match_layer",
    "overwrite",
    "project_to",
    "rank_top_k",
]
