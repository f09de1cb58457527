"""Accuracy on a split of a task, with its standard error: greedy and sampled, one or several samples per prompt.

    acc = accuracy(model, task, tokenizer, "eval", 1024, sampling, samples=4, seed=0)   # Accuracy(mean, se, ...)
    acc = accuracy(model, task, tokenizer, "eval", 1024, greedy(sampling))              # argmax decoding
    heldout_metrics(model, task, tokenizer, sampling, log_cfg, seed)   # the eval/* metrics moe-rl train logs

The unit of independence is the prompt: with k samples per prompt, each prompt's k rewards are averaged first and
the standard error is that of the mean of the n prompt means, SE = sqrt(sum_i (r_i - mean)^2 / (n (n - 1))), so
several samples of one prompt never pass for independent evidence. For one sample of a 0/1 reward this is
sqrt(p (1 - p) / (n - 1)). It measures the spread over prompts and sampling, i.e. the uncertainty of the model's
accuracy on the task's prompt distribution (not of the accuracy on these very prompts).

Greedy decoding is the sampler with a one-token nucleus (top_p below any token's probability keeps only the
argmax), so it runs through the same KV-cached `generate` and sampler precision as training's rollouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate

GREEDY_TOP_P = 1e-12  # below 1/V for any vocabulary: the nucleus is the argmax alone
ROWS_PER_CHUNK = 1024  # rows per generate call; up to this many rows decode as one batch, as the old eval did


@dataclass(frozen=True)
class Accuracy:
    """Mean reward over prompts (each prompt's samples averaged first) and its standard error."""

    mean: float
    se: float
    prompts: int
    samples: int


def greedy(sampling: SamplingConfig) -> SamplingConfig:
    """`sampling` decoding the argmax at every step (temperature 1, a one-token nucleus)."""
    return replace(sampling, temperature=1.0, top_p=GREEDY_TOP_P, keep_sampling_mask=False)


def mean_and_se(per_prompt_n: list[float]) -> tuple[float, float]:
    """Mean of the per-prompt values and the standard error of that mean (NaN with one prompt)."""
    n = len(per_prompt_n)
    mean = sum(per_prompt_n) / n
    if n < 2:
        return mean, math.nan
    variance = sum((x - mean) ** 2 for x in per_prompt_n) / (n - 1)
    return mean, math.sqrt(variance / n)


@torch.no_grad()
def prompt_rewards(model, task, tokenizer, problems, sampling: SamplingConfig, samples: int,
                   generator: torch.Generator) -> list[float]:
    """Each problem's mean reward over `samples` completions. Rows are prompt-major (row i*k + j is sample j of
    problem i), drawn in chunks of ROWS_PER_CHUNK rows from one generator."""
    device = next(model.parameters()).device
    prompts = [p.prompt for p in problems for _ in range(samples)]
    rewards_R: list[float] = []
    model.eval()
    for start in range(0, len(prompts), ROWS_PER_CHUNK):
        ids_BP, valid_BP = encode_prompts(prompts[start : start + ROWS_PER_CHUNK], tokenizer, device)
        gen = generate(model, ids_BP, valid_BP, sampling, tokenizer.eos_id, tokenizer.pad_id, generator)
        for row, tokens in enumerate(gen.response_BN.tolist()):
            problem = problems[(start + row) // samples]
            rewards_R.append(task.reward(problem, tokenizer.decode(tokens)))
    return [sum(rewards_R[i * samples : (i + 1) * samples]) / samples for i in range(len(problems))]


def accuracy(model, task, tokenizer, split: str, n_prompts: int, sampling: SamplingConfig, samples: int = 1,
             seed: int = 0) -> Accuracy:
    """Accuracy on problems 0 .. n_prompts - 1 of `split`: `samples` completions each from a generator seeded
    with `seed` (the same seed, prompts and model give the same number)."""
    problems = task.problems(split, 0, n_prompts)
    per_prompt = prompt_rewards(model, task, tokenizer, problems, sampling, samples,
                                torch.Generator().manual_seed(seed))
    return Accuracy(*mean_and_se(per_prompt), prompts=n_prompts, samples=samples)


def heldout_metrics(model, task, tokenizer, sampling: SamplingConfig, n_prompts: int, samples: int,
                    with_greedy: bool, seed: int) -> dict[str, float]:
    """The eval/* metrics of a training run (docs/metrics.md): `eval/reward` at the sampling temperature, mean of
    `samples` completions per held-out prompt (with samples = 1 and n_prompts <= ROWS_PER_CHUNK exactly the number
    older runs logged), its SE, and with `with_greedy` the greedy accuracy and its SE."""
    sampled = accuracy(model, task, tokenizer, "eval", n_prompts, sampling, samples, seed)
    metrics = {"eval/reward": sampled.mean, "eval/reward_se": sampled.se}
    if with_greedy:
        argmax = accuracy(model, task, tokenizer, "eval", n_prompts, greedy(sampling), 1, seed)
        metrics.update({"eval/greedy": argmax.mean, "eval/greedy_se": argmax.se})
    return metrics
