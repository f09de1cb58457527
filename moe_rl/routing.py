"""The routing contract shared by every backend: traces, record and replay sessions, churn arithmetic.

A routing trace holds, for every MoE layer in depth order, the expert ids each token was sent to, laid out
like the model input it was recorded on: `ids_LBSK` (L MoE layers, B sequences, S positions, K experts),
int16. Recording and replaying are sessions over a model, used as context managers:

    with record_routing(model) as rec:
        model(input_ids_BS, valid_BS)
    trace = rec.trace()

    with replay_routing(model, trace) as rep:    # every router uses trace's ids instead of its top-k
        model(input_ids_BS, valid_BS)

A session attaches itself to each MoE layer of one model for the duration of the block; nothing is global,
and a replay that does not fit the model fails at once, naming the layer, instead of falling back to native
routing. Churn between two routings of the same tokens follows docs/design.md section 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.errors import RoutingError
from moe_rl.model.cpu_topk import topk_indices


@dataclass(frozen=True)
class RoutingTrace:
    """Expert ids per MoE layer, token and slot: `ids_LBSK`, int16."""

    ids_LBSK: torch.Tensor

    @property
    def n_layers(self) -> int:
        return self.ids_LBSK.shape[0]

    @property
    def batch(self) -> int:
        return self.ids_LBSK.shape[1]

    @property
    def seq_len(self) -> int:
        return self.ids_LBSK.shape[2]

    @property
    def top_k(self) -> int:
        return self.ids_LBSK.shape[3]

    def rows(self, index) -> RoutingTrace:
        """The trace of a subset of sequences (a minibatch), e.g. `trace.rows(slice(0, 8))`."""
        return RoutingTrace(self.ids_LBSK[:, index])

    def to(self, device) -> RoutingTrace:
        return RoutingTrace(self.ids_LBSK.to(device))

    @staticmethod
    def cat(traces: list[RoutingTrace]) -> RoutingTrace:
        """Stack traces of different sequences (same layers, length and K) along the batch axis."""
        return RoutingTrace(torch.cat([t.ids_LBSK for t in traces], dim=1))


def routing_sites(model) -> list:
    """The model's MoE layers in depth order; each has `routing_session`, `n_experts` and `top_k`."""
    if not hasattr(model, "moe_layers"):
        raise TypeError(f"{type(model).__name__} exposes no moe_layers(); it cannot be recorded or replayed")
    sites = model.moe_layers()
    if not sites:
        raise RoutingError("the model has no MoE layers, so there is no routing to record or replay")
    return sites


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

    def replay_ids(self, layer: int, batch: int, seq_len: int) -> torch.Tensor | None:
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

    def trace(self) -> RoutingTrace:
        if not self.chunks[0]:
            raise RoutingError("nothing was recorded: run the model inside the session first")
        return RoutingTrace(torch.stack([torch.cat(chunks, dim=1) for chunks in self.chunks]))


class RecordSession(RoutingSession):
    """Records the ids every router chose (native top-k, or the replayed ids inside a replay)."""

    def __init__(self, model, with_entropy: bool = False):
        super().__init__(model)
        self._ids = _ChunkRecorder(len(self.sites))
        self._entropy: list[list[torch.Tensor]] | None = [[] for _ in self.sites] if with_entropy else None

    def observe(self, layer, routing, batch, seq_len):
        self._ids.add(layer, routing.ids_TK.detach().to(torch.int16).view(batch, seq_len, -1))
        if self._entropy is not None:
            p_TE = routing.scores_TE.detach()
            entropy_T = -(p_TE * p_TE.clamp_min(1e-30).log()).sum(-1)
            self._entropy[layer].append(entropy_T.view(batch, seq_len))

    def trace(self) -> RoutingTrace:
        return self._ids.trace()

    def router_entropy_LBS(self) -> torch.Tensor:
        """Entropy of each token's router distribution, per layer; needs `with_entropy=True`."""
        if self._entropy is None:
            raise RoutingError("router entropy was not recorded: open the session with with_entropy=True")
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self._entropy])


class ReplaySession(RoutingSession):
    """Forces every router to use the trace's ids; optionally records the native top-k it overrode."""

    def __init__(self, model, trace: RoutingTrace, record_native: bool = False):
        super().__init__(model)
        validate_trace(trace, self.sites)
        self.trace = trace
        self._native = _ChunkRecorder(len(self.sites)) if record_native else None

    def replay_ids(self, layer, batch, seq_len):
        ids_BSK = self.trace.ids_LBSK[layer]
        if ids_BSK.shape[:2] != (batch, seq_len):
            raise RoutingError(
                f"MoE layer {layer}: the replay trace covers {tuple(ids_BSK.shape[:2])} (batch, positions) "
                f"but this forward has ({batch}, {seq_len})"
            )
        return ids_BSK.reshape(batch * seq_len, -1)

    def observe(self, layer, routing, batch, seq_len):
        if self._native is not None:
            # A backend whose router does not rank by scores_TE (DeepSeek-V3's bias and groups) reports its choice.
            native_ids_TK = getattr(routing, "native_ids_TK", None)
            if native_ids_TK is None:
                native_ids_TK = topk_indices(routing.scores_TE.detach(), routing.ids_TK.shape[1])
            self._native.add(layer, native_ids_TK.to(torch.int16).view(batch, seq_len, -1))

    def native_trace(self) -> RoutingTrace:
        """What the routers would have chosen on their own in the replayed forward (for replay mismatch)."""
        if self._native is None:
            raise RoutingError("native routing was not recorded: open the session with record_native=True")
        return self._native.trace()


