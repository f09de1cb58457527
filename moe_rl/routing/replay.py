"""Record and replay sessions over a model: the routing contract shared by every backend.

A routing trace (moe_rl.routing.trace) holds, for every MoE layer in depth order, the expert ids each token was
sent to, laid out like the model input it was recorded on: `ids_LBSK` (L MoE layers, B sequences, S positions, K
experts), int16. Recording and replaying are sessions over a model, used as context managers:

    with record_routing(model) as rec:
        model(input_ids_BS, valid_BS)
    trace = rec.trace()

    with replay_routing(model, trace) as rep:    # every router uses trace's ids instead of its top-k
        model(input_ids_BS, valid_BS)

A session attaches itself to each MoE layer of one model for the duration of the block; nothing is global,
and a replay that does not fit the model fails at once, naming the layer, instead of falling back to native
routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_rl.errors import ConfigError, RoutingError
from moe_rl.model.moe import ReplayInputs, Router, topk_indices
from moe_rl.routing.churn import expert_overlap
from moe_rl.routing.trace import RoutingTrace, routing_sites, validate_trace


@dataclass
class ReplayConfig:
    """Variants of R2 and R3 replay (`routing_mode`); both off by default (ids replayed, weights from the router)."""

    gate_weights: bool = False
    """R3 only: replay the sampler's gate weights too, not only its expert ids. The experts then combine with the
    sampler's constant weights, so the routers get no gradient through their gate weights (only through the
    auxiliary losses)."""
    margin_threshold: float | None = None
    """R2 and R3: replay only the decisions whose router margin in this forward (the k-th minus the (k+1)-th router
    score) is below this value; the others route natively. None replays every decision. The share replayed is
    logged as routing/margin_replay/replayed_frac."""

    def __post_init__(self) -> None:
        if self.margin_threshold is not None and not self.margin_threshold > 0:
            raise ConfigError(f"replay.margin_threshold={self.margin_threshold!r} must be > 0 (or None: replay all)")

    @property
    def overrides(self) -> bool:
        return self.gate_weights or self.margin_threshold is not None


class RoutingSession:
    """Base session: attached to every MoE layer of one model inside a `with` block."""

    def __init__(self, model):
        self.sites = routing_sites(model)

    def __enter__(self):
        for layer, site in enumerate(self.sites):
            if site.routing_session is not None:
                self._detach()
                raise RoutingError(f"MoE layer {layer} already has an active routing session; sessions do not nest")
            site.routing_session = self
        return self

    def __exit__(self, *exc_info) -> None:
        self._detach()

    def _detach(self) -> None:
        for site in self.sites:
            if site.routing_session is self:
                site.routing_session = None

    def replay_inputs(self, layer: int, batch: int, seq_len: int) -> ReplayInputs | None:
        """What the router of MoE layer `layer` replays in this forward (None: its own choice)."""
        return None

    def observe(self, layer: int, routing, batch: int, seq_len: int) -> None:
        pass


class _ChunkRecorder:
    """Collects per-layer (B, s, K) chunks and stitches them along the sequence axis (prefill + decode)."""

    def __init__(self, n_layers: int):
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]

    def add(self, layer: int, ids_BSK: torch.Tensor) -> None:
        previous = self.chunks[layer]
        if previous and previous[0].shape[0] != ids_BSK.shape[0]:
            raise RoutingError(
                f"MoE layer {layer}: recorded forwards have batch {previous[0].shape[0]} and {ids_BSK.shape[0]};"
                " one recording session must see the same sequences in every call"
            )
        previous.append(ids_BSK)

    def stacked(self) -> torch.Tensor:
        """(L, B, S, ...): every layer's chunks joined along the sequence axis."""
        if not self.chunks[0]:
            raise RoutingError("nothing was recorded: run the model inside the session first")
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self.chunks])

    def trace(self) -> RoutingTrace:
        return RoutingTrace(self.stacked())


class RecordSession(RoutingSession):
    """Records the ids every router chose (native top-k, or the replayed ids inside a replay), and with
    `with_weights` their gate weights."""

    def __init__(self, model, with_entropy: bool = False, with_weights: bool = False):
        super().__init__(model)
        self._ids = _ChunkRecorder(len(self.sites))
        self._weights = _ChunkRecorder(len(self.sites)) if with_weights else None
        self._entropy: list[list[torch.Tensor]] | None = [[] for _ in self.sites] if with_entropy else None

    def observe(self, layer, routing, batch, seq_len):
        self._ids.add(layer, routing.ids_TK.detach().to(torch.int16).view(batch, seq_len, -1))
        if self._weights is not None:
            self._weights.add(layer, routing.weights_TK.detach().float().view(batch, seq_len, -1))
        if self._entropy is not None:
            p_TE = routing.scores_TE.detach()
            entropy_T = -(p_TE * p_TE.clamp_min(1e-30).log()).sum(-1)
            self._entropy[layer].append(entropy_T.view(batch, seq_len))

    def trace(self) -> RoutingTrace:
        ids = self._ids.trace()
        return ids if self._weights is None else RoutingTrace(ids.ids_LBSK, self._weights.stacked())

    def router_entropy_LBS(self) -> torch.Tensor:
        """Entropy of each token's router distribution, per layer; needs `with_entropy=True`."""
        if self._entropy is None:
            raise RoutingError("router entropy was not recorded: open the session with with_entropy=True")
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self._entropy])


