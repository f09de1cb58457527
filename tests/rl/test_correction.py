"""Rollout correction (moe_rl.rl.correction) against hand-computed values: every weight and mask option, all-masked
sequences, empty responses, extreme log-ratios; its flags' errors; how every objective receives it."""

import contextlib
import io
import math

import pytest
import torch

from moe_rl.errors import ConfigError
from moe_rl.objectives import ObjectiveConfig, get_objective, objective_names
from moe_rl.rl.correction import (
    LOG_RATIO_BOUND,
    CorrectionConfig,
    corrected_loss_inputs,
    mismatch_metrics,
    rollout_correction,
)

ln = math.log


def lr(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def correct(log_ratio, mask=None, **cfg):
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return rollout_correction(log_ratio, mask, CorrectionConfig(**cfg))


def close(a, b):
    return torch.allclose(a.double(), torch.tensor(b, dtype=torch.float64), rtol=1e-6, atol=1e-9)


# -- importance weights ----------------------------------------------------------------------------------------


def test_no_weights_are_one_on_response_tokens_and_zero_on_padding():
    out = correct(lr([ln(3), 0.7]), [[True, False]])
    assert close(out.weights_BT, [[1.0, 0.0]]) and out.keep_BT.tolist() == [[True, False]]


def test_token_is_and_tis_cap():
    assert close(correct(lr([ln(3), ln(0.5), 0.0]), is_level="token").weights_BT, [[3, 0.5, 1]])
    out = correct(lr([ln(3), ln(0.5), 0.0]), is_level="token", is_cap=2.0)
    assert close(out.weights_BT, [[2, 0.5, 1]])
    assert out.metrics["correction/truncated_frac"] == pytest.approx(1 / 3)


def test_sequence_is_is_the_product_of_token_ratios_shared_by_the_tokens():
    out = correct(lr([ln(2), ln(1.5), 0.0], [ln(0.5), 0.0, 9.0]), [[1, 1, 1], [1, 1, 0]], is_level="sequence")
    assert close(out.weights_BT, [[3, 3, 3], [0.5, 0.5, 0]])  # the padded 9.0 counts nowhere
    capped = correct(lr([ln(2), ln(1.5)], [ln(0.5), 0.0]), is_level="sequence", is_cap=2.0)
    assert close(capped.weights_BT, [[2, 2], [0.5, 0.5]])
    assert capped.metrics["correction/truncated_frac"] == pytest.approx(0.5)


def test_icepop_band_zeroes_weights_outside_it_but_keeps_the_tokens():
    out = correct(lr([ln(3), ln(0.25), ln(1.5)]), is_level="token", is_band=(0.5, 2.0))
    assert close(out.weights_BT, [[0, 0, 1.5]])
    assert out.keep_BT.all() and out.metrics["correction/zeroed_frac"] == pytest.approx(2 / 3)
    seq = correct(lr([ln(1.5), ln(1.5)], [ln(1.5), ln(0.9)]), is_level="sequence", is_band=(0.5, 2.0))
    assert close(seq.weights_BT, [[0, 0], [1.35, 1.35]])  # 2.25 is out of the band, 1.35 in


def test_effective_sample_size_and_weight_stats():
    out = correct(lr([0.0, ln(3)]), is_level="token")
    assert out.metrics["correction/ess"] == pytest.approx(16 / 20)  # (1 + 3)^2 / (2 (1 + 9))
    assert out.metrics["correction/weight_mean"] == pytest.approx(2.0)
    assert out.metrics["correction/weight_max"] == pytest.approx(3.0)
    assert correct(lr([0.1, -0.2])).metrics["correction/ess"] == 1.0


# -- rejection masks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, thresholds, log_ratio, keep", [
    ("token_k1", (0.5, 2.0), [[ln(3), ln(0.4), ln(1.2), ln(0.5)]], [[0, 0, 1, 1]]),
    ("token_k2", (0.02,), [[0.1, 0.3, -0.1, -0.3]], [[1, 0, 1, 0]]),  # k2 = 0.005, 0.045
    ("token_k3", (0.01,), [[0.1, -0.3, 0.0, 0.2]], [[1, 0, 1, 0]]),  # k3 = 0.00517, 0.0408, 0, 0.0214
    ("seq_sum_k1", (0.5, 2.0), [[ln(1.5), ln(1.5)], [ln(1.5), ln(0.9)]], [[0, 0], [1, 1]]),  # 2.25, 1.35
    ("seq_mean_k1", (0.5, 2.0), [[ln(1.5), ln(1.5)], [ln(3), ln(3)]], [[1, 1], [0, 0]]),  # 1.5, 3
    ("seq_max_k1", (0.5, 2.0), [[ln(1.5), ln(0.4)], [ln(1.9), ln(0.6)]], [[0, 0], [1, 1]]),
    ("seq_sum_k2", (0.018,), [[0.1, 0.1, 0.1], [0.2, 0.0, 0.0]], [[1, 1, 1], [0, 0, 0]]),  # 0.015, 0.02
    ("seq_mean_k2", (0.006,), [[0.1, 0.1, 0.1], [0.2, 0.0, 0.0]], [[1, 1, 1], [0, 0, 0]]),  # 0.005, 0.00667
    ("seq_sum_k3", (0.01,), [[0.1, 0.0], [0.1, 0.1]], [[1, 1], [0, 0]]),  # 0.00517, 0.01034
    ("seq_mean_k3", (0.004,), [[0.1, 0.0], [0.1, 0.1]], [[1, 1], [0, 0]]),  # 0.00259, 0.00517
    ("seq_max_k2", (0.01,), [[0.1, -0.1], [0.0, -0.2]], [[1, 1], [0, 0]]),  # 0.005, 0.02
    ("seq_max_k3", (0.01,), [[0.1, 0.1], [0.0, 0.2]], [[1, 1], [0, 0]]),  # 0.00517, 0.0214
])
def test_each_rejection_option(option, thresholds, log_ratio, keep):
    out = correct(lr(*log_ratio), reject=(option,), reject_thresholds=thresholds)
    assert out.keep_BT.int().tolist() == keep
    kept = sum(map(sum, keep)) / sum(map(len, keep))
    assert out.metrics["correction/masked_frac"] == pytest.approx(1 - kept)