def validate_trace(trace: RoutingTrace, sites: list) -> None:
    """Refuse a trace whose layer count, K or expert ids do not fit the model, naming the layer."""
    if trace.ids_LBSK.dim() != 4:
        raise RoutingError(f"a routing trace is (layers, batch, positions, K); got shape {tuple(trace.ids_LBSK.shape)}")
    if trace.n_layers != len(sites):
        raise RoutingError(
            f"the trace has {trace.n_layers} MoE layers but the model has {len(sites)}; "
            f"layer {min(trace.n_layers, len(sites))} has no match"
        )
    for layer, site in enumerate(sites):
        ids = trace.ids_LBSK[layer]
        if trace.top_k != site.top_k:
            raise RoutingError(f"MoE layer {layer}: the trace has K={trace.top_k} but the router uses K={site.top_k}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= site.n_experts):
            raise RoutingError(
                f"MoE layer {layer}: expert ids span [{int(ids.min())}, {int(ids.max())}] "
                f"but the layer has experts 0..{site.n_experts - 1}"
            )


def record_routing(model, with_entropy: bool = False) -> RecordSession:
    """`with record_routing(model) as rec:` records every router decision; `rec.trace()` afterwards."""
    return RecordSession(model, with_entropy)


def replay_routing(model, trace: RoutingTrace, record_native: bool = False) -> ReplaySession:
    """`with replay_routing(model, trace) as rep:` makes every router use `trace`'s expert ids."""
    return ReplaySession(model, trace, record_native)


# ----------------------------------------------------------------------------------------------------------
# Churn (docs/design.md section 5)


@dataclass(frozen=True)
class ChurnStats:
    """Routing change between two routings A and B of the same tokens."""

    churn: float  # mean over (token, layer) of 1 - |S_A ∩ S_B| / K
    churn_per_layer: list[float]  # the same, per MoE layer
    set_change: float  # mean over (token, layer) of 1[S_A != S_B]
    set_change_per_layer: list[float]  # the same, per MoE layer
    token_any: float  # mean over tokens of 1[S_A != S_B in some layer]
    layers_changed: float  # mean over tokens of the number of layers with S_A != S_B
    n_tokens: int

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        metrics = {
            f"{prefix}churn": self.churn,
            f"{prefix}set_change": self.set_change,
            f"{prefix}token_any": self.token_any,
            f"{prefix}layers_changed": self.layers_changed,
        }
        metrics.update({f"{prefix}churn/L{l}": c for l, c in enumerate(self.churn_per_layer)})
        return metrics


def expert_overlap(a_LTK: torch.Tensor, b_LTK: torch.Tensor) -> torch.Tensor:
    """|S_A ∩ S_B| for every (layer, token): how many of A's K experts appear among B's."""
    return (a_LTK[..., :, None] == b_LTK[..., None, :]).any(dim=-1).sum(dim=-1)


def churn_stats(a: RoutingTrace, b: RoutingTrace, mask_BS: torch.Tensor | None = None) -> ChurnStats:
    """Churn between routings `a` and `b` over the tokens where `mask_BS` is true (all tokens if None)."""
    if a.ids_LBSK.shape != b.ids_LBSK.shape:
        raise RoutingError(
            f"cannot compare routings of different shape {tuple(a.ids_LBSK.shape)} and {tuple(b.ids_LBSK.shape)} "
            "(layers, batch, positions, K)"
        )
    if mask_BS is None:
        mask_BS = torch.ones(a.batch, a.seq_len, dtype=torch.bool, device=a.ids_LBSK.device)
    mask_BS = mask_BS.to(a.ids_LBSK.device, torch.bool)
    a_LTK, b_LTK = a.ids_LBSK[:, mask_BS], b.ids_LBSK[:, mask_BS]
    n_tokens = a_LTK.shape[1]
    if n_tokens == 0:
        nan = float("nan")
        return ChurnStats(nan, [nan] * a.n_layers, nan, [nan] * a.n_layers, nan, nan, 0)
    changed_frac_LT = 1.0 - expert_overlap(a_LTK, b_LTK).float() / a.top_k
    set_changed_LT = changed_frac_LT > 0
    return ChurnStats(
        churn=changed_frac_LT.mean().item(),
        churn_per_layer=changed_frac_LT.mean(dim=1).tolist(),
        set_change=set_changed_LT.float().mean().item(),
        set_change_per_layer=set_changed_LT.float().mean(dim=1).tolist(),
        token_any=set_changed_LT.any(dim=0).float().mean().item(),
        layers_changed=set_changed_LT.sum(dim=0).float().mean().item(),
        n_tokens=n_tokens,
    )
