"""One MoE layer of a Hugging Face model under the routing contract, through a forward hook on its router.

We do not own these models, so instead of an argument (as in the native router) a forward hook on the router
module sees every decision: the router computes its own output, and the hook

- records it as is (native routing: the ids and weights are exactly the family's own), or
- under replay, swaps in the trace's ids and recomputes the weights from the same router logits by the family's
  rule (moe_rl.model.hf.families), so the router keeps its gradient; the family's own choice is still reported
  as `native_ids_TK` for the replay probe.

A site is a plain object, not a module: it owns no parameters, and `copy.deepcopy` of the model copies it along
with the hook (a bound method), so a copied model never calls the original's site.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from moe_rl.errors import RoutingError


class HFRouterOutput(NamedTuple):
    """The routing contract's fields, in the order of moe_rl.model.RouterOutput, plus the family's own choice."""

    weights_TK: torch.Tensor  # gate weights the experts were run with (the family's rule at ids_TK)
    ids_TK: torch.Tensor  # int64 expert ids used: the family's own top-k, or the replayed ids
    scores_TE: torch.Tensor  # fp32 distribution over experts (softmax; DeepSeek-V3: sigmoid normalised)
    logits_TE: torch.Tensor  # fp32 router logits
    native_ids_TK: torch.Tensor  # what the family's router chose on its own (equals ids_TK without replay)
    choice_TE: torch.Tensor  # fp32 scores the family ranks experts by; native_ids_TK is their top-k


class HFRouterSite:
    """The routing site of one MoE decoder layer: `routing_session`, `n_experts`, `top_k` for moe_rl.routing.replay."""

    def __init__(self, moe_index: int, layer_index: int, block: nn.Module, router: nn.Module, family):
        self.moe_index = moe_index  # position among MoE layers: the routing trace's layer axis
        self.layer_index = layer_index  # position among all decoder layers
        self.block, self.router, self.family = block, router, family
        self.routing_session = None  # set only inside a moe_rl.routing.replay session
        self.shape_BS: tuple[int, int] | None = None  # (B, S) of the HFMoEModel forward in progress
        self.calls = 0  # router calls in the forward in progress
        self.last: HFRouterOutput | None = None  # with grad on: this forward's routing, for the auxiliary losses
        router.register_forward_hook(self._hook)

    @property
    def n_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def experts(self) -> nn.Module:
        return self.block.experts

    def start(self, batch: int, seq_len: int) -> None:
        """Called by HFMoEModel before every forward."""
        self.shape_BS, self.calls, self.last = (batch, seq_len), 0, None

    def finish(self) -> None:
        """Called by HFMoEModel after every forward (also a failed one)."""
        self.shape_BS, self.last = None, None

    def _hook(self, router, args, output):
        """Forward hook on the router: output is (router_logits_TE, weights_TK, ids_TK) in every family."""
        self.calls += 1
        session = self.routing_session
        if session is None and (self.shape_BS is None or not torch.is_grad_enabled()):
            return None  # sampling without a trace, or a direct call of the HF model: nothing to do
        if self.shape_BS is None:
            raise RoutingError(f"MoE layer {self.moe_index}: inside a routing session, run the model through "
                               "HFMoEModel, not the HF model it wraps")
        logits_TE, weights_TK, native_ids_TK = output
        B, S = self.shape_BS
        replay = session.replay_inputs(self.moe_index, B, S) if session is not None else None
        replay_TK = None if replay is None else replay.ids_TK
        ids_TK = native_ids_TK
        if replay_TK is not None:
            ids_TK = replay_TK.to(native_ids_TK.device).long()
            weights_TK = self.family.gate(router, logits_TE, ids_TK)
        scores_TE = self.family.scores(router, logits_TE)
        same = self.family.choice is self.family.scores  # the softmax families rank by their distribution
        choice_TE = scores_TE.detach() if same else self.family.choice(router, logits_TE.detach())
        routing = HFRouterOutput(weights_TK, ids_TK, scores_TE, logits_TE.float(), native_ids_TK, choice_TE)
        if session is not None:
            session.observe(self.moe_index, routing, B, S)
        if torch.is_grad_enabled():
            self.last = routing
        return None if replay_TK is None else (logits_TE, weights_TK, ids_TK)
