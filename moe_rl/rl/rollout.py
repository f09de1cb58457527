"""The sampler: batched, KV-cached autoregressive generation with temperature and top-p.

Layout of a generation (B sequences, P prompt positions, N response positions, S = P + N):

    tokens_BS   [ pad pad p p p p | r r r EOS pad pad ]    prompts left-padded, responses right-padded
    valid_BS    [  0   0  1 1 1 1 | 1 1 1  1   0   0  ]    real tokens, EOS included
                                  ^ prompt_len = P

The model input for training is `tokens_BS[:, :-1]` and the targets `tokens_BS[:, 1:]` (teacher forcing),
so position t's routing and logits produce token t+1. When asked, the sampler records the routing of exactly
that input layout: prefill and decode steps stitched together, equal to a full forward over the sampled
sequences. That is the trace R3 replays.

Log-probs are those of the distribution each token was drawn from: softmax(logits / temperature), renormalised
over the nucleus when top_p < 1. A trainer that scores the full distribution then sees every ratio biased by the
log of the nucleus mass (TRL issue 6789); `keep_sampling_mask` records each step's nucleus so that the trainer
renormalises over the same support (moe_rl.rl.policy), as DeepSeek-V3.2's "keep sampling mask" does.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from moe_rl.errors import ConfigError, check_choice, check_positive
from moe_rl.model.precision import SAMPLER_PRECISIONS, sampler_numerics
from moe_rl.routing.replay import record_routing
from moe_rl.routing.trace import RoutingTrace


@dataclass
class SamplingConfig:
    """How completions are sampled."""

    max_new_tokens: int = 16
    """Longest response, EOS included."""
    temperature: float = 1.0
    """Softmax temperature (> 0); the policy's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1)."""
    precision: Literal[SAMPLER_PRECISIONS] = "trainer"  # the tuple spells the choices; --help lists them
    """Sampler numerics (moe_rl.model.precision): 'trainer' (the trainer's: fp32 on CPU); emulated inference
    engines 'bf16', 'fp16' (autocast and router gate in that dtype) and 'fp8' (attention and expert matrices stored
    as float8 e4m3 with a per-matrix scale, bf16 otherwise), whose router decisions differ from the fp32 trainer's at
    near-ties (R3 then differs from R2); 'exact': samples as 'trainer', and the trainer replaces the sampler's
    log-probs and routing by its own old pass's (bit for bit: the zero-mismatch control). Held-out evaluation samples
    the same way."""
    keep_sampling_mask: bool = False
    """With top_p < 1 or min_new_tokens: keep each step's support (the nucleus, without EOS while it is banned), and
    have the trainer renormalise its log-probs over it (every pass: old, updates, probes), so that trainer and sampler
    score the same truncated distribution. Without it the trainer scores the full distribution and every ratio is off
    by the support's mass."""
    min_new_tokens: int = 0
    """Length control: EOS cannot be drawn before this many response tokens (vLLM's min_tokens). A decoding-only
    baseline for `moe-rl evaluate`: a warm start that stops too early can gain accuracy from it without training."""

    def __post_init__(self) -> None:
        check_positive("max_new_tokens", self.max_new_tokens)
        check_positive("min_new_tokens", self.min_new_tokens, allow_zero=True)
        if self.min_new_tokens >= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens={self.min_new_tokens} must be < max_new_tokens={self.max_new_tokens} "
                              "(else no completion could end with EOS)")
        check_choice("sampling.precision", self.precision, SAMPLER_PRECISIONS)
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
    support_BNV: torch.Tensor | None = None  # keep_sampling_mask: each step's nucleus (all True after EOS)
    routed_BS: torch.Tensor | None = None  # input positions `routing` covers; None: every one (an engine that never
    # feeds a row's last token back, vLLM, leaves that position out)

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
    """Draw one token per row; return (tokens_B, their log-probs under the distribution drawn from)."""
    tokens_B, logp_B, _ = draw(logits_BV, cfg, generator)
    return tokens_B, logp_B


