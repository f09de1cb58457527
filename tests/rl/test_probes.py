"""Routing probes: exact zeros where nothing changed, brute-force agreement, staleness growth, lr ordering,
cadence and subsampling, no side effects on training, and a killed run's logs."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import metric_lines, tiny_model, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.rl.probes import ProbeConfig, Prober
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate, to_rollout_batch
from moe_rl.rl.run_config import OptimConfig
from moe_rl.routing.replay import record_routing
from moe_rl.runs.runlog import read_manifest, read_metrics, read_tables
from moe_rl.tasks import CharTokenizer


def _rollout_batch(model, rows=8, seed=0):
    tok = CharTokenizer()
    ids, valid = encode_prompts([f"{i}+{i + 1}=" for i in range(rows)], tok, "cpu")
    gen = generate(model, ids, valid, SamplingConfig(max_new_tokens=5), tok.eos_id, tok.pad_id,
                   torch.Generator().manual_seed(seed), record=True)
    zeros = torch.zeros(rows)
    return to_rollout_batch(gen, zeros, zeros, 2, [""] * rows, [""] * rows)


def _prober(model, batch, **cfg):
    chunks = list(torch.arange(batch.size).tensor_split(2))
    prober = Prober(ProbeConfig(**cfg), batch, chunks, temperature=1.0, seed=0, step=0)
    prober.start(model, update=0, old_native=None, old_entropy=None, n_experts=model.cfg.n_experts)
    return prober


def test_update_probe_reads_exactly_zero_when_parameters_do_not_change():
    model = tiny_model(vocab_size=99).eval()
    prober = _prober(model, _rollout_batch(model))
    metrics = prober.after_update(model, update=0, minibatch=0)
    assert metrics["routing/update/churn"] == 0.0 and metrics["routing/update/token_any"] == 0.0
    assert metrics["update/kl"] == 0.0


def _brute_force_churn(before, after, mask_BS):
    """Per (token, layer): 1 - |S_A ∩ S_B| / K with Python sets; mean over masked tokens and layers."""
    changed, per_layer = [], []
    L, B, S, K = before.shape
    for layer in range(L):
        layer_values = []
        for b in range(B):
            for s in range(S):
                if mask_BS[b, s]:
                    a_set, b_set = set(before[layer, b, s].tolist()), set(after[layer, b, s].tolist())
                    layer_values.append(1 - len(a_set & b_set) / K)
        per_layer.append(sum(layer_values) / len(layer_values))
        changed += layer_values
    return sum(changed) / len(changed), per_layer


def test_update_probe_equals_a_brute_force_set_comparison_after_a_router_perturbation():
    model = tiny_model(vocab_size=99).eval()
    batch = _rollout_batch(model)
    prober = _prober(model, batch)
    with torch.no_grad(), record_routing(model) as rec:
        model(batch.input_ids_BS, batch.input_valid_BS)
    before = rec.trace().ids_LBSK
    with torch.no_grad():  # perturb the routers of layers 1 and 2 only
        for layer in model.moe_layers()[1:]:
            layer.router.gate.weight.add_(0.3 * torch.randn_like(layer.router.gate.weight))
        with record_routing(model) as rec:
            model(batch.input_ids_BS, batch.input_valid_BS)
    after = rec.trace().ids_LBSK
    metrics = prober.after_update(model, update=0, minibatch=0)
    expected, expected_per_layer = _brute_force_churn(before, after, batch.token_mask_BS("response"))
    assert expected > 0.05, "the perturbation must move routing for this test to mean anything"
    assert metrics["routing/update/churn"] == pytest.approx(expected, abs=1e-6)
    for layer, value in enumerate(expected_per_layer):
        assert metrics[f"routing/update/churn/L{layer}"] == pytest.approx(value, abs=1e-6)
    assert metrics["routing/update/churn/L0"] == 0.0  # layer 0's router and input are unchanged


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    cfg = tiny_train_config(tmp_path_factory.mktemp("probes") / "run", total_steps=4, optim=OptimConfig(lr=1e-3))
    return train(cfg)


def test_noise_probe_reads_zero_on_cpu(probed_run):
    assert all(line["routing/noise/churn"] == 0.0 for line in metric_lines(probed_run))


def test_staleness_is_zero_at_the_first_minibatch_and_grows_over_minibatches(probed_run):
    lines = metric_lines(probed_run)
    mean = {j: sum(l["routing/staleness/churn"] for l in lines if l["minibatch"] == j) / 4 for j in range(4)}
    assert mean[0] == 0.0
    assert 0 < mean[1] < mean[2] < mean[3], mean


def test_routing_tables_hold_every_probe_and_layer(probed_run):
    table = read_tables(probed_run, "routing")
    assert set(table["probe"]) == {"update", "staleness", "rollout", "noise"}
    assert sorted(table["layer"].unique()) == [0, 1]
    update = table[table["probe"] == "update"]
    assert len(update) == 4 * 4 * 2  # steps x minibatches x layers
    line = metric_lines(probed_run)[5]
    row = update[(update["update"] == line["update"]) & (update["layer"] == 1)]
    assert row["churn"].item() == pytest.approx(line["routing/update/churn/L1"])


def test_update_churn_rises_with_learning_rate(tmp_path):
    churn = {}
    for lr in (1e-5, 1e-4, 1e-3):
        run = train(tiny_train_config(tmp_path / f"lr{lr}", total_steps=2, optim=OptimConfig(lr=lr)))
        lines = metric_lines(run)
        churn[lr] = sum(line["routing/update/churn"] for line in lines) / len(lines)
    assert churn[1e-5] < churn[1e-4] < churn[1e-3], churn


def test_probes_do_not_change_training(tmp_path):
    on = metric_lines(train(tiny_train_config(tmp_path / "on", total_steps=2)))
    off = metric_lines(train(tiny_train_config(tmp_path / "off", total_steps=2, probes=ProbeConfig(enabled=()))))
    training_keys = ("reward", "loss", "grad_norm", "kl", "entropy", "ratio/log_std", "clip_ratio/region_mean")
    for a, b in zip(on, off, strict=True):
        assert {k: a[k] for k in training_keys} == {k: b[k] for k in training_keys}
    assert not any(key.startswith("routing/update") for key in off[0])


def test_cadence_runs_a_probe_every_nth_update(tmp_path):
    cfg = tiny_train_config(tmp_path / "run", total_steps=2, probes=ProbeConfig(every={"update": 3}))
    lines = metric_lines(train(cfg))
    probed = [line["update"] for line in lines if "routing/update/churn" in line]
    assert probed == [0, 3, 6]


def test_subsampled_probe_reads_zero_without_an_update():
    model = tiny_model(vocab_size=99).eval()
    batch = _rollout_batch(model, rows=8)
    prober = _prober(model, batch, sequences=3)
    assert len(prober.rows) == 3
    assert prober.after_update(model, update=0, minibatch=0)["routing/update/churn"] == 0.0


@pytest.mark.parametrize("kw, message", [
    (dict(enabled=("update", "drift")), r"'drift' is not valid; choose one of: 'update', 'staleness'"),
    (dict(every={"updat": 2}), "'updat' is not valid"),
    (dict(every={"update": 0}), r"probes.every\['update'\]=0 must be >= 1"),
    (dict(tokens="prompt"), "probes.tokens='prompt'"),
])
def test_bad_probe_config_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        ProbeConfig(**kw)


def test_sigkill_mid_training_leaves_readable_metrics_and_a_running_manifest(tmp_path):
    script = (
        "import sys; sys.path.insert(0, 'tests'); import torch; torch.set_num_threads(1)\n"
        "from conftest import tiny_train_config; from moe_rl.commands.train import train\n"
        f"train(tiny_train_config({str(tmp_path / 'run')!r}, total_steps=1000))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("\n") < 6):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    lines = read_metrics(tmp_path / "run")
    assert len(lines) >= 6
    assert [line["update"] for line in lines] == list(range(len(lines)))
    assert read_manifest(tmp_path / "run")["status"] == "running"
    from moe_rl.analysis import load_runs  # the loaders behind every figure accept the killed run too

    data = load_runs(tmp_path / "run")
    assert data.runs["status"].tolist() == ["running"] and len(data.metrics) == len(lines)