class ReplaySession(RoutingSession):
    """Makes every router use the trace's ids; optionally records the native top-k it overrode.

    Each MoE layer asks `replay_inputs` for its router's replay arguments before the router runs
    (moe_rl.model.moe.ReplayInputs). With `options` (ReplayConfig):
    - `margin_threshold`: the router replays only the decisions whose margin in this forward is below the threshold
      and keeps its own top-k elsewhere; it gathers its weights at whichever ids it uses, so it keeps its gradient
      for every decision.
    - `gate_weights`: the router also uses the trace's gate weights (constants: they pass the router no gradient).
    """

    def __init__(self, model, trace: RoutingTrace, record_native: bool = False,
                 options: ReplayConfig | None = None, count_mask_BS: torch.Tensor | None = None):
        super().__init__(model)
        validate_trace(trace, self.sites)
        self.trace = trace
        self._native = _ChunkRecorder(len(self.sites)) if record_native else None
        self.options = options if options is not None and options.overrides else None
        if self.options is not None:
            check_overrides(self.options, trace, self.sites)
        self.count_mask_BS = count_mask_BS
        self._counts = torch.zeros(3, dtype=torch.float64)  # decisions counted, replayed, changed by the replay

    def replay_inputs(self, layer, batch, seq_len) -> ReplayInputs:
        ids_BSK = self.trace.ids_LBSK[layer]
        if ids_BSK.shape[:2] != (batch, seq_len):
            raise RoutingError(
                f"MoE layer {layer}: the replay trace covers {tuple(ids_BSK.shape[:2])} (batch, positions) "
                f"but this forward has ({batch}, {seq_len})"
            )
        ids_TK = ids_BSK.reshape(batch * seq_len, -1)
        if self.options is None:
            return ReplayInputs(ids_TK)
        weights_TK = self.trace.weights_LBSK[layer].reshape(ids_TK.shape) if self.options.gate_weights else None
        return ReplayInputs(ids_TK, weights_TK, self.options.margin_threshold)

    def observe(self, layer, routing, batch, seq_len):
        if self._native is not None:
            # A backend whose router does not rank by scores_TE (DeepSeek-V3's bias and groups) reports its choice.
            native_ids_TK = getattr(routing, "native_ids_TK", None)
            if native_ids_TK is None:
                native_ids_TK = topk_indices(routing.scores_TE.detach(), routing.ids_TK.shape[1])
            self._native.add(layer, native_ids_TK.to(torch.int16).view(batch, seq_len, -1))
        if getattr(routing, "replayed_T", None) is not None:
            K = routing.ids_TK.shape[1]
            replay_TK = self.trace.ids_LBSK[layer].reshape(routing.ids_TK.shape).long()
            changed_T = routing.replayed_T & (expert_overlap(replay_TK, routing.native_ids_TK) < K)
            self._count(routing.replayed_T, changed_T)

    def _count(self, replay_T, changed_T) -> None:
        mask_T = torch.ones_like(replay_T) if self.count_mask_BS is None else \
            self.count_mask_BS.reshape(-1).to(replay_T.device, torch.bool)
        self._counts += torch.tensor([mask_T.sum().item(), (replay_T & mask_T).sum().item(),
                                      (changed_T & mask_T).sum().item()], dtype=torch.float64)

    def margin_stats(self) -> dict[str, float]:
        """Margin replay: share of the counted decisions (token, layer) replayed, and share the replay changed."""
        total, replayed, changed = self._counts.tolist()
        if total == 0:
            return {"routing/margin_replay/replayed_frac": math.nan, "routing/margin_replay/replace_rate": math.nan}
        return {"routing/margin_replay/replayed_frac": replayed / total,
                "routing/margin_replay/replace_rate": changed / total}

    def native_trace(self) -> RoutingTrace:
        """What the routers would have chosen on their own in the replayed forward (for replay mismatch)."""
        if self._native is None:
            raise RoutingError("native routing was not recorded: open the session with record_native=True")
        return self._native.trace()


def check_overrides(options: ReplayConfig, trace: RoutingTrace, sites: list) -> None:
    """Refuse replay options the trace or the model cannot serve, naming what is missing."""
    if options.gate_weights and trace.weights_LBSK is None:
        raise RoutingError("replay.gate_weights needs a trace recorded with its gate weights (with_weights=True)")
    if options.gate_weights and trace.weights_LBSK.shape != trace.ids_LBSK.shape:
        raise RoutingError(f"the trace's gate weights {tuple(trace.weights_LBSK.shape)} do not match its ids "
                           f"{tuple(trace.ids_LBSK.shape)}")
    if not all(isinstance(getattr(site, "router", None), Router) for site in sites):
        raise RoutingError("replay.gate_weights and replay.margin_threshold need the native model's routers (they "
                           "rerun the router or overwrite its output; a Hugging Face router is not ours)")


def record_routing(model, with_entropy: bool = False, with_weights: bool = False) -> RecordSession:
    """`with record_routing(model) as rec:` records every router decision; `rec.trace()` afterwards."""
    return RecordSession(model, with_entropy, with_weights)


def replay_routing(model, trace: RoutingTrace, record_native: bool = False, options: ReplayConfig | None = None,
                   count_mask_BS: torch.Tensor | None = None) -> ReplaySession:
    """`with replay_routing(model, trace) as rep:` makes every router use `trace`'s expert ids (and, with
    `options`, its gate weights, or only the low-margin decisions; ReplaySession)."""
    return ReplaySession(model, trace, record_native, options, count_mask_BS)


# ----------------------------------------------------------------------------------------------------------
