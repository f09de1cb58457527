"""The RL loop: on-policy exactness, replay modes, learning, resume, divergence, bad input, the real command."""

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from conftest import TINY_MODEL, metric_lines, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig
from moe_rl.objectives import ObjectiveConfig
from moe_rl.rl.probes import ProbeConfig
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import OptimConfig, RolloutConfig
from moe_rl.runs.checkpoint import load_latest
from moe_rl.runs.runlog import read_manifest, read_metrics
from moe_rl.tasks import TaskConfig, build_task


def test_first_minibatch_is_exactly_on_policy(tmp_path):
    run = train(tiny_train_config(tmp_path / "run", total_steps=2, optim=OptimConfig(lr=3e-3)))
    for line in metric_lines(run, minibatch=0):
        assert line["ratio/log_abs_max"] == 0.0 and line["kl"] == 0.0
        assert line["ratio/min"] == line["ratio/max"] == 1.0
        assert line["clip_ratio/region_mean"] == 0.0
    off_policy = metric_lines(run, minibatch=3)
    assert all(line["ratio/log_abs_max"] > 0 for line in off_policy), "later minibatches must be off-policy"


def test_r2_replays_the_old_pass_routing_exactly_on_the_first_minibatch(tmp_path):
    run = train(tiny_train_config(tmp_path / "run", total_steps=2, routing_mode="R2", optim=OptimConfig(lr=3e-3)))
    for line in metric_lines(run, minibatch=0):
        assert line["routing/replay/churn"] == 0.0
        assert line["ratio/log_abs_max"] == 0.0
    # Later minibatches replay theta_old's routing while theta has moved: the routers disagree somewhere.
    assert max(line["routing/replay/set_change"] for line in metric_lines(run)) > 0


def test_r3_old_pass_reproduces_the_sampler_logprobs(tmp_path):
    run = train(tiny_train_config(tmp_path / "run", total_steps=2, routing_mode="R3"))
    for line in metric_lines(run):
        assert line["rollout/log_ratio_abs_mean"] < 1e-5
        assert line["routing/rollout/churn"] == 0.0  # CPU: the sampler routes exactly like the trainer


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_learning_raises_reward_on_a_fixed_prompt_set(tmp_path, sft_checkpoint, objective):
    task = build_task(TaskConfig())
    path = tmp_path / "problems.jsonl"
    with open(path, "w") as f:
        for i in range(16):
            problem = task.problem("train", 100_000 + i)
            f.write(json.dumps({"prompt": problem.prompt, "answer": problem.answer}) + "\n")
    cfg = tiny_train_config(
        tmp_path / objective, total_steps=60, init_from=str(sft_checkpoint),
        task=TaskConfig(source="file", path=str(path), eval_fraction=0.2),
        rollout=RolloutConfig(prompts_per_step=8, group_size=8, sampling=SamplingConfig(max_new_tokens=6)),
        objective=ObjectiveConfig(name=objective), probes=ProbeConfig(enabled=()),
    )
    rewards = [line["reward"] for line in metric_lines(train(cfg), minibatch=0)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first > 0.15, f"{objective}: mean reward {first:.3f} -> {last:.3f}"


def test_parameters_change_after_one_step(tmp_path, sft_checkpoint):
    # From the warm start, rewards differ within groups, so every parameter gets a policy gradient.
    cfg = tiny_train_config(tmp_path / "run", total_steps=1, init_from=str(sft_checkpoint))
    initial = torch.load(sft_checkpoint, weights_only=True)["model"]
    trained = load_latest(train(cfg))["model"]
    changed = [name for name, value in initial.items() if not torch.equal(value, trained[name])]
    assert len(changed) == len(initial), f"unchanged: {set(initial) - set(changed)}"


def _comparable(lines):
    return [{k: v for k, v in line.items() if not k.startswith("time/") and k != "wall_time"} for line in lines]


def test_resumed_run_matches_an_uninterrupted_one(tmp_path):
    common = dict(checkpoint_every=1, log=dict(eval_every=2, samples_every=1))
    from moe_rl.rl.run_config import LogConfig

    common["log"] = LogConfig(eval_every=2, eval_prompts=8, samples_every=1)
    full = train(tiny_train_config(tmp_path / "full", total_steps=4, **common))
    train(tiny_train_config(tmp_path / "half", total_steps=2, **common))
    resumed = train(tiny_train_config(tmp_path / "half", total_steps=4, resume=True, **common))
    full_lines, resumed_lines = _comparable(metric_lines(full)), _comparable(metric_lines(resumed))
    assert len(full_lines) == len(resumed_lines) == 4 * 4 + 1  # 4 steps x 4 minibatches + final eval
    assert full_lines == resumed_lines
    assert read_manifest(resumed)["status"] == "finished" and len(read_manifest(resumed)["resumes"]) == 1


def test_non_finite_loss_ends_the_run_as_diverged(tmp_path):
    cfg = tiny_train_config(tmp_path / "run", optim=OptimConfig(lr=1e30, grad_clip=0.0))
    run = train(cfg)
    manifest = read_manifest(run)
    assert manifest["status"] == "diverged"
    assert "non-finite" in manifest["reason"]
    last = metric_lines(run)[-1]
    assert not (math.isfinite(last["loss/total"]) and math.isfinite(last["grad_norm"]))


def test_dapo_drops_zero_std_groups_before_the_update(tmp_path, sft_checkpoint):
    cfg = tiny_train_config(tmp_path / "run", total_steps=3, init_from=str(sft_checkpoint),
                            objective=ObjectiveConfig(name="dapo"))
    for line in metric_lines(train(cfg)):
        if "dapo/kept_frac" in line:
            assert line["dapo/kept_frac"] == pytest.approx(1 - line["frac_reward_zero_std"])


# --- bad input --------------------------------------------------------------------------------------------


def test_unknown_objective_lists_the_valid_names():
    with pytest.raises(ConfigError, match="grpo.*gspo"):
        ObjectiveConfig(name="ppo2")


def test_unknown_routing_mode_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="routing_mode='R4'.*'native', 'R2', 'R3'"):
        tiny_train_config(tmp_path, routing_mode="R4")


