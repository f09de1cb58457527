"""Held-out evaluation with power and `moe-rl evaluate`: the numbers against independent computations.

Greedy accuracy against our own argmax decoding loop (no KV cache), the standard error against the textbook formula,
the three task splits disjoint (and train and eval exactly the prompts they were before validation existed), the
temperature chosen on validation and never on held-out, the command's --help and errors, and what training logs.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import metric_lines, tiny_config, tiny_train_config

import moe_rl.commands.evaluate as evaluate_module
import moe_rl.rl.heldout as evaluation
from moe_rl.analysis.baseline import against_baseline, baseline_markdown, read_baseline, with_baseline
from moe_rl.cli import main
from moe_rl.commands.evaluate import EvaluateConfig, evaluate, pick_best, read_checkpoint
from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.rl.build import build_model
from moe_rl.rl.heldout import Accuracy, accuracy, greedy, heldout_metrics, mean_and_se
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate, sampled_reward
from moe_rl.rl.run_config import LogConfig
from moe_rl.runs.checkpoint import save_checkpoint
from moe_rl.tasks import FileTask, TaskConfig, build_task, build_tokenizer
from moe_rl.tasks.gym import HELD_OUT_RESERVE, in_eval

REPO = Path(__file__).resolve().parents[2]
SAMPLING = SamplingConfig(max_new_tokens=6)  # the sft_checkpoint fixture's


@pytest.fixture(scope="module")
def warm(sft_checkpoint):
    """(model, task, tokenizer) of the shared warm start (about 0.2 sampled accuracy on chain_sum)."""
    model_cfg, _ = read_checkpoint(Path(sft_checkpoint))
    model = build_model(model_cfg, torch.device("cpu"), 0, str(sft_checkpoint)).eval()
    return model, build_task(TaskConfig()), build_tokenizer()


def own_argmax(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding written out: a full forward per token, argmax, stop at EOS."""
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids_1S = torch.tensor([ids + out])
            token = int(model(ids_1S, torch.ones_like(ids_1S, dtype=torch.bool)).logits_BSV[0, -1].argmax())
            out.append(token)
            if token == tokenizer.eos_id:
                break
    return tokenizer.decode(out)


def own_greedy_accuracy(model, task, tokenizer, split: str, n: int) -> float:
    problems = task.problems(split, 0, n)
    return sum(task.reward(p, own_argmax(model, tokenizer, p.prompt, SAMPLING.max_new_tokens))
               for p in problems) / n


# --- the numbers --------------------------------------------------------------------------------------------------


def test_standard_error_is_that_of_the_mean_of_prompt_means():
    values = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0]
    mean, se = mean_and_se(values)
    assert mean == pytest.approx(statistics.fmean(values))
    assert se == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)))
    p, n = 0.3, 100  # one 0/1 sample per prompt: sqrt(p (1 - p) / (n - 1))
    assert mean_and_se([1.0] * 30 + [0.0] * 70)[1] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    assert math.isnan(mean_and_se([1.0])[1])


def test_greedy_accuracy_is_the_models_argmax_decoding(warm):
    model, task, tokenizer = warm
    problems = task.problems("eval", 0, 24)
    ids, valid = encode_prompts([p.prompt for p in problems], tokenizer, torch.device("cpu"))
    gen = generate(model, ids, valid, greedy(SAMPLING), tokenizer.eos_id, tokenizer.pad_id, torch.Generator())
    ours = [tokenizer.decode(row) for row in gen.response_BN.tolist()]
    assert ours == [own_argmax(model, tokenizer, p.prompt, SAMPLING.max_new_tokens) for p in problems]
    acc = accuracy(model, task, tokenizer, "eval", 24, greedy(SAMPLING))
    assert acc.mean == own_greedy_accuracy(model, task, tokenizer, "eval", 24)
    assert 0 < acc.mean < 1  # a warm start that is right on some prompts and wrong on others: the test can fail