# verl's k1 statistic is -log_ratio = log(pi_sampler / pi_old): an asymmetric band LO HI bounds exp(-r) (tokens),
# exp(-sum r) and exp(-mean r) (sequences), never rho = exp(r). Each row below would be kept the other way round
# by a band on rho; the ratios pi_sampler / pi_old are worked out by hand in the comments.
@pytest.mark.parametrize("option, rho, keep", [
    # exp(-r) = 1/rho = 0.556, 1.818, 0.625, 2.222, 1.0; in [0.6, 2.0]: no, yes, yes, no, yes
    ("token_k1", [[1.8, 0.55, 1.6, 0.45, 1.0]], [[0, 1, 1, 0, 1]]),
    # exp(-sum r) = 1 / (1.3 * 1.3) = 0.592 (out), 1 / 0.64 = 1.5625 (in), 1 / 0.56 = 1.786 (in)
    ("seq_sum_k1", [[1.3, 1.3], [0.8, 0.8], [0.7, 0.8]], [[0, 0], [1, 1], [1, 1]]),
    # exp(-mean r) = 1 / 1.7 = 0.588 (out), 1 / 0.55 = 1.818 (in), 1 / sqrt(0.9 * 0.5) = 1.491 (in)
    ("seq_mean_k1", [[1.7, 1.7], [0.55, 0.55], [0.9, 0.5]], [[0, 0], [1, 1], [1, 1]]),
    # every exp(-r) in the band: (1.818, 0.667) yes; (0.556, 1.0) no; (2.222, 1.0) no
    ("seq_max_k1", [[0.55, 1.5], [1.8, 1.0], [0.45, 1.0]], [[1, 1], [0, 0], [0, 0]]),
])
def test_k1_bands_bound_the_sampler_over_trainer_ratio_as_verl_does(option, rho, keep):
    log_ratio = lr(*[[ln(x) for x in row] for row in rho])
    out = correct(log_ratio, reject=(option,), reject_thresholds=(0.6, 2.0))
    assert out.keep_BT.int().tolist() == keep