@pytest.mark.parametrize("kw", [dict(clip_low=-0.1), dict(clip_high=-1.0), dict(clip_low=1.5)])
def test_negative_or_inverted_clip_range_is_refused(kw):
    with pytest.raises(ConfigError, match="clip_"):
        ObjectiveConfig(name="grpo", **kw)


def test_minibatches_must_divide_the_rollout_batch(tmp_path):
    with pytest.raises(ConfigError, match="minibatches=3"):
        tiny_train_config(tmp_path, minibatches=3)


def test_resume_of_a_missing_directory_says_there_is_nothing_to_resume(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(tiny_train_config(tmp_path / "run", resume=True))


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path, resume):
    cfg = tiny_train_config(tmp_path / "run", total_steps=1)
    train(cfg)
    (tmp_path / "run" / "checkpoints" / "latest.pt").unlink()
    manifest = read_manifest(tmp_path / "run")
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    train(tiny_train_config(tmp_path / "run", total_steps=1, resume=resume))
    manifest = read_manifest(tmp_path / "run")
    assert manifest["status"] == "finished" and manifest["earlier_attempts"][0]["status"] == "running"
    assert [line["step"] for line in read_metrics(tmp_path / "run")] == [0] * cfg.minibatches  # one attempt's lines


def test_init_from_a_different_architecture_names_the_field(tmp_path, sft_checkpoint):
    cfg = tiny_train_config(tmp_path / "run", init_from=str(sft_checkpoint),
                            model=ModelConfig(**{**TINY_MODEL, "n_experts": 8}))
    with pytest.raises(ConfigError, match="n_experts"):
        train(cfg)


# --- the real command ---------------------------------------------------------------------------------------