def draw(logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
         banned_token: int | None = None):
    """(tokens_B, log-probs, support_BV): one token per row from softmax(logits / temperature), without
    `banned_token` (the length control bans EOS), truncated to the nucleus and renormalised when top_p < 1;
    support_BV is the nucleus (None when top_p = 1)."""
    scaled_BV = logits_BV.float()
    if cfg.temperature != 1.0:  # x / 1.0 == x exactly: skip the op
        scaled_BV = scaled_BV / cfg.temperature
    logp_BV = torch.log_softmax(scaled_BV, dim=-1)
    if not torch.isfinite(logp_BV).all():
        raise FloatingPointError("the model produced non-finite logits while sampling")
    if banned_token is not None:
        scaled_BV = scaled_BV.index_fill(1, torch.tensor([banned_token], device=scaled_BV.device), -torch.inf)
        logp_BV = torch.log_softmax(scaled_BV, dim=-1)
    support_BV = None
    if cfg.top_p < 1.0:
        support_BV = nucleus_support(logp_BV.exp(), cfg.top_p)
        logp_BV = torch.log_softmax(scaled_BV.masked_fill(~support_BV, -torch.inf), dim=-1)
    tokens_B = inverse_cdf_draw(logp_BV.exp(), generator)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None]).squeeze(1), support_BV


def inverse_cdf_draw(probs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from (possibly unnormalised) probabilities, by inverse CDF.

    The B uniforms come from `generator` on its own device, so one CPU generator (whose state a checkpoint
    saves like any other) drives sampling on any device; torch.multinomial would need a generator on the
    probabilities' device. Zero-probability tokens are never drawn.
    """
    gen_device = generator.device if generator is not None else probs_BV.device
    u_B = torch.rand(probs_BV.shape[0], generator=generator, device=gen_device, dtype=torch.float64)
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    threshold_B1 = (u_B.to(probs_BV.device) * cdf_BV[:, -1])[:, None]
    tokens_B = torch.searchsorted(cdf_BV, threshold_B1, right=True).squeeze(1)
    return tokens_B.clamp(max=probs_BV.shape[1] - 1)


def nucleus_support(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p, as a bool mask (the top token always)."""
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    return torch.zeros_like(probs_BV, dtype=torch.bool).scatter(1, order_BV, mass_before_BV < top_p)


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
    record_weights: bool = False,
) -> Generation:
    """Sample one completion per prompt row. `use_cache=False` recomputes the prefix every step
    (the reference the KV cache is checked and benchmarked against). `record_weights`: the recorded routing keeps
    the gate weights too (for R3 replaying them)."""
    # inference_mode skips autograd's version counters and view tracking on every op of the decode loop (cheaper
    # than no_grad). Its tensors may not enter autograd later (the trainer's embedding saves the token ids), so the
    # few outputs are cloned into ordinary tensors on the way out.
    with torch.inference_mode():
        gen = _generate(model, prompt_ids_BP, prompt_valid_BP, cfg, eos_id, pad_id, generator, record, use_cache,
                        record_weights)
    routing = gen.routing.clone() if gen.routing is not None else None
    support = gen.support_BNV.clone() if gen.support_BNV is not None else None
    return Generation(gen.tokens_BS.clone(), gen.valid_BS.clone(), gen.prompt_len, gen.logprobs_BN.clone(), routing,
                      support)