def test_combined_masks_must_all_pass():
    log_ratio = lr([ln(1.3), 0.0], [0.0, 0.0], [ln(1.25), ln(1.25)])
    out = correct(log_ratio, reject=("token_k1", "seq_mean_k3"), reject_thresholds=(0.8, 1.25, 0.022))
    # row 0: token 0 is out of the ratio band, its mean k3 0.0188 passes; row 2: both tokens are in the band
    # (bounds included) but their mean k3 = 1.25 - 1 - ln 1.25 = 0.0269 rejects the sequence
    assert out.keep_BT.int().tolist() == [[0, 1], [1, 1], [0, 0]]
    assert out.metrics["correction/seq_masked_frac"] == pytest.approx(2 / 3)


def test_rejection_sees_only_real_tokens():
    out = correct(lr([0.0, 5.0]), [[True, False]], reject=("seq_max_k2",), reject_thresholds=(0.1,))
    assert out.keep_BT.tolist() == [[True, False]]  # the padded 5.0 does not reject the sequence


# -- degenerate and extreme inputs -------------------------------------------------------------------------------

ALL_OPTIONS = dict(reject=("token_k1", "seq_sum_k2", "seq_mean_k3", "seq_max_k3", "seq_max_k1"),
                   reject_thresholds=(0.5, 2.0, 1.0, 1.0, 1.0, 0.5, 2.0))


def finite(out):
    return torch.isfinite(out.weights_BT).all() and all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("level", [dict(), dict(is_level="token", is_cap=2.0), dict(is_level="sequence"),
                                   dict(is_level="token", is_band=(0.5, 2.0))])
def test_all_masked_sequences_and_empty_responses_give_no_nan(level):
    masked = correct(lr([float("nan"), float("-inf")], [0.1, 0.0]), [[False, False], [True, True]], **level,
                     **ALL_OPTIONS)
    assert finite(masked) and masked.weights_BT[0].tolist() == [0.0, 0.0] and not masked.keep_BT[0].any()
    for shape in ((3, 0), (0, 4)):
        empty = rollout_correction(torch.zeros(shape), torch.zeros(shape, dtype=torch.bool),
                                   CorrectionConfig(**level, **ALL_OPTIONS))
        assert finite(empty) and empty.weights_BT.shape == shape and empty.metrics["correction/ess"] == 1.0
    empty_metrics = mismatch_metrics(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool))
    assert all(math.isfinite(v) for v in empty_metrics.values())


def test_extreme_log_ratios_give_finite_weights():
    bound = math.exp(LOG_RATIO_BOUND)
    token = correct(lr([50.0, -50.0]), is_level="token")
    assert close(token.weights_BT, [[bound, 1 / bound]]) and finite(token)
    assert token.weights_BT.dtype == torch.float32 and torch.isfinite(token.weights_BT).all()
    assert close(correct(lr([50.0, -50.0]), is_level="token", is_cap=2.0).weights_BT, [[2.0, 1 / bound]])
    assert close(correct(lr([50.0] * 100), is_level="sequence").weights_BT, [[bound] * 100])
    band = correct(lr([50.0, -50.0, 0.0]), is_level="token", is_band=(0.5, 2.0))
    assert close(band.weights_BT, [[0, 0, 1]])
    k3 = correct(lr([-50.0], [0.0]), reject=("token_k3",), reject_thresholds=(48.0,))
    assert k3.keep_BT.tolist() == [[False], [True]]  # k3(-50) = exp(-50) - 1 + 50 = 49, exact below the bound
    assert finite(correct(lr([50.0, -50.0]), is_level="sequence", **ALL_OPTIONS))
    extreme_metrics = mismatch_metrics(lr([50.0, -50.0]), torch.ones(1, 2, dtype=torch.bool))
    assert all(math.isfinite(v) for v in extreme_metrics.values())


