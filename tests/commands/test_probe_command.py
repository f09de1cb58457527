"""`moe-rl probe`: its churn equals the training loop's update probe for the same update, router margins against a
hand count, and the trace mode through the command line (zero mismatch on the model's own routing, one-line errors)."""

import json

import pytest
import torch
from conftest import TINY_MODEL, metric_lines, tiny_train_config

from moe_rl.cli import main
from moe_rl.commands.probe import ProbeCommandConfig, probe
from moe_rl.commands.train import train
from moe_rl.model import ModelConfig
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate
from moe_rl.rl.run_config import OptimConfig, RolloutConfig
from moe_rl.routing.engine_traces import requests_from_trace, write_engine_trace
from moe_rl.routing.margins import margin_churn, topk_margin_T
from moe_rl.routing.trace import RoutingTrace
from moe_rl.tasks import CharTokenizer

ROLLOUT = RolloutConfig(prompts_per_step=4, group_size=4, sampling=SamplingConfig(max_new_tokens=6))
OPTIM = OptimConfig(lr=3e-3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of a short RL run (it saves its architecture, which the probe reads back)."""
    out = tmp_path_factory.mktemp("probe") / "start"
    train(tiny_train_config(out, total_steps=1, minibatches=2, rollout=ROLLOUT))
    return out / "checkpoints" / "latest.pt"


def test_probe_churn_equals_the_training_loops_update_probe(checkpoint, tmp_path):
    run = train(tiny_train_config(tmp_path / "train", total_steps=1, minibatches=4, seed=1, init_from=str(checkpoint),
                                  rollout=ROLLOUT, optim=OPTIM))
    rows = probe(ProbeCommandConfig(checkpoint=str(checkpoint), out=str(tmp_path / "probe"), updates=4, seed=1,
                                    device="cpu", rollout=ROLLOUT, optim=OPTIM, model=ModelConfig(d_model=16)))
    pooled = [row for row in rows if row["layer"] == "all"]
    lines = metric_lines(run)
    assert [row["update"] for row in pooled] == [line["update"] for line in lines] == [0, 1, 2, 3]
    for row, line in zip(pooled, lines):
        for name in ("churn", "set_change", "token_any", "layers_changed"):
            assert row[name] == line[f"routing/update/{name}"]
        per_layer = [r["churn"] for r in rows if r["update"] == row["update"] and r["layer"] != "all"]
        assert per_layer == [line["routing/update/churn/L0"], line["routing/update/churn/L1"]]
    assert sum(row["churn"] for row in pooled) > 0  # the updates moved routing: the comparison is not of zeros
    written = json.loads((tmp_path / "probe" / "probe.json").read_text())["rows"]
    assert len(written) == 4 * 3 and (tmp_path / "probe" / "probe.csv").exists()


def test_margin_is_the_gap_between_the_kth_and_next_score():
    scores_TE = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    assert torch.allclose(topk_margin_T(scores_TE, 2), torch.tensor([0.15, 0.0, 0.1]))
    assert topk_margin_T(scores_TE, 4).isinf().all()


def test_margin_churn_splits_tokens_at_the_low_margin_quantile():
    # one layer, 10 tokens, K=2; margins 0.0 .. 0.9; tokens 0 and 5 changed one slot, token 1 both
    margin_LBS = torch.arange(10, dtype=torch.float32).div(10).view(1, 1, 10)
    before_ids = torch.tensor([[0, 1]] * 10)
    after_ids = before_ids.clone()
    after_ids[0] = torch.tensor([0, 2])
    after_ids[1] = torch.tensor([2, 3])
    after_ids[5] = torch.tensor([3, 1])
    before, after = (RoutingTrace(ids.view(1, 1, 10, 2).to(torch.int16)) for ids in (before_ids, after_ids))
    pooled, (layer,) = margin_churn(margin_LBS, before, after, torch.ones(1, 10, dtype=torch.bool),
                                    thresholds=(0.25,), low_quantile=0.2)
    # the 0.2 quantile (lower) is 0.1: tokens 0 and 1 (churn 0.5 and 1.0) vs the other 8 (one of 0.5)
    assert layer["churn_low_margin"] == pytest.approx(0.75) and layer["churn_rest"] == pytest.approx(0.5 / 8)
    assert layer["changes_in_low_margin"] == pytest.approx(2 / 3) and layer["margin_below_0.25"] == pytest.approx(0.3)
    assert layer["margin_median"] == pytest.approx(0.4) and pooled == layer


def _own_trace(checkpoint, path):
    """The checkpoint's model sampling a few prompts, its routing written in vLLM's layout."""
    from moe_rl.rl.build import build_model

    cfg = ProbeCommandConfig(checkpoint=str(checkpoint))
    model = build_model(cfg.model_config(), torch.device("cpu"), 0, str(checkpoint)).eval()
    tok = CharTokenizer()
    ids, valid = encode_prompts(["1+2=", "30+4=", "5-6-7="], tok, "cpu")
    gen = generate(model, ids, valid, SamplingConfig(max_new_tokens=5), tok.eos_id, tok.pad_id,
                   torch.Generator().manual_seed(0), record=True)
    requests = requests_from_trace(gen.routing, gen.tokens_BS, gen.valid_BS, gen.prompt_len)
    return write_engine_trace(path, requests), requests


def test_trace_mode_from_the_command_line(checkpoint, tmp_path, capsys):
    path, requests = _own_trace(checkpoint, tmp_path / "engine.parquet")
    out = tmp_path / "compare"
    assert main(["probe", "--checkpoint", str(checkpoint), "--trace", str(path), "--tokens", "all", "--out", str(out),
                 "--device", "cpu"]) == 0
    rows = json.loads((out / "probe.json").read_text())["rows"]
    assert rows[0]["layer"] == "all" and rows[0]["requests"] == 3
    assert rows[0]["tokens"] == sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in requests)
    assert all(row["churn"] == row["set_change"] == row["token_any"] == 0.0 for row in rows)
    assert "set_change" in capsys.readouterr().out
    bad = list(requests)
    bad[1].routed_experts_RLK = bad[1].routed_experts_RLK[:, :1]
    write_engine_trace(path, bad)
    assert main(["probe", "--checkpoint", str(checkpoint), "--trace", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "engine.parquet: request 1: the trace has 1 layers but the model has 2 MoE layers" in err


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_probe_on_each_hf_family_equals_the_training_loops_update_probe(tmp_path, family):
    """A tiny random model of each Hugging Face family: `moe-rl probe`'s per-update churn is the trainer's."""
    model = ModelConfig(**TINY_MODEL, backend="hf", hf_config=family)
    rollout = RolloutConfig(prompts_per_step=2, group_size=4, sampling=SamplingConfig(max_new_tokens=6))
    run = train(tiny_train_config(tmp_path / "train", total_steps=1, minibatches=2, seed=3, model=model,
                                  rollout=rollout, optim=OPTIM))
    rows = probe(ProbeCommandConfig(out=str(tmp_path / "probe"), updates=2, seed=3, device="cpu", rollout=rollout,
                                    optim=OPTIM, model=model))
    pooled = [row for row in rows if row["layer"] == "all"]
    lines = metric_lines(run)
    assert len(pooled) == len(lines) == 2
    for row, line in zip(pooled, lines):
        for name in ("churn", "set_change", "token_any"):
            assert row[name] == line[f"routing/update/{name}"]
    assert sum(row["churn"] for row in pooled) > 0