def _generate(model, prompt_ids_BP, prompt_valid_BP, cfg: SamplingConfig, eos_id: int, pad_id: int,
              generator, record: bool, use_cache: bool, record_weights: bool = False) -> Generation:
    ids_BP, valid_BP = left_align(prompt_ids_BP, prompt_valid_BP.bool())
    B, P = ids_BP.shape
    # Preallocated to the longest generation, so a step writes one column instead of copying the sequence;
    # the first `length` columns are the sequence so far.
    tokens_BW = torch.cat([ids_BP, ids_BP.new_full((B, cfg.max_new_tokens), pad_id)], dim=1)
    valid_BW = torch.cat([valid_BP, valid_BP.new_zeros(B, cfg.max_new_tokens)], dim=1)
    finished_B = torch.zeros(B, dtype=torch.bool, device=ids_BP.device)
    logprobs, supports = [], []
    keep_support = cfg.keep_sampling_mask and (cfg.top_p < 1.0 or cfg.min_new_tokens > 0)
    with record_routing(model, with_weights=record_weights) if record and use_cache else nullcontext() as recorder, \
            sampler_numerics(model, ids_BP.device, cfg.precision) as numerics:
        # Made in the sampler's precision: its key layout follows whether the C decode attention serves it.
        cache = model.new_cache(B, P + cfg.max_new_tokens) if use_cache else None
        logits_BV = model(ids_BP, valid_BP, cache, numerics=numerics).logits_BSV[:, -1]
        for step in range(cfg.max_new_tokens):
            eos_banned = step < cfg.min_new_tokens
            next_B, logp_B, support_BV = draw(logits_BV, cfg, generator, eos_id if eos_banned else None)
            next_B = next_B.masked_fill(finished_B, pad_id)
            logprobs.append(logp_B.masked_fill(finished_B, 0.0))
            if keep_support:  # a padding position keeps every token, so its renormalisation stays finite
                if support_BV is None:
                    support_BV = torch.ones_like(logits_BV, dtype=torch.bool)
                if eos_banned:
                    support_BV[:, eos_id] = False
                supports.append(support_BV | finished_B[:, None])
            length = P + step + 1
            tokens_BW[:, length - 1] = next_B
            valid_BW[:, length - 1] = ~finished_B
            finished_B = finished_B | (next_B == eos_id)
            if finished_B.all() or step == cfg.max_new_tokens - 1:
                break
            logits_BV = _next_logits(model, tokens_BW[:, :length], valid_BW[:, :length], cache, numerics)
    tokens_BS, valid_BS = tokens_BW[:, :length].contiguous(), valid_BW[:, :length].contiguous()
    routing = None
    if record:
        routing = recorder.trace() if use_cache else _record_full(model, tokens_BS, valid_BS, record_weights)
    support_BNV = torch.stack(supports, dim=1) if keep_support else None
    return Generation(tokens_BS, valid_BS, P, torch.stack(logprobs, dim=1), routing, support_BNV)


def _next_logits(model, tokens_BS, valid_BS, cache, numerics):
    if cache is None:
        return model(tokens_BS, valid_BS, numerics=numerics).logits_BSV[:, -1]
    return model(tokens_BS[:, -1:], valid_BS, cache, numerics=numerics).logits_BSV[:, -1]


def _record_full(model, tokens_BS, valid_BS, record_weights: bool = False) -> RoutingTrace:
    with record_routing(model, with_weights=record_weights) as recorder:
        model(tokens_BS[:, :-1], valid_BS[:, :-1])
    return recorder.trace()


# ----------------------------------------------------------------------------------------------------------
# Group rollouts: B prompts x G completions, rewards and group-normalised advantages


@dataclass
class RolloutBatch:
    """One rollout batch laid out for teacher forcing. Rows are completions; N is the response window.

    The model input is `input_ids_BS` (S = P + N - 1 positions); position P-1+n scores response token n.
    """

    input_ids_BS: torch.Tensor
    input_valid_BS: torch.Tensor
    prompt_len: int
    response_BN: torch.Tensor
    response_mask_BN: torch.Tensor
    sampler_logp_BN: torch.Tensor
    rewards_B: torch.Tensor
    advantages_B: torch.Tensor
    group_B: torch.Tensor  # which prompt of the step each row answers
    sampler_routing: RoutingTrace | None
    prompts: list[str]
    completions: list[str]
    sampler_support_BNV: torch.Tensor | None = None  # keep_sampling_mask: the nucleus of every response position
    sampler_routed_BS: torch.Tensor | None = None  # input positions sampler_routing covers (None: all)

    @property
    def size(self) -> int:
        return self.input_ids_BS.shape[0]

    def rows(self, index: torch.Tensor) -> RolloutBatch:
        """The rows `index` (a LongTensor of row numbers), e.g. a minibatch or a data-parallel shard."""
        pick = index.tolist()
        fields = {
            name: value[index] if isinstance(value, torch.Tensor) else value
            for name, value in vars(self).items()
        }
        fields["sampler_routing"] = self.sampler_routing.rows(index) if self.sampler_routing is not None else None
        fields["prompts"] = [self.prompts[i] for i in pick]
        fields["completions"] = [self.completions[i] for i in pick]
        return RolloutBatch(**fields)

    def token_mask_BS(self, tokens: str = "response") -> torch.Tensor:
        """Input positions whose routing churn is measured: 'response' = those that score a response token,
        'all' = every real (non-padding) input position the sampler's routing covers."""
        if tokens == "all":
            if self.sampler_routed_BS is not None:
                return self.input_valid_BS & self.sampler_routed_BS
            return self.input_valid_BS
        mask_BS = torch.zeros_like(self.input_valid_BS)
        mask_BS[:, self.prompt_len - 1 :] = self.response_mask_BN
        return mask_BS


