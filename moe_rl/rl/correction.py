"""Rollout correction: importance weights and rejection masks between the sampler and the trainer's old pass.

The sampler (an inference engine, here emulated at some precision) and the trainer's theta_old pass score the same
tokens with slightly different probabilities. With `log_ratio_BT = old_logp - sampler_logp` (stop-gradient),
rho_t = exp(log_ratio_t) is the importance ratio pi_old / pi_sampler of each response token. The correction turns it
into two things the objective consumes (docs/design.md section 10):

- `weights_BT`: a non-negative weight multiplying each token's objective term.
    is_level "none":     1
    is_level "token":    rho_t                          (token IS; TIS with is_cap: min(rho_t, cap))
    is_level "sequence": prod_t rho_t = exp(sum_t log_ratio_t), the same for every token of the sequence
  With is_band [lo, hi] (IcePop, Ling team, Ring-1T): the level's ratio inside the band, 0 outside.
- `keep_BT`: the tokens that stay in the aggregation; a rejection option drops the tokens (token_*) or whole
  sequences (seq_*) whose divergence statistic is out of bounds. Per token, with r = log_ratio:
    k1 = -r (verl's: log pi_sampler / pi_old, banded as a ratio: lo <= exp(-r) <= hi),
    k2 = r^2 / 2,  k3 = exp(r) - 1 - r  (<= threshold)
  seq_sum_* and seq_mean_* apply the same test to the sum or mean of the token statistic over the sequence
  (seq_sum_k1: lo <= exp(-sum r) <= hi), seq_max_* to its maximum (seq_max_k1: every token's exp(-r) in the band).
  Several options must all pass.

The formulas follow verl's rollout_corr (docs/algo/rollout_corr.md); docs/design.md section 10 lists where we differ.
Log-ratios are clamped to +-LOG_RATIO_BOUND before any exp, so a log-ratio of +-50 (or a sequence sum of thousands)
gives a finite weight; padding, all-masked sequences and empty batches give weights 0 or 1 and no NaN.

    corr = rollout_correction(old_logp_BT - sampler_logp_BT, mask_BT, cfg)
    loss_mask_BT = mask_BT & corr.keep_BT;  token advantages A_i * corr.weights_BT
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from moe_rl.errors import ConfigError, check_choice
from moe_rl.objectives.masked import as_bool_mask, masked_mean, masked_sum, nonempty_sequences

IsLevel = Literal["none", "token", "sequence"]
IS_LEVELS = ("none", "token", "sequence")
REJECT_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                  "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k1", "seq_max_k2", "seq_max_k3")
RejectOption = Literal[REJECT_OPTIONS]
LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: finite in fp32, and far beyond any cap worth using (verl's bound too)
EXTREME_RATIO = 2.0  # the extreme-token fraction counts rho > 2 or rho < 1/2 (the R3 paper's F(2))


@dataclass
class CorrectionConfig:
    """Rollout correction between the sampler's and the trainer's old log-probs (moe_rl.rl.correction)."""

    is_level: IsLevel = "none"
    """Importance weights pi_old / pi_sampler: 'none', 'token' (one ratio per token) or 'sequence' (the product of
    a sequence's token ratios, shared by its tokens)."""
    is_cap: float | None = None
    """Truncate each weight at this value (TIS, e.g. 2.0). Needs is_level token or sequence; not with is_band."""
    is_band: tuple[float, float] | None = None
    """IcePop: LO HI; a weight outside [LO, HI] is set to 0 (the token stays in the loss's denominator). Needs
    is_level token or sequence; not with is_cap."""
    reject: tuple[RejectOption, ...] = ()
    """Rejection masks, all of which must pass; rejected tokens leave the aggregation: token_k1/k2/k3 (per token),
    seq_sum_*, seq_mean_*, seq_max_* (whole sequences). k1 is a band on pi_sampler / pi_old (verl's k1 =
    -log_ratio), k2 and k3 an upper bound."""
    reject_thresholds: tuple[float, ...] = ()
    """The bounds of `reject`, in its order: two numbers (LO HI, bounds of pi_sampler / pi_old, as in verl) for a
    *_k1 option, one upper bound for the others; e.g.
    `--correction.reject token_k1 seq_max_k3 --correction.reject-thresholds 0.5 2 0.1`."""

    def __post_init__(self) -> None:
        self.reject, self.reject_thresholds = tuple(self.reject), tuple(self.reject_thresholds)
        if self.is_band is not None:
            self.is_band = tuple(self.is_band)

    def validate(self) -> None:
        """Refuse a bad combination with a ConfigError naming the fields. `moe-rl train` calls this before it
        writes anything (moe_rl.commands.train.check_inputs: one line on stderr, exit 2; an error raised while tyro
        builds the config would come out in tyro's box instead), and so does rollout_correction."""
        check_choice("correction.is_level", self.is_level, IS_LEVELS)
        if self.is_cap is not None and self.is_band is not None:
            raise ConfigError("correction.is_cap and correction.is_band cannot be combined: choose truncation (TIS) "
                              "or a band outside which weights are 0 (IcePop)")
        if self.is_level == "none" and (self.is_cap is not None or self.is_band is not None):
            raise ConfigError("correction.is_cap / correction.is_band need correction.is_level token or sequence")
        if self.is_cap is not None and not self.is_cap > 0:
            raise ConfigError(f"correction.is_cap={self.is_cap!r} must be > 0")
        if self.is_band is not None:
            check_band("correction.is_band", self.is_band)
        self.bounds()  # refuses a bad reject / reject_thresholds pair now, not at the first rollout step

    @property
    def active(self) -> bool:
        """Whether the correction changes the loss at all (else only its metrics are logged)."""
        return self.is_level != "none" or bool(self.reject)

    def bounds(self) -> dict[str, tuple[float, float]]:
        """(lo, hi) per rejection option: ratio bounds for *_k1, (-inf, upper) for the others."""
        for option in self.reject:
            check_choice("correction.reject", option, REJECT_OPTIONS)
        if len(set(self.reject)) != len(self.reject):
            raise ConfigError(f"correction.reject={list(self.reject)} names an option twice")
        needed = sum(2 if option.endswith("k1") else 1 for option in self.reject)
        values = list(self.reject_thresholds)
        if len(values) != needed:
            raise ConfigError(
                f"correction.reject_thresholds has {len(values)} value(s) but correction.reject={list(self.reject)} "
                f"needs {needed}: two (LO HI ratio bounds) for each *_k1 option, one upper bound for the others")
        out = {}
        for option in self.reject:
            if option.endswith("k1"):
                out[option] = check_band(f"correction.reject_thresholds of {option}", (values.pop(0), values.pop(0)))
            else:
                out[option] = (-math.inf, check_threshold(option, values.pop(0)))
        return out


def check_band(field: str, band: tuple[float, float]) -> tuple[float, float]:
    lo, hi = band
    if not (lo > 0 and hi > 0):
        raise ConfigError(f"{field}=({lo!r}, {hi!r}): both bounds must be > 0 (they bound a probability ratio)")
    if not lo < hi:
        raise ConfigError(f"{field}=({lo!r}, {hi!r}): LO must be below HI")
    return float(lo), float(hi)


def check_threshold(option: str, value: float) -> float:
    if not value > 0:
        raise ConfigError(f"correction.reject_thresholds of {option}={value!r} must be > 0 (a divergence bound)")
    return float(value)


@dataclass(frozen=True)
class Correction:
    weights_BT: torch.Tensor  # float, >= 0, 0 on padding; multiplies each token's objective term
    keep_BT: torch.Tensor  # bool, False on padding and on rejected tokens
    metrics: dict[str, float]


def rollout_correction(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, cfg: CorrectionConfig) -> Correction:
    """Importance weights and the rejection mask of `log_ratio_BT = old_logp - sampler_logp` (docstring above)."""
    cfg.validate()
    mask_BT = as_bool_mask(mask_BT)
    log_ratio_BT = torch.where(mask_BT, log_ratio_BT.detach().double(), 0.0)  # padding may hold anything
    weights_BT, capped_BT, zeroed_BT = importance_weights(log_ratio_BT, mask_BT, cfg)
    keep_BT = mask_BT.clone()
    for option, (lo, hi) in cfg.bounds().items():
        keep_BT &= passes(option, log_ratio_BT, mask_BT, lo, hi)
    rejected_B = (mask_BT & ~keep_BT).any(dim=1)
    metrics = {"correction/masked_frac": masked_mean(~keep_BT, mask_BT).item(),
               "correction/seq_masked_frac": masked_mean(rejected_B, nonempty_sequences(mask_BT)).item(),
               "correction/truncated_frac": masked_mean(capped_BT, mask_BT).item(),
               "correction/zeroed_frac": masked_mean(zeroed_BT, mask_BT).item(),
               **weight_stats(weights_BT, keep_BT)}
    return Correction(weights_BT.float(), keep_BT, metrics)


def importance_weights(log_ratio_BT, mask_BT, cfg: CorrectionConfig):
    """(weights_BT, capped_BT, zeroed_BT): the weights of cfg.is_level, where TIS capped them, where IcePop zeroed
    them. `log_ratio_BT` is 0 on padding."""
    if cfg.is_level == "none":
        return mask_BT.double(), torch.zeros_like(mask_BT), torch.zeros_like(mask_BT)
    level_log_BT = log_ratio_BT
    if cfg.is_level == "sequence":
        level_log_BT = log_ratio_BT.sum(dim=1, keepdim=True).expand_as(log_ratio_BT)
    rho_BT = level_log_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    capped_BT = zeroed_BT = torch.zeros_like(mask_BT)
    if cfg.is_cap is not None:
        capped_BT = mask_BT & (rho_BT > cfg.is_cap)
        rho_BT = rho_BT.clamp(max=cfg.is_cap)
    if cfg.is_band is not None:
        lo, hi = cfg.is_band
        # Compared in log space, so a ratio beyond the clamp is still out of the band.
        zeroed_BT = mask_BT & ((level_log_BT < math.log(lo)) | (level_log_BT > math.log(hi)))
        rho_BT = torch.where(zeroed_BT, 0.0, rho_BT)
    return torch.where(mask_BT, rho_BT, 0.0), capped_BT, zeroed_BT


def token_statistic(kind: str, log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r of r = log_ratio = log pi_old - log pi_sampler, per token. k1 is
    verl's (rollout_corr_helper: -log_ratio, the log of pi_sampler / pi_old), so a k1 band LO HI keeps the tokens
    verl keeps. k3 clamps r above at LOG_RATIO_BOUND (exp would overflow; ~4.9e8 is beyond any useful threshold)
    and is exact below it (r = -50 gives 49)."""
    if kind == "k1":
        return -log_ratio_BT
    if kind == "k2":
        return 0.5 * log_ratio_BT.square()
    r_BT = log_ratio_BT.clamp(max=LOG_RATIO_BOUND)
    return torch.expm1(r_BT) - r_BT  # expm1 keeps it >= 0 and exact near r = 0


def passes(option: str, log_ratio_BT, mask_BT, lo: float, hi: float) -> torch.Tensor:
    """[B, T] bool: the tokens that pass one rejection option (True on padding; the caller ANDs the mask)."""
    *level, kind = option.split("_")
    stat_BT = token_statistic(kind, log_ratio_BT)
    # For k1 the band is on the ratio pi_sampler / pi_old: lo <= exp(stat) <= hi, i.e. log(lo) <= stat <= log(hi).
    lo, hi = (math.log(lo), math.log(hi)) if kind == "k1" else (lo, hi)
    if level == ["token"]:
        return (stat_BT >= lo) & (stat_BT <= hi) | ~mask_BT
    if stat_BT.shape[1] == 0:  # empty responses: nothing to test
        return torch.ones_like(mask_BT)
    if level == ["seq", "max"]:
        highest_B = torch.where(mask_BT, stat_BT, -math.inf).amax(dim=1)
        lowest_B = torch.where(mask_BT, stat_BT, math.inf).amin(dim=1)
        ok_B = (highest_B <= hi) & (lowest_B >= lo) if kind == "k1" else highest_B <= hi
    else:
        reduce = masked_sum if level == ["seq", "sum"] else masked_mean
        stat_B = reduce(stat_BT, mask_BT, dim=1)
        ok_B = (stat_B >= lo) & (stat_B <= hi)
    return ok_B[:, None] | ~mask_BT  # an empty sequence has max -inf, min +inf: it passes


def weight_stats(weights_BT: torch.Tensor, keep_BT: torch.Tensor) -> dict[str, float]:
    """Mean, min, max and effective sample size of the weights over the kept tokens.

    ESS = (sum w)^2 / (n sum w^2), a fraction in [0, 1]: 1 when every kept token weighs the same (no correction),
    near 1/n when one token carries all the weight; 1 with no kept token, 0 when every weight is 0."""
    n = keep_BT.sum().item()
    if n == 0:
        return {"correction/weight_mean": 1.0, "correction/weight_min": 1.0, "correction/weight_max": 1.0,
                "correction/ess": 1.0}
    w = weights_BT[keep_BT]
    square_sum = w.square().sum().item()
    return {"correction/weight_mean": w.mean().item(), "correction/weight_min": w.min().item(),
            "correction/weight_max": w.max().item(),
            "correction/ess": w.sum().item() ** 2 / (n * square_sum) if square_sum > 0 else 0.0}


def mismatch_metrics(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """Sampler vs trainer divergence of the same tokens (docs/metrics.md, "Train-inference mismatch").

    r = old_logp - sampler_logp per response token, rho = exp(r); tokens are drawn from the sampler."""
    mask_BT = as_bool_mask(mask_BT)
    r_BT = torch.where(mask_BT, log_ratio_BT.detach().double(), 0.0)
    rho_BT = r_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    seq_B = nonempty_sequences(mask_BT)
    seq_sum_B = r_BT.sum(dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    extreme_BT = (rho_BT > EXTREME_RATIO) | (rho_BT < 1 / EXTREME_RATIO)
    return {
        "rollout/log_ratio_abs_mean": masked_mean(r_BT.abs(), mask_BT).item(),
        "rollout/k1": masked_mean(-r_BT, mask_BT).item(),
        "rollout/kl": masked_mean(token_statistic("k3", r_BT), mask_BT).item(),
        "rollout/chi2_token": masked_mean(rho_BT.square(), mask_BT).item() - 1.0 if mask_BT.any() else 0.0,
        "rollout/chi2_seq": masked_mean((2 * seq_sum_B).exp(), seq_B).item() - 1.0 if seq_B.any() else 0.0,
        "rollout/ppl_ratio": masked_mean((-masked_mean(r_BT, mask_BT, dim=1)).exp(), seq_B).item()
        if seq_B.any() else 1.0,
        "rollout/extreme_frac": masked_mean(extreme_BT, mask_BT).item(),
        "rollout/ess": normalised_ess(rho_BT[mask_BT]),
    }


def normalised_ess(weights_N: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) of n importance weights: 1 when all are equal (no mismatch), 1/n when one carries
    all the weight; 1 with no weights (nothing to correct). The weights are exp of clamped log-ratios, so > 0."""
    if weights_N.numel() == 0:
        return 1.0
    return weights_N.sum().item() ** 2 / (weights_N.numel() * weights_N.square().sum().item())


def corrected_loss_inputs(advantages_B: torch.Tensor, mask_BT: torch.Tensor, corr: Correction):
    """(token advantages A_i * w_it, mask & keep): how every objective receives the correction through its one
    signature. Each objective's term is positively homogeneous in the advantage (term(c A) = c term(A) for c >= 0:
    the PPO clip's branch depends only on A's sign), so scaling A_it by w_it >= 0 multiplies the token's term by
    w_it; for the sequence-level objectives (gspo, gmpo) A_i becomes the token mean of A_i w_it, i.e. the sequence
    term times its tokens' mean weight (docs/design.md section 10; tests/rl/test_correction.py checks every
    objective)."""
    keep_BT = as_bool_mask(mask_BT) & corr.keep_BT
    advantages_BT = advantages_B[:, None].to(corr.weights_BT.dtype) * corr.weights_BT
    return torch.where(keep_BT, advantages_BT, 0.0), keep_BT