def test_one_sample_eval_reward_is_the_number_older_runs_logged(warm):
    model, task, tokenizer = warm
    metrics = heldout_metrics(model, task, tokenizer, SAMPLING, 64, samples=1, with_greedy=True, seed=3)
    assert metrics["eval/reward"] == sampled_reward(model, task, tokenizer, SAMPLING, 64, 3)
    rewards = [task.reward(p, own_argmax(model, tokenizer, p.prompt, 6)) for p in task.problems("eval", 0, 64)]
    assert (metrics["eval/greedy"], metrics["eval/greedy_se"]) == mean_and_se(rewards)


def test_several_samples_are_averaged_per_prompt_and_chunks_do_not_matter(warm, monkeypatch):
    model, task, tokenizer = warm
    problems = task.problems("eval", 0, 16)
    ids, valid = encode_prompts([p.prompt for p in problems for _ in range(4)], tokenizer, torch.device("cpu"))
    gen = generate(model, ids, valid, SAMPLING, tokenizer.eos_id, tokenizer.pad_id, torch.Generator().manual_seed(5))
    rewards_PK = torch.tensor([task.reward(problems[r // 4], tokenizer.decode(row))
                               for r, row in enumerate(gen.response_BN.tolist())]).view(16, 4)
    acc = accuracy(model, task, tokenizer, "eval", 16, SAMPLING, samples=4, seed=5)
    means_P = rewards_PK.mean(1).double()
    assert acc.mean == pytest.approx(means_P.mean().item())
    assert acc.se == pytest.approx((means_P.std() / 4).item())  # sd of 16 prompt means / sqrt(16)
    assert acc.se != pytest.approx((rewards_PK.double().std() / 8).item())  # not 64 independent samples
    whole = accuracy(model, task, tokenizer, "eval", 40, greedy(SAMPLING))
    monkeypatch.setattr(evaluation, "ROWS_PER_CHUNK", 7)
    assert accuracy(model, task, tokenizer, "eval", 40, greedy(SAMPLING)) == whole


# --- the splits ---------------------------------------------------------------------------------------------------

# The first 300 prompts of train and eval as they were before the validation split existed (commit fe22154).
BEFORE_VALIDATION = {
    ("chain_sum", "train"): "c6bcf1fa893cc608", ("chain_sum", "eval"): "033fa264e06b8178",
    ("running_sum", "train"): "c5a0825f9f298054", ("running_sum", "eval"): "8594da5e9598f355",
}
TASKS = {"chain_sum": TaskConfig(), "running_sum": TaskConfig(name="running_sum", min_terms=4, max_terms=6)}


@pytest.mark.parametrize("name", TASKS)
def test_train_and_eval_are_the_prompts_they_were(name):
    task = build_task(TASKS[name])
    for split in ("train", "eval"):
        prompts = [p.prompt for p in task.problems(split, 0, 300)]
        assert hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16] == BEFORE_VALIDATION[name, split]


@pytest.mark.parametrize("cfg", [TaskConfig(min_terms=3, max_terms=4), TASKS["running_sum"]], ids=["chain_sum",
                                                                                                  "running_sum"])
def test_validation_shares_no_prompt_with_train_or_held_out(cfg):
    task = build_task(cfg)
    validation = {p.prompt for p in task.problems("validation", 0, 400)}
    held_out = {p.prompt for p in task.problems("eval", 0, HELD_OUT_RESERVE)}
    assert len(validation) > 100
    assert validation.isdisjoint(held_out)
    assert all(in_eval(prompt, 0.1) for prompt in validation)  # so no train item, at any index, is one of them
    assert validation.isdisjoint(p.prompt for p in task.problems("train", 0, 4000))


def test_a_prompt_space_too_small_for_validation_says_so():
    task = build_task(TaskConfig(min_terms=2, max_terms=2))  # ~20 eval prompts, all among the held-out ones
    with pytest.raises(ConfigError, match="no validation prompt.*held-out"):
        task.problem("validation", 0)


def test_file_tasks_have_no_validation_split(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    with pytest.raises(ConfigError, match="no validation split"):
        FileTask(str(path)).problem("validation", 0)


# --- the command --------------------------------------------------------------------------------------------------


def test_the_temperature_is_chosen_on_validation_never_on_held_out(tmp_path, monkeypatch):
    model_cfg = tiny_config(vocab_size=99)  # the character tokenizer's vocabulary
    model = build_model(model_cfg, torch.device("cpu"), 0, None)
    save_checkpoint(tmp_path, 0, {"model": model.state_dict(), "model_config": asdict(model_cfg)})
    by_split = {"validation": {0.5: 0.2, 0.7: 0.6, 1.0: 0.4, 1.2: 0.3, 1.5: 0.1},  # best 0.7 on validation
                "eval": {0.5: 0.3, 0.7: 0.35, 1.0: 0.5, 1.2: 0.6, 1.5: 0.9}}  # held-out would pick 1.5
    calls = []

    def fake(model, task, tokenizer, split, n, sampling, samples=1, seed=0):
        calls.append((split, sampling.temperature, sampling.top_p))
        mean = 0.8 if sampling.top_p < 1 else by_split[split][sampling.temperature]
        return Accuracy(mean, 0.01, n, samples)

    monkeypatch.setattr(evaluate_module, "accuracy", fake)
    result = evaluate(EvaluateConfig(checkpoint=str(tmp_path), temperatures=(1.5, 0.5, 1.2, 0.7, 1.0),
                                     validation_prompts=8, heldout_prompts=8, out=str(tmp_path / "out")))
    assert result["best_temperature"] == 0.7
    assert result["heldout"]["sampled"] == {"temperature": 0.7, "min_new_tokens": 0, "mean": 0.35, "se": 0.01,
                                            "prompts": 8, "samples": 1}
    assert result["heldout"]["greedy"]["mean"] == 0.8
    assert [c for c in calls if c[0] == "eval"] == [("eval", 0.7, 1.0), ("eval", 1.0, evaluation.GREEDY_TOP_P)]
    assert json.loads((tmp_path / "out" / "evaluate.json").read_text())["best_temperature"] == 0.7


def test_a_length_control_is_chosen_with_the_temperature_on_validation(tmp_path, monkeypatch):
    model_cfg = tiny_config(vocab_size=99)
    model = build_model(model_cfg, torch.device("cpu"), 0, None)
    save_checkpoint(tmp_path, 0, {"model": model.state_dict(), "model_config": asdict(model_cfg)})
    greedy_by_length = {"validation": {0: 0.3, 2: 0.5, 4: 0.5}, "eval": {0: 0.2, 2: 0.45, 4: 0.9}}
    sampled = {"validation": {(0, 0.5): 0.2, (0, 1.0): 0.3, (2, 0.5): 0.6, (2, 1.0): 0.4, (4, 0.5): 0.6,
                              (4, 1.0): 0.1},
               "eval": {(2, 0.5): 0.55}}
    calls = []

    def fake(model, task, tokenizer, split, n, sampling, samples=1, seed=0):
        calls.append((split, sampling.min_new_tokens, sampling.temperature, sampling.top_p < 1))
        if sampling.top_p < 1:
            return Accuracy(greedy_by_length[split][sampling.min_new_tokens], 0.01, n, samples)
        return Accuracy(sampled[split][(sampling.min_new_tokens, sampling.temperature)], 0.01, n, samples)

    monkeypatch.setattr(evaluate_module, "accuracy", fake)
    result = evaluate(EvaluateConfig(checkpoint=str(tmp_path), temperatures=(1.0, 0.5), min_new_tokens=(4, 0, 2),
                                     validation_prompts=8, heldout_prompts=8, out=str(tmp_path / "out")))
    # a tie between lengths 2 and 4 at T=0.5 goes to the shorter; greedy's own best length too (2, not 4)
    assert (result["best_min_new_tokens"], result["best_temperature"]) == (2, 0.5)
    assert result["heldout"]["sampled"]["mean"] == 0.55
    assert result["heldout"]["greedy"]["mean"] == 0.2
    assert result["heldout"]["greedy_length"]["min_new_tokens"] == 2
    assert result["heldout"]["greedy_length"]["mean"] == 0.45  # never the held-out best (length 4: 0.9)
    assert {c for c in calls if c[0] == "eval"} == {("eval", 2, 0.5, False), ("eval", 0, 1.0, True),
                                                   ("eval", 2, 1.0, True)}
    rows = pd.read_csv(tmp_path / "out" / "evaluate.csv")
    assert len(rows) == 6 + 2 + 3 + 1 and rows["chosen"].sum() == 1 + 2 + 1 + 1


def test_a_tie_on_validation_goes_to_the_lower_temperature():
    acc = {t: Accuracy(m, 0.0, 1, 1) for t, m in {1.0: 0.5, 0.5: 0.5, 0.7: 0.4}.items()}
    assert pick_best(acc) == 0.5


def test_evaluate_help_documents_its_fields(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--checkpoint", "--temperatures", "--validation-prompts", "--heldout-prompts", "--samples", "--set"):
        assert flag in text
    assert "Validation prompts per temperature" in text


@pytest.mark.parametrize("args, culprit", [
    (["--temperatures", "0.5", "0"], "temperatures=(0.5, 0.0) must be one or more values > 0"),
    (["--temperatures", "0.5", "nan"], "temperatures=nan must be a finite number"),
    (["--heldout-prompts", "5000"], "heldout_prompts=5000 is more than the 2048 held-out prompts"),
    (["--samples", "0"], "samples=0 must be > 0"),
    (["--min-new-tokens", "0", "6"], "min_new_tokens=6 must be < the sampler's max_new_tokens=6"),
    (["--min-new-tokens", "2", "2"], "min_new_tokens=(2, 2) has a value twice"),
    (["--set", "task.min_termz=7"], "min_termz"),
    (["--set", "task.min_terms=2", "task.max_terms=2"], "no validation prompt"),
])
def test_a_bad_value_is_named_with_exit_2_and_no_traceback(sft_checkpoint, tmp_path, args, culprit, capsys):
    """As tests/rl/test_bad_values.py: a config value tyro rejects (its box, joined into one line) or a user error of
    the run (one line, `moe-rl evaluate: error: ...`); nothing is written."""
    out = tmp_path / "out"
    try:
        code = main(["evaluate", "--checkpoint", str(sft_checkpoint), "--out", str(out), *args])
    except SystemExit as exit_:
        code = exit_.code
    stdout, stderr = capsys.readouterr()
    assert code == 2 and culprit in " ".join(stderr.replace("│", " ").split()), stderr
    assert "Traceback" not in stdout + stderr and not out.exists()


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["evaluate", "--checkpoint", str(tmp_path / "none.pt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"moe-rl evaluate: error: checkpoint {tmp_path}/none.pt "
                                                            "does not exist"]


def test_evaluate_command_end_to_end(sft_checkpoint, warm, tmp_path):
    """The real command in its own process: five temperatures on validation, the held-out greedy number equal to
    our own argmax decoding of the same prompts, and the baseline row read back by the analysis."""
    run_dir = Path(sft_checkpoint).parents[1]
    out = tmp_path / "evaluate"
    done = subprocess.run([sys.executable, "-m", "moe_rl.cli", "evaluate", "--checkpoint", str(run_dir), "--out",
                           str(out), "--temperatures", "0.3", "0.6", "1", "1.3", "1.6", "--validation-prompts", "16",
                           "--heldout-prompts", "16", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                            "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "<- best" in done.stdout and "greedy" in done.stdout
    result = json.loads((out / "evaluate.json").read_text())
    assert [row["temperature"] for row in result["validation"]] == [0.3, 0.6, 1.0, 1.3, 1.6]
    model, task, tokenizer = warm
    assert result["heldout"]["greedy"]["mean"] == own_greedy_accuracy(model, task, tokenizer, "eval", 16)
    assert len((out / "evaluate.csv").read_text().splitlines()) == 1 + 5 + 2
    base = read_baseline(out)
    assert base["temperature"] == result["best_temperature"] and base["prompts"] == 16


# --- training and analysis ----------------------------------------------------------------------------------------


def test_training_logs_greedy_and_sampled_held_out_with_ses(sft_checkpoint, warm, tmp_path):
    cfg = tiny_train_config(tmp_path / "run", total_steps=1, init_from=str(sft_checkpoint),
                            log=LogConfig(eval_every=1, eval_prompts=12, eval_samples=2, samples_every=0))
    train(cfg)
    evals = [line for line in metric_lines(tmp_path / "run") if "eval/reward" in line]
    assert [line["step"] for line in evals] == [0, 1]  # before RL and after the last step
    for line in evals:
        assert {"eval/reward_se", "eval/greedy", "eval/greedy_se"} <= set(line)
    model, task, tokenizer = warm
    assert evals[0]["eval/greedy"] == own_greedy_accuracy(model, task, tokenizer, "eval", 12)
    assert evals[0]["eval/reward"] == accuracy(model, task, tokenizer, "eval", 12, SAMPLING, 2, cfg.seed).mean


def test_with_baseline_puts_the_warm_start_first(tmp_path):
    result = {"checkpoint": "c.pt", "step": 300, "best_temperature": 0.7,
              "heldout": {"sampled": {"temperature": 0.7, "mean": 0.66, "se": 0.015, "prompts": 1024, "samples": 2},
                          "greedy": {"mean": 0.87, "se": 0.011, "prompts": 1024, "samples": 1}}}
    (tmp_path / "evaluate.json").write_text(json.dumps(result))
    base = read_baseline(tmp_path)
    table = pd.DataFrame({"group": ["grpo", "gspo"], "n_runs": [5, 5], "final": [0.70, 0.69]})
    sampled = with_baseline(table, base)
    assert list(sampled["group"]) == ["warm start (T=0.7, best on validation)", "grpo", "gspo"]
    assert sampled.loc[0, "final"] == 0.66 and sampled.loc[0, "baseline_se"] == 0.015
    assert math.isnan(sampled.loc[0, "n_runs"]) and math.isnan(sampled.loc[1, "baseline_se"])
    greedy_row = with_baseline(table, base, decoding="greedy").loc[0]
    assert greedy_row["final"] == 0.87 and greedy_row["baseline_samples"] == 1
    assert "0.660 +- 0.015" in baseline_markdown([base]) and "0.870 +- 0.011" in baseline_markdown([base])


def test_against_baseline_adds_the_baselines_se_to_the_seeds_spread():
    """Hand-computed: group a (2 runs, sampled 0.70 / 0.74): difference 0.06, SE sqrt(var / n + baseline SE^2) =
    sqrt(0.0008 / 2 + 0.015^2) = 0.025, t(0.975, 1) = 12.706, so [-0.2577, 0.3777]; group b (3 runs, 0.80 / 0.82 /
    0.84): 0.16, SE sqrt(0.0004 / 3 + 0.000225) = 0.018930, t(0.975, 2) = 4.3027, so [0.0786, 0.2414], which beats."""
    base = {"heldout": 0.66, "heldout_se": 0.015, "greedy": 0.87, "greedy_se": 0.011}
    per_run = pd.DataFrame({"group": ["a", "a", "b", "b", "b"], "eval/reward": [0.70, 0.74, 0.80, 0.82, 0.84],
                            "eval/greedy": [0.90, 0.90, 0.86, 0.88, 0.90]})
    table = against_baseline(per_run, base).set_index(["group", "decoding"])
    a, b = table.loc[("a", "sampled")], table.loc[("b", "sampled")]
    assert a["diff"] == pytest.approx(0.06) and a["ci_low"] == pytest.approx(-0.2577, abs=1e-4)
    assert a["ci_high"] == pytest.approx(0.3777, abs=1e-4) and not a["beats_baseline"]
    assert b["diff"] == pytest.approx(0.16) and b["ci_low"] == pytest.approx(0.0786, abs=1e-4)
    assert b["ci_high"] == pytest.approx(0.2414, abs=1e-4) and b["beats_baseline"]
    greedy = table.loc[("b", "greedy")]  # 0.88 - 0.87, SE sqrt(0.0004 / 3 + 0.011^2) = 0.01597
    assert greedy["diff"] == pytest.approx(0.01)
    assert greedy["ci_low"] == pytest.approx(0.01 - 4.3027 * 0.015967, abs=1e-4)
    assert not greedy["beats_baseline"]
    one = against_baseline(per_run[per_run["group"] == "a"].head(1), base)
    assert math.isnan(one.loc[0, "ci_low"]) and not one.loc[0, "beats_baseline"]  # never with one run