def encode_prompts(prompts: list[str], tokenizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[BOS] + prompt ids for every prompt, left-padded into (ids_BP, valid_BP)."""
    encoded = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in prompts]
    width = max(len(ids) for ids in encoded)
    ids_BP = torch.full((len(encoded), width), tokenizer.pad_id, dtype=torch.long)
    valid_BP = torch.zeros((len(encoded), width), dtype=torch.bool)
    for row, ids in enumerate(encoded):
        ids_BP[row, width - len(ids) :] = torch.tensor(ids)
        valid_BP[row, width - len(ids) :] = True
    return ids_BP.to(device), valid_BP.to(device)


def generate_groups(model, task, tokenizer, problems, group_size: int, cfg: SamplingConfig,
                    generator: torch.Generator | None, record: bool,
                    record_weights: bool = False, engine=None) -> tuple[Generation, torch.Tensor, list[str]]:
    """Sample `group_size` completions per problem with `engine` (moe_rl.rl.engines; None: this sampler); return
    the generation, rewards (rows grouped by problem: row i*G + g is completion g of problem i) and the decoded
    completions."""
    device = next(model.parameters()).device
    prompts = [p.prompt for p in problems for _ in range(group_size)]
    ids_BP, valid_BP = encode_prompts(prompts, tokenizer, device)
    sample = generate if engine is None else engine.generate
    gen = sample(model, ids_BP, valid_BP, cfg, tokenizer.eos_id, tokenizer.pad_id, generator, record,
                 record_weights=record_weights)
    completions = [tokenizer.decode(row) for row in gen.response_BN.tolist()]
    rewards = [task.reward(problems[i // group_size], text) for i, text in enumerate(completions)]
    return gen, torch.tensor(rewards, dtype=torch.float32), completions


def to_rollout_batch(gen: Generation, rewards_B: torch.Tensor, advantages_B: torch.Tensor, group_size: int,
                     prompts: list[str], completions: list[str]) -> RolloutBatch:
    device = gen.tokens_BS.device
    return RolloutBatch(
        input_ids_BS=gen.input_ids_BS,
        input_valid_BS=gen.input_valid_BS,
        prompt_len=gen.prompt_len,
        response_BN=gen.response_BN,
        response_mask_BN=gen.response_mask_BN,
        sampler_logp_BN=gen.logprobs_BN,
        rewards_B=rewards_B.to(device),
        advantages_B=advantages_B.to(device),
        group_B=torch.arange(len(prompts), device=device) // group_size,
        sampler_routing=gen.routing,
        prompts=prompts,
        completions=completions,
        sampler_support_BNV=gen.support_BNV,
        sampler_routed_BS=gen.routed_BS,
    )


@torch.no_grad()
def sampled_reward(model, task, tokenizer, sampling, n_prompts: int, seed: int, split: str = "eval") -> float:
    """Mean reward of one sampled completion per prompt of `split` (fixed generator)."""
    problems = task.problems(split, 0, n_prompts)
    ids, valid = encode_prompts([p.prompt for p in problems], tokenizer, next(model.parameters()).device)
    model.eval()
    gen = generate(model, ids, valid, sampling, tokenizer.eos_id, tokenizer.pad_id,
                   torch.Generator().manual_seed(seed))
    texts = [tokenizer.decode(row) for row in gen.response_BN.tolist()]
    return sum(task.reward(p, t) for p, t in zip(problems, texts)) / len(problems)
