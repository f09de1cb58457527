"""One CLI: `moe-rl --version`, and sft spelling the flags it shares with train as train does (an old spelling is one
line naming the new one). In-process calls of moe_rl.cli.main: nothing here trains."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from moe_rl.cli import main
from moe_rl.rl.run_config import SFT_RENAMED_FLAGS, SFTConfig, TrainConfig


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version(capsys, flag):
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"moe-rl {version('moe-rl')}\n"


@pytest.mark.parametrize(("old", "new"), [
    (["--steps", "3"], "--total-steps"),
    (["--lr=1e-3"], "--optim.lr"),
    (["--grad_clip", "0"], "--optim.grad-clip"),
    (["--eval-every", "5"], "--log.eval-every"),
    (["--print-every", "1"], "--log.print-every"),
    (["--trackers", "wandb"], "--log.trackers"),
    (["--wandb.project", "p"], "--log.wandb.project"),
])
def test_sft_refuses_an_old_spelling_naming_the_new_one(capsys, tmp_path, old, new):
    assert main(["sft", "--out-dir", str(tmp_path / "run"), *old]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is now {new} " in err, err
    assert not (tmp_path / "run").exists()


def test_sft_shares_trains_names_for_steps_optimizer_and_logging():
    """Every renamed flag's new name is a field of SFTConfig, and every one of them but print_every (train prints each
    rollout step) is a field of TrainConfig too: one spelling across the two commands."""
    from moe_rl.rl.overrides import field_paths

    sft_fields, train_fields = set(field_paths(SFTConfig)), set(field_paths(TrainConfig))
    for new in SFT_RENAMED_FLAGS.values():
        path = new.removeprefix("--").replace("-", "_")
        assert path in sft_fields or path == "log.wandb", path
        assert path in train_fields or path in ("log.print_every", "log.wandb"), path
    assert "log.wandb.project" in sft_fields and "log.wandb.project" in train_fields


TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64",
        "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
        "--rollout.sampling.max-new-tokens", "6", "--log.samples-every", "0"]


@pytest.mark.parametrize("eval_every", ["0", "5"])
def test_train_prints_the_final_evaluation_in_one_line(tmp_path, capsys, eval_every):
    """With evaluations on, the held-out evaluation after the last step is one progress line with the numbers of its
    metrics line (step = total_steps); without them there is no such line."""
    import json

    run = tmp_path / "run"
    assert main(["train", *TINY, "--out-dir", str(run), "--total-steps", "2", "--log.eval-every", eval_every,
                 "--log.eval-prompts", "8"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("final evaluation")]
    if eval_every == "0":
        assert printed == []
        return
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["step"] == 2 and final["minibatch"] == -1
    assert printed == [f"final evaluation (held-out, 8 prompts, after step 2): reward {final['eval/reward']:.3f} +- "
                       f"{final['eval/reward_se']:.3f}, greedy {final['eval/greedy']:.3f} +- "
                       f"{final['eval/greedy_se']:.3f}"]


def test_sft_optim_has_only_what_sft_applies():
    """sft's --optim.* are the fields its AdamW and schedule read, with train's names: an optimizer option that only
    train applies (added to OptimConfig later) must not appear as an sft flag that does nothing."""
    from dataclasses import fields

    from moe_rl.rl.run_config import OptimConfig, SFTOptimConfig

    sft_names = [f.name for f in fields(SFTOptimConfig)]
    assert sft_names == ["lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip"]
    assert set(sft_names) <= {f.name for f in fields(OptimConfig)}
