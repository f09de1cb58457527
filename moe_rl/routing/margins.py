"""Router margins: how close each routing decision was to going the other way, and whether churn comes from there.

The margin of a token in an MoE layer is the gap between the k-th and the (k+1)-th largest router score in
`scores_TE` (the dense router output of the routing contract, docs/design.md section 4: softmax probabilities for
the native model). A small margin means a small change of the router's input or weights can swap the k-th expert
for the (k+1)-th, which is one slot of churn. With K = E there is no (k+1)-th expert and the margin is +inf.

    with record_margins(model) as rec:          # a RecordSession that also keeps each token's margin
        model(input_ids_BS, valid_BS)
    trace, margin_LBS = rec.trace(), rec.margin_LBS()
    summary, per_layer = margin_churn(margin_LBS, before, after, mask_BS)   # margins under `before`'s parameters
"""

from __future__ import annotations

import math

import torch

# topk_margin_T lives beside the router (margin-threshold replay uses it too) and is re-exported here.
from moe_rl.model.moe import topk_margin_T  # noqa: F401
from moe_rl.routing.churn import expert_overlap
from moe_rl.routing.replay import RecordSession
from moe_rl.routing.trace import RoutingTrace

MARGIN_THRESHOLDS = (0.001, 0.01, 0.05)
LOW_MARGIN_QUANTILE = 0.1


class MarginRecordSession(RecordSession):
    """Records every router decision, as RecordSession, and each token's top-k margin."""

    def __init__(self, model, with_entropy: bool = False):
        super().__init__(model, with_entropy)
        self._margins: list[list[torch.Tensor]] = [[] for _ in self.sites]

    def observe(self, layer, routing, batch, seq_len):
        super().observe(layer, routing, batch, seq_len)
        # A backend whose routers rank experts by something other than their gate scores (DeepSeek-V3: sigmoid plus
        # a selection-only bias, within the best groups) reports those as choice_TE; the margin is measured there.
        choice_TE = getattr(routing, "choice_TE", None)
        ranked_TE = routing.scores_TE if choice_TE is None else choice_TE
        margin_T = topk_margin_T(ranked_TE.detach(), routing.ids_TK.shape[1])
        self._margins[layer].append(margin_T.view(batch, seq_len))

    def margin_LBS(self) -> torch.Tensor:
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self._margins])


def record_margins(model, with_entropy: bool = False) -> MarginRecordSession:
    """`with record_margins(model) as rec:` records routing and margins; `rec.trace()`, `rec.margin_LBS()`."""
    return MarginRecordSession(model, with_entropy)


def _mean(x: torch.Tensor) -> float:
    return x.float().mean().item() if x.numel() else math.nan


def _median(x: torch.Tensor) -> float:
    return torch.quantile(x.double().flatten(), 0.5, interpolation="lower").item() if x.numel() else math.nan


def _stats(margin, churn, changed, low, thresholds) -> dict:
    """Margin distribution, and churn of the low-margin tokens vs the rest (tensors of any matching shape)."""
    row = {"margin_median": _median(margin)}
    row.update({f"margin_below_{t:g}": _mean(margin < t) for t in thresholds})
    row.update(churn_low_margin=_mean(churn[low]), churn_rest=_mean(churn[~low]),
               changes_in_low_margin=changed[low].sum().item() / max(changed.sum().item(), 1))
    return row


def low_margin_T(margin_T: torch.Tensor, low_quantile: float) -> torch.Tensor:
    """Tokens whose margin is at most the `low_quantile` quantile of `margin_T`."""
    if not margin_T.numel():
        return torch.zeros_like(margin_T, dtype=torch.bool)
    return margin_T <= torch.quantile(margin_T.double(), low_quantile, interpolation="lower")


def margin_churn(margin_LBS: torch.Tensor, before: RoutingTrace, after: RoutingTrace, mask_BS: torch.Tensor,
                 thresholds=MARGIN_THRESHOLDS, low_quantile: float = LOW_MARGIN_QUANTILE) -> tuple[dict, list[dict]]:
    """Margins (under `before`'s parameters) and their relation to the churn from `before` to `after`, over the
    tokens of `mask_BS`: (all layers pooled, one dict per layer). The low-margin quantile is taken per layer, since
    score scales differ between layers."""
    mask_BS = mask_BS.to(margin_LBS.device, torch.bool)
    margin_LT = margin_LBS[:, mask_BS]
    a_LTK, b_LTK = before.ids_LBSK[:, mask_BS], after.ids_LBSK[:, mask_BS]
    churn_LT = 1.0 - expert_overlap(a_LTK, b_LTK).float() / before.top_k
    changed_LT = churn_LT > 0
    low_LT = torch.stack([low_margin_T(margin_T, low_quantile) for margin_T in margin_LT])
    per_layer = [_stats(margin_LT[l], churn_LT[l], changed_LT[l], low_LT[l], thresholds)
                 for l in range(margin_LT.shape[0])]
    return _stats(margin_LT, churn_LT, changed_LT, low_LT, thresholds), per_layer
