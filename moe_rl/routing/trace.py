"""A routing trace: the expert ids (and optionally gate weights) of every MoE layer for every token of a batch, laid
out like the model input it was recorded on, and the checks that a trace fits a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.errors import RoutingError


@dataclass(frozen=True)
class RoutingTrace:
    """Expert ids per MoE layer, token and slot: `ids_LBSK`, int16; with `weights_LBSK` (fp32, recorded with
    `with_weights`) the gate weights the experts were combined with."""

    ids_LBSK: torch.Tensor
    weights_LBSK: torch.Tensor | None = None

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

    def _map(self, f) -> RoutingTrace:
        return RoutingTrace(f(self.ids_LBSK), None if self.weights_LBSK is None else f(self.weights_LBSK))

    def rows(self, index) -> RoutingTrace:
        """The trace of a subset of sequences (a minibatch), e.g. `trace.rows(slice(0, 8))`."""
        return self._map(lambda t: t[:, index])

    def to(self, device) -> RoutingTrace:
        return self._map(lambda t: t.to(device))

    def clone(self) -> RoutingTrace:
        return self._map(torch.clone)

    @staticmethod
    def cat(traces: list[RoutingTrace]) -> RoutingTrace:
        """Stack traces of different sequences (same layers, length and K) along the batch axis; the weights are
        kept when every trace has them."""
        weights = [t.weights_LBSK for t in traces]
        return RoutingTrace(torch.cat([t.ids_LBSK for t in traces], dim=1),
                            None if any(w is None for w in weights) else torch.cat(weights, dim=1))


def routing_sites(model) -> list:
    """The model's MoE layers in depth order; each has `routing_session`, `n_experts` and `top_k`."""
    if not hasattr(model, "moe_layers"):
        raise TypeError(f"{type(model).__name__} exposes no moe_layers(); it cannot be recorded or replayed")
    sites = model.moe_layers()
    if not sites:
        raise RoutingError("the model has no MoE layers, so there is no routing to record or replay")
    return sites



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
