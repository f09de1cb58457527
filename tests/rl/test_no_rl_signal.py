"""Churn without RL signal is said (issue 52, item 4): an update whose advantages are all zero (every group's rewards
equal) gets churn/no_rl_signal = 1 in metrics.jsonl, a note on its progress line, a note in `moe-rl probe`'s output
and a section in `moe-rl report`; an update with reward variance gets none of them.

A randomly initialised tiny model solves nothing (reward 0 everywhere): its updates have no RL signal. The shared
warm start (about 0.2 reward) has groups with mixed rewards: with one minibatch per rollout step, each update sees
them all and has a signal."""

from __future__ import annotations

import pytest
import torch
from conftest import metric_lines, tiny_train_config

from moe_rl.analysis.report import ReportConfig, report
from moe_rl.commands.probe import ProbeCommandConfig, probe
from moe_rl.commands.train import train
from moe_rl.model import ModelConfig
from moe_rl.rl.distributed import reduction
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import RolloutConfig
from moe_rl.rl.trainer import no_rl_signal
from moe_rl.runs.progress import NO_RL_SIGNAL, no_rl_signal_note

ROLLOUT = RolloutConfig(prompts_per_step=8, group_size=4, sampling=SamplingConfig(max_new_tokens=6))


class _Batch:
    def __init__(self, advantages_B):
        self.advantages_B = torch.tensor(advantages_B)


def test_the_flag_is_one_only_when_every_advantage_of_the_update_is_zero():
    batch = _Batch([0.0, 0.0, 0.7, -0.7])
    assert no_rl_signal(batch, torch.tensor([0, 1])) == 1.0
    assert no_rl_signal(batch, torch.tensor([1, 2])) == 0.0
    assert no_rl_signal(batch, None) == 1.0  # a data-parallel rank without rows contributes no signal
    assert reduction("churn/no_rl_signal") == "min"  # the step has none only when no rank has any


def test_the_progress_note_counts_the_updates_without_signal():
    assert no_rl_signal_note([{"churn/no_rl_signal": 1.0}, {"churn/no_rl_signal": 1.0}]) == NO_RL_SIGNAL
    assert no_rl_signal_note([{"churn/no_rl_signal": 1.0}, {"churn/no_rl_signal": 0.0}]) == \
        f"{NO_RL_SIGNAL} in 1/2 updates"
    assert no_rl_signal_note([{"churn/no_rl_signal": 0.0}, {"reward": 0.5}]) is None


@pytest.mark.slow
def test_a_run_with_constant_rewards_is_flagged_in_metrics_progress_and_report(tmp_path, capsys):
    run = train(tiny_train_config(tmp_path / "runs" / "flat", total_steps=2, minibatches=2, rollout=ROLLOUT))
    lines = metric_lines(run)
    assert [line["frac_reward_zero_std"] for line in lines] == [1.0] * 4  # the premise: no reward variance
    assert [line["loss"] for line in lines] == [0.0] * 4
    assert [line["churn/no_rl_signal"] for line in lines] == [1.0] * 4
    printed = capsys.readouterr().out.splitlines()
    steps = [line for line in printed if line.startswith("step ")]
    assert len(steps) == 2 and all(f"  {NO_RL_SIGNAL}  " in line for line in steps)
    explained = [line for line in printed if line.strip().startswith(f"{NO_RL_SIGNAL}:")]
    assert len(explained) == 1 and "load-balancing loss" in explained[0]  # once, after the first such step

    report(ReportConfig(runs=str(tmp_path / "runs"), out=str(tmp_path / "report")))
    readme = (tmp_path / "report" / "README.md").read_text()
    assert "## Churn without RL signal" in readme and "- flat: 4 of 4 updates (rollout steps 0, 1)" in readme
    assert "churn without RL signal" in capsys.readouterr().out


def test_the_probe_says_its_updates_had_no_signal(tmp_path, capsys):
    rows = probe(ProbeCommandConfig(out=str(tmp_path / "probe"), updates=2, device="cpu", rollout=ROLLOUT,
                                    model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4,
                                                      top_k=2, d_expert=32, d_dense=64)))
    assert [row["no_rl_signal"] for row in rows if row["layer"] == "all"] == [1.0, 1.0]
    assert f"{NO_RL_SIGNAL}: every group's rewards were equal" in capsys.readouterr().out


@pytest.mark.slow
def test_a_learning_run_is_not_flagged(tmp_path, capsys, sft_checkpoint):
    run = train(tiny_train_config(tmp_path / "runs" / "learning", total_steps=2, minibatches=1,
                                  init_from=str(sft_checkpoint), rollout=ROLLOUT))
    lines = metric_lines(run)
    assert all(line["frac_reward_zero_std"] < 1 for line in lines)  # the premise: some group's rewards differ
    assert [line["churn/no_rl_signal"] for line in lines] == [0.0, 0.0]
    assert NO_RL_SIGNAL not in capsys.readouterr().out
    report(ReportConfig(runs=str(tmp_path / "runs"), out=str(tmp_path / "report")))
    assert "without RL signal" not in (tmp_path / "report" / "README.md").read_text()
