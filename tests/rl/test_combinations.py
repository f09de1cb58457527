"""Every pair of objective, routing mode and rollout correction runs 2 rollout steps through the `moe-rl train` command
(in process, through moe_rl.cli.main, as the entry point calls it), and so does every sampler precision arm and
replay variant. A tiny model (2 blocks of 4 experts, 4 rows of up to 4 tokens) keeps a run under a second."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from moe_rl.cli import main
from moe_rl.objectives import objective_names
from moe_rl.runs.runlog import read_metrics

TINY = ["--model.d-model", "16", "--model.n-layers", "2", "--model.n-heads", "2", "--model.n-kv-heads", "1",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "16", "--model.d-dense", "32"]
BASE = ["train", *TINY, "--rollout.prompts-per-step", "2", "--rollout.group-size", "2", "--minibatches", "2",
        "--rollout.sampling.max-new-tokens", "4", "--total-steps", "2", "--log.samples-every", "0", "--quiet"]
CORRECTIONS = {
    "none": [],
    "token_tis": ["--correction.is-level", "token", "--correction.is-cap", "2"],
    "sequence_tis": ["--correction.is-level", "sequence", "--correction.is-cap", "2"],
    "icepop": ["--correction.is-level", "token", "--correction.is-band", "0.5", "2"],
    "reject": ["--correction.reject", "token_k1", "seq_max_k3", "--correction.reject-thresholds", "0.5", "2", "0.5"],
}
ROUTING_MODES = ("native", "R2", "R3")
VARIANTS = {
    "fp16": ["--rollout.sampling.precision", "fp16"],
    "fp8": ["--rollout.sampling.precision", "fp8", "--routing-mode", "R3"],
    "exact": ["--rollout.sampling.precision", "exact", "--routing-mode", "R3", "--correction.is-level", "token"],
    "R3 gate weights": ["--routing-mode", "R3", "--replay.gate-weights"],
    "R2 margin": ["--routing-mode", "R2", "--replay.margin-threshold", "0.05"],
    "R3 margin + weights": ["--routing-mode", "R3", "--replay.margin-threshold", "0.05", "--replay.gate-weights"],
    "keep sampling mask": ["--rollout.sampling.top-p", "0.8", "--rollout.sampling.keep-sampling-mask",
                           "--correction.is-level", "token", "--correction.is-cap", "2"],
}


def run_train(out_dir, flags: list[str]) -> list[dict]:
    """`moe-rl train` on the tiny set-up with `flags`; its metrics lines (the command must exit 0)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([*BASE, "--out-dir", str(out_dir), *flags])
    assert code == 0, f"{flags}: exit {code}: {err.getvalue()[-2000:]}"
    lines = read_metrics(out_dir)
    assert sorted({line["step"] for line in lines}) == [0, 1], flags
    for line in lines:
        if line["minibatch"] >= 0:  # (-1: a step whose groups DAPO all dropped, or the final evaluation)
            assert math.isfinite(line["loss/total"]) and math.isfinite(line["grad_norm"]), flags
            assert math.isfinite(line["rollout/kl"]) and math.isfinite(line["correction/ess"]), flags
    return lines


def all_pairs() -> list[tuple[str, str, str]]:
    """(objective, routing mode, correction) such that every objective meets every mode and every correction, and
    every mode every correction: each objective with each correction (7 x 5), the mode cycling with both indices
    (7 and 5 are coprime to 3, so for a fixed objective or a fixed correction the mode takes all three values).
    35 runs instead of the 105 of the full product, which cost about a minute of the suite."""
    return [(objective, ROUTING_MODES[(i + j) % len(ROUTING_MODES)], correction)
            for i, objective in enumerate(objective_names()) for j, correction in enumerate(CORRECTIONS)]


def test_the_combinations_cover_every_pair():
    combos = all_pairs()
    pairs = [{(o, m) for o, m, _ in combos}, {(o, c) for o, _, c in combos}, {(m, c) for _, m, c in combos}]
    n_objectives, n_modes, n_corrections = len(objective_names()), len(ROUTING_MODES), len(CORRECTIONS)
    assert [len(p) for p in pairs] == [n_objectives * n_modes, n_objectives * n_corrections, n_modes * n_corrections]


@pytest.mark.slow
def test_every_pair_of_objective_routing_mode_and_correction_runs_two_steps(tmp_path):
    for objective, mode, name in all_pairs():
        run_train(tmp_path / f"{objective}-{mode}-{name}",
                  ["--objective.name", objective, "--routing-mode", mode, "--rollout.sampling.precision", "bf16",
                   *CORRECTIONS[name]])


@pytest.mark.parametrize("name", VARIANTS)
def test_each_precision_arm_and_replay_variant_runs_two_steps(tmp_path, name):
    lines = run_train(tmp_path / "run", VARIANTS[name])
    if name == "exact":
        assert all(line["rollout/log_ratio_abs_mean"] == 0.0 for line in lines)
    if "margin" in name:  # (under R2 update 0 runs natively: replaying its own routing changes nothing)
        assert all(0 <= line["routing/margin_replay/replayed_frac"] <= 1 for line in lines if line["minibatch"] >= 1)
