"""The sampler: batched, KV-cached autoregressive generation with temperature and top-p.

Layout of a generation (B sequences, P prompt positions, N response positions, S = P + N):

    tokens_BS   [ pad pad p p p p | r r r EOS pad pad ]    prompts left-padded, responses right-padded
    valid_BS    [  0   0  1 1 1 1 | 1 1 1  1   0   0  ]    real tokens, EOS included
                                  ^ prompt_len = P

The model input for training is `tokens_BS[:, :-1]` and the targets `tokens_BS[:, 1:]` (teacher forcing),
so position t's routing and logits produce token t+1. When asked, the sampler records the routing of exactly
that input layout: prefill and decode steps stitched together, equal to a full forward over the sampled
sequences. That is the trace R3 replays.

Log-probs are those of the temperature-scaled distribution, softmax(logits / temperature), without the
top-p truncation: the quantity a trainer can recompute. With top_p = 1 (the default) they are exactly the
sampling distribution.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from moe_rl.errors import ConfigError, check_positive
from moe_rl.routing import RoutingTrace, record_routing


@dataclass
class SamplingConfig:
    """How completions are sampled."""

    max_new_tokens: int = 16
    """Longest response, EOS included."""
    temperature: float = 1.0
    """Softmax temperature (> 0); the policy's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1)."""

    def __post_init__(self) -> None:
        check_positive("max_new_tokens", self.max_new_tokens)
        check_positive("temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass
class Generation:
    tokens_BS: torch.Tensor  # int64, prompt then response
    valid_BS: torch.Tensor  # bool, real tokens
    prompt_len: int  # P
    logprobs_BN: torch.Tensor  # sampler log-prob of each response token, 0 where not a response token
    routing: RoutingTrace | None  # over input_ids_BS, or None if not recorded

    @property
    def response_BN(self) -> torch.Tensor:
        return self.tokens_BS[:, self.prompt_len :]

    @property
    def response_mask_BN(self) -> torch.Tensor:
        return self.valid_BS[:, self.prompt_len :]

    @property
    def input_ids_BS(self) -> torch.Tensor:
        """The model input whose logits score every generated token (S-1 positions)."""
        return self.tokens_BS[:, :-1]

    @property
    def input_valid_BS(self) -> torch.Tensor:
        return self.valid_BS[:, :-1]


def left_align(ids_BP: torch.Tensor, valid_BP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the right end (left padding), keeping their order.

    Accepts left-, right- or mixed padding; generation appends after the last column, so a prompt's real
    tokens must end there.
    """
    # Stable sort on "is real": padding (False) first, real tokens after, each group in original order.
    order_BP = valid_BP.to(torch.int8).argsort(dim=1, stable=True)
    return ids_BP.gather(1, order_BP), valid_BP.gather(1, order_BP)


def sample_next(logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None):
    """Draw one token per row; return (tokens_B, their log-probs under softmax(logits / temperature))."""
    logp_BV = torch.log_softmax(logits_BV.float() / cfg.temperature, dim=-1)
    probs_BV = logp_BV.exp()
    if cfg.top_p < 1.0:
        probs_BV = _nucleus(probs_BV, cfg.top_p)
    tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None]).squeeze(1)


def _nucleus(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    sorted_BV = sorted_BV.masked_fill(mass_before_BV >= top_p, 0.0)  # the top token always survives
    return torch.zeros_like(probs_BV).scatter(1, order_BV, sorted_BV)


@torch.no_grad()
def generate(
    model,
    prompt_ids_BP: torch.Tensor,
    prompt_valid_BP: torch.Tensor,
    cfg: SamplingConfig,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    record: bool = False,
    use_cache: bool = True,
) -> Generation:
    """Sample one completion per prompt row. `use_cache=False` recomputes the prefix every step
    (the reference the KV cache is checked and benchmarked against)."""
    ids_BP, valid_BP = left_align(prompt_ids_BP, prompt_valid_BP.bool())
    B, P = ids_BP.shape
    cache = model.new_cache(B, P + cfg.max_new_tokens) if use_cache else None
    tokens_BS, valid_BS = ids_BP, valid_BP
    finished_B = torch.zeros(B, dtype=torch.bool, device=ids_BP.device)
    logprobs = []
    with record_routing(model) if record and use_cache else nullcontext() as recorder:
        logits_BV = model(ids_BP, valid_BP, cache).logits_BSV[:, -1]
        for step in range(cfg.max_new_tokens):
            next_B, logp_B = sample_next(logits_BV, cfg, generator)
            next_B = next_B.masked_fill(finished_B, pad_id)
            logprobs.append(logp_B.masked_fill(finished_B, 0.0))
            tokens_BS = torch.cat([tokens_BS, next_B[:, None]], dim=1)
            valid_BS = torch.cat([valid_BS, ~finished_B[:, None]], dim=1)
            finished_B = finished_B | (next_B == eos_id)
            if finished_B.all() or step == cfg.max_new_tokens - 1:
                break
            logits_BV = _next_logits(model, tokens_BS, valid_BS, cache)
    routing = None
    if record:
        routing = recorder.trace() if use_cache else _record_full(model, tokens_BS, valid_BS)
    return Generation(tokens_BS, valid_BS, P, torch.stack(logprobs, dim=1), routing)


def _next_logits(model, tokens_BS, valid_BS, cache):
    if cache is None:
        return model(tokens_BS, valid_BS).logits_BSV[:, -1]
    return model(tokens_BS[:, -1:], valid_BS, cache).logits_BSV[:, -1]


def _record_full(model, tokens_BS, valid_BS) -> RoutingTrace:
    with record_routing(model) as recorder:
        model(tokens_BS[:, :-1], valid_BS[:, :-1])
    return recorder.trace()
