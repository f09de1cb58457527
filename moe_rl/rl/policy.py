"""The policy's log-probabilities of a rollout batch's responses, under native or replayed routing.

Every pass of the RL step goes through `policy_forward`: the old pass, each minibatch update and every probe.
Running them through one function with the same row chunks is what makes "recomputed log-probs equal the old
ones" exact on CPU: the same rows in the same layout give bitwise the same numbers.

`model` may be a DistributedDataParallel wrapper (the training forward under torchrun): the forward goes through the
wrapper, so DDP sees it and averages the gradients in backward, while routing sessions attach to the MoE layers of
the wrapped module, whose forward the wrapper calls, so record and replay work unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from moe_rl.model.layers import autocast_context
from moe_rl.rl.distributed import unwrap
from moe_rl.rl.rollout import RolloutBatch
from moe_rl.routing.replay import ReplayConfig, record_routing, replay_routing
from moe_rl.routing.trace import RoutingTrace


@dataclass
class PolicyOutput:
    logp_BN: torch.Tensor  # log-prob of each response token under softmax(logits / temperature)
    logits_BNV: torch.Tensor  # temperature-scaled logits of the response window (-inf outside a kept sampling mask)
    aux_loss: torch.Tensor | None  # the model's router auxiliary loss (None without grad)
    trace: RoutingTrace | None  # the routing used: recorded (native) or the replayed trace
    native_trace: RoutingTrace | None  # under replay with record_native: what the routers would have chosen
    router_entropy_LBS: torch.Tensor | None  # with_entropy: entropy of each token's router distribution
    replay_stats: dict[str, float] | None = None  # margin-threshold replay: shares replayed and changed


def policy_forward(
    model,
    batch: RolloutBatch,
    temperature: float,
    *,
    replay: RoutingTrace | None = None,
    record: bool = False,
    record_native: bool = False,
    with_entropy: bool = False,
    replay_options: ReplayConfig | None = None,
    record_weights: bool = False,
) -> PolicyOutput:
    """One forward over `batch`. With `replay`, every router uses its ids (and `replay_options`' variants); with
    `record`, the routing is kept (`record_weights`: with its gate weights)."""
    session = _session(unwrap(model), batch, replay, record, record_native, with_entropy, replay_options,
                       record_weights)
    with session as active, autocast_context(batch.input_ids_BS.device):
        out = model(batch.input_ids_BS, batch.input_valid_BS)
    start = batch.prompt_len - 1
    logits_BNV = out.logits_BSV[:, start:].float() / temperature
    if batch.sampler_support_BNV is not None:  # keep_sampling_mask: renormalise over the sampler's nucleus
        logits_BNV = logits_BNV.masked_fill(~batch.sampler_support_BNV, -torch.inf)
    logp_BN = response_logprobs(logits_BNV, batch.response_BN)
    return PolicyOutput(
        logp_BN=logp_BN,
        logits_BNV=logits_BNV,
        aux_loss=out.aux_loss,
        trace=replay if replay is not None else (active.trace() if record else None),
        native_trace=active.native_trace() if replay is not None and record_native else None,
        router_entropy_LBS=active.router_entropy_LBS() if with_entropy and replay is None else None,
        replay_stats=active.margin_stats() if replay is not None and replay_options is not None
        and replay_options.margin_threshold is not None else None,
    )


def response_logprobs(logits_BNV: torch.Tensor, response_BN: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the full log-softmax: logit - logsumexp."""
    token_logits_BN = logits_BNV.gather(-1, response_BN[..., None]).squeeze(-1)
    return token_logits_BN - torch.logsumexp(logits_BNV, dim=-1)


def _session(model, batch, replay, record, record_native, with_entropy, replay_options, record_weights):
    if replay is not None:
        return replay_routing(model, replay, record_native=record_native, options=replay_options,
                              count_mask_BS=batch.token_mask_BS())
    if record or with_entropy:
        return record_routing(model, with_entropy=with_entropy, with_weights=record_weights)
    return nullcontext()