# -- mismatch metrics --------------------------------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    r = lr([ln(2), ln(0.5)], [ln(3), 0.0])
    m = mismatch_metrics(r, torch.tensor([[True, True], [True, False]]))
    tokens = [ln(2), ln(0.5), ln(3)]
    assert m["rollout/k1"] == pytest.approx(-sum(tokens) / 3)
    assert m["rollout/kl"] == pytest.approx(((2 - 1 - ln(2)) + (0.5 - 1 - ln(0.5)) + (3 - 1 - ln(3))) / 3)
    assert m["rollout/chi2_token"] == pytest.approx((4 + 0.25 + 9) / 3 - 1)
    assert m["rollout/chi2_seq"] == pytest.approx((1 + 9) / 2 - 1)  # (2 * 0.5)^2 and 3^2
    assert m["rollout/ppl_ratio"] == pytest.approx((1 + 1 / 3) / 2)  # exp(-mean r) per sequence
    assert m["rollout/extreme_frac"] == pytest.approx(1 / 3)  # 3 > 2; 2 and 0.5 are not beyond the bounds
    assert m["rollout/log_ratio_abs_mean"] == pytest.approx(sum(map(abs, tokens)) / 3)
    # normalised ESS of the raw ratios 2, 0.5, 3: (5.5)^2 / (3 * (4 + 0.25 + 9)) = 30.25 / 39.75
    assert m["rollout/ess"] == pytest.approx(30.25 / 39.75)
    assert mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))["rollout/ess"] == 1.0
    assert mismatch_metrics(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool))["rollout/ess"] == 1.0


# -- the flags ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, named", [
    (dict(is_level="token", is_cap=2.0, is_band=(0.5, 2.0)), "cannot be combined"),
    (dict(is_cap=2.0), "need correction.is_level"),
    (dict(is_level="token", is_cap=0.0), "is_cap=0.0 must be > 0"),
    (dict(is_level="token", is_band=(2.0, 0.5)), "LO must be below HI"),
    (dict(reject=("token_k1",), reject_thresholds=(2.0,)), "needs 2"),
    (dict(reject=("token_k2",), reject_thresholds=()), "needs 1"),
    (dict(reject=("token_k3",), reject_thresholds=(0.0,)), "must be > 0"),
    (dict(reject=("seq_sum_k1",), reject_thresholds=(-1.0, 2.0)), "must be > 0"),
    (dict(reject=("token_k4",), reject_thresholds=(1.0,)), "choose one of"),
])
def test_bad_combinations_are_named_errors(kw, named):
    with pytest.raises(ConfigError, match=named):
        CorrectionConfig(**kw).validate()
    with pytest.raises(ConfigError, match=named):
        rollout_correction(torch.zeros(1, 1), torch.ones(1, 1), CorrectionConfig(**kw))


@pytest.mark.parametrize("flags, named", [
    (["--correction.is-level", "token", "--correction.is-cap", "2", "--correction.is-band", "0.5", "2"],
     "correction.is_cap and correction.is_band"),
    (["--correction.reject", "token_k1", "--correction.reject-thresholds", "2"], "needs 2"),
    (["--correction.reject", "seq_max_k3", "--correction.reject-thresholds", "0"], "must be > 0"),
])
def test_cli_bad_correction_is_one_named_line_exit_2(tmp_path, flags, named):
    from moe_rl.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--out-dir", str(tmp_path / "run"), *flags])
    assert code == 2 and err.getvalue().count("\n") == 1 and named in err.getvalue()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- how the objectives receive it -------------------------------------------------------------------------------


def objective_inputs(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    return logp, old, torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64), mask