def _moe_rl(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_help_documents_every_group():
    out = _moe_rl("train", "--help", cwd=".")
    assert out.returncode == 0
    for flag in ("--routing-mode", "--objective.name", "--probes.enabled", "--model.n-experts", "--task.name"):
        assert flag in out.stdout


def test_cli_bad_value_exits_2_with_the_field(tmp_path):
    out = _moe_rl("train", "--out-dir", str(tmp_path / "r"), "--routing-mode", "R4", cwd=tmp_path)
    assert out.returncode == 2
    # a Literal field: tyro refuses it while parsing, naming the flag and listing the choices
    assert "'R4'" in out.stderr and "--routing-mode" in out.stderr and "'native', 'R2', 'R3'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_cli_sft_then_train_end_to_end(tmp_path):
    model = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-experts", "4", "--model.d-expert", "32"]
    sft = _moe_rl("sft", "--out-dir", "sft", "--total-steps", "20", "--log.eval-every", "10", "--log.eval-prompts", "8",
                  *model,
                  cwd=tmp_path)
    assert sft.returncode == 0, sft.stderr
    rl = _moe_rl("train", "--out-dir", "rl", "--init-from", "sft/checkpoints/latest.pt", "--total-steps", "2",
                 "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", *model, cwd=tmp_path)
    assert rl.returncode == 0, rl.stderr
    assert read_manifest(tmp_path / "rl")["status"] == "finished"
    assert len(metric_lines(tmp_path / "rl")) == 2 * 4
    assert (tmp_path / "rl" / "checkpoints" / "latest.pt").exists()


def test_cli_config_file_is_the_default_and_flags_override_it(tmp_path):
    from moe_rl.runs.runlog import config_to_dict

    saved = tiny_train_config("ignored", routing_mode="R2", total_steps=5, kl_coef=0.1)
    (tmp_path / "cfg.json").write_text(json.dumps(config_to_dict(saved)))
    out = _moe_rl("train", "--config-file", "cfg.json", "--out-dir", "run", "--total-steps", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ran = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (ran["routing_mode"], ran["kl_coef"], ran["total_steps"]) == ("R2", 0.1, 1)
    assert ran["model"]["d_model"] == saved.model.d_model
    missing = _moe_rl("train", "--config-file", cwd=tmp_path)
    assert missing.returncode == 2 and "--config-file needs a path" in missing.stderr


@pytest.mark.parametrize("sequences", [None, 5])
def test_old_pass_keeps_router_entropy_only_when_the_probes_reuse_it(tmp_path, sequences):
    """The probes reuse the old pass (and its router entropy) only when they take the whole batch; otherwise the
    old pass skips the entropy and the probes compute it on their own rows."""
    from moe_rl.rl.trainer import Trainer

    cfg = tiny_train_config(tmp_path / "run", probes=ProbeConfig(sequences=sequences))
    trainer = Trainer(cfg, torch.device("cpu"))
    batch, _ = trainer.rollout()
    batch, chunks = trainer.minibatch_chunks(batch, cfg.minibatches)
    old = trainer.old_pass(batch, chunks)
    assert (old.router_entropy_LBS is not None) == (sequences is None)
    if sequences is None:
        assert old.router_entropy_LBS.shape == old.trace.ids_LBSK.shape[:3]


@pytest.mark.parametrize("routing_mode, probe_rows, kl_coef", [("native", 5, 0.0), ("R2", None, 0.0),
                                                               ("R3", 5, 0.1)])
def test_old_pass_running_update_0s_forward_changes_no_number(tmp_path, routing_mode, probe_rows, kl_coef,
                                                              monkeypatch):
    """Chunk 0 of the old pass, run once with autograd, serves as update 0's forward: every metric (the replay
    probe's too), every routing table row and every weight must be those of the run that repeats the forward, and
    the step must run one forward fewer."""
    import moe_rl.rl.trainer
    from moe_rl.rl.trainer import Trainer

    forwards = []
    real_forward = moe_rl.rl.trainer.policy_forward

    def counting_forward(*args, **kwargs):
        forwards.append(torch.is_grad_enabled())
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(moe_rl.rl.trainer, "policy_forward", counting_forward)
    runs = {}
    for reuse in (True, False):
        cfg = tiny_train_config(tmp_path / str(reuse), routing_mode=routing_mode, kl_coef=kl_coef,
                                probes=ProbeConfig(sequences=probe_rows), optim=OptimConfig(lr=3e-3))
        trainer = Trainer(cfg, torch.device("cpu"))
        trainer.reuse_first_forward = reuse
        lines = []
        forwards.clear()
        for _ in range(2):
            trainer.rl_step(lines.append)
            trainer.step += 1
        tables = [pd.read_parquet(path) for path in sorted((tmp_path / str(reuse)).glob("routing/*.parquet"))]
        runs[reuse] = (_comparable(lines), {k: v.clone() for k, v in trainer.model.state_dict().items()},
                       list(forwards), tables)
    (lines_reused, weights_reused, forwards_reused, tables_reused), (
        lines_repeated, weights_repeated, forwards_repeated, tables_repeated) = runs[True], runs[False]
    assert lines_reused == lines_repeated
    assert len(tables_reused) == len(tables_repeated) == 2
    assert all(a.equals(b) for a, b in zip(tables_reused, tables_repeated))
    assert weights_reused.keys() == weights_repeated.keys()
    assert all(torch.equal(weights_reused[k], weights_repeated[k]) for k in weights_reused)
    trainer_forwards = 2 * (2 + (kl_coef > 0)) * cfg.minibatches  # per step: old pass, updates (and reference)
    assert len(forwards_repeated) == trainer_forwards and len(forwards_reused) == trainer_forwards - 2
    if routing_mode == "R2":
        assert all(line["routing/replay/churn"] == 0.0 for line in lines_reused if line["minibatch"] == 0)