@pytest.mark.parametrize("name", objective_names())
def test_every_objective_scales_with_a_constant_weight(name):
    # term(c A) = c term(A), c >= 0: what lets every objective take the weights through its advantages.
    logp, old, adv, mask = objective_inputs()
    spec, cfg = get_objective(name), ObjectiveConfig(name=name)
    base = spec(logp, old, adv, mask, cfg)[0]
    scaled = spec(logp, old, adv[:, None].expand(4, 5) * 2.5, mask, cfg)[0]
    assert scaled.item() == pytest.approx(2.5 * base.item(), rel=1e-9, abs=1e-12)
    assert spec(logp, old, adv[:, None].expand(4, 5) * 0.0, mask, cfg)[0].item() == pytest.approx(0.0, abs=1e-12)


def test_grpo_with_token_weights_and_rejection_by_hand():
    logp, old, adv, mask = objective_inputs()
    log_ratio = torch.linspace(-1.0, 1.0, 20, dtype=torch.float64).view(4, 5)
    corr = rollout_correction(log_ratio, mask, CorrectionConfig(is_level="token", is_cap=2.0, reject=("token_k1",),
                                                                reject_thresholds=(0.45, 2.5)))
    adv_BT, keep = corrected_loss_inputs(adv, mask, corr)
    loss = get_objective("grpo")(logp, old, adv_BT, keep, ObjectiveConfig(name="grpo"))[0]
    w = torch.exp(logp.detach() - old)
    expected, rows = 0.0, 0
    for i in range(4):
        terms = []
        for t in range(5):
            if not keep[i, t]:
                continue
            c, a = min(math.exp(log_ratio[i, t]), 2.0), adv[i].item()
            terms.append(-c * min(w[i, t] * a, w[i, t].clamp(0.8, 1.27) * a))
        if terms:
            expected, rows = expected + sum(terms) / len(terms), rows + 1
    assert not keep.all() and keep.any()  # the test exercises both
    assert loss.item() == pytest.approx((expected / rows).item(), rel=1e-6)  # the weights are float32


def test_gspo_takes_the_mean_weight_of_a_sequence():
    logp, old, adv, mask = objective_inputs()
    mask = torch.ones_like(mask)
    weights = torch.tensor([[1.0, 2.0, 3.0, 2.0, 2.0]] * 4, dtype=torch.float64)  # mean 2 in every row
    corr = rollout_correction(weights.log(), mask, CorrectionConfig(is_level="token"))
    adv_BT, keep = corrected_loss_inputs(adv, mask, corr)
    spec, cfg = get_objective("gspo"), ObjectiveConfig(name="gspo")
    assert spec(logp, old, adv_BT, keep, cfg)[0].item() == pytest.approx(2 * spec(logp, old, adv, mask, cfg)[0].item(),
                                                                        rel=1e-6)


def test_the_trainer_loss_takes_the_weights_and_the_kept_tokens(tmp_path):
    from dataclasses import replace

    from conftest import tiny_train_config

    from moe_rl.rl.correction import Correction
    from moe_rl.rl.policy import policy_forward
    from moe_rl.rl.trainer import Trainer

    trainer = Trainer(tiny_train_config(tmp_path / "run"), torch.device("cpu"))
    batch, _ = trainer.rollout()
    batch = replace(batch, advantages_B=torch.linspace(-1.0, 1.0, batch.size))
    out = policy_forward(trainer.model, batch, 1.0)
    old_logp = out.logp_BN.detach() + 0.05  # ratios away from 1, inside GRPO's clip range
    mask = batch.response_mask_BN

    def loss(correction, rows=batch):
        return trainer._loss(out if rows is batch else policy_forward(trainer.model, rows, 1.0), rows,
                             old_logp if rows is batch else old_logp[1:], None, None, correction)[1]["loss"]

    plain = loss(None)
    doubled = loss(Correction(torch.where(mask, 2.0, 0.0), mask.clone(), {}))
    assert plain != 0 and doubled == pytest.approx(2 * plain, rel=1e-6)
    keep = mask.clone()
    keep[0] = False  # rejecting row 0 is training on the other rows
    rest = loss(None, rows=batch.rows(torch.arange(1, batch.size)))
    assert loss(Correction(mask.float(), keep, {})) == pytest.approx(rest, rel=1e-6)
