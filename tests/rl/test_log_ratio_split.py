"""The split probe: log w = routing part + weight part, each checked against forwards computed here, exact zeros
where a part cannot move, the clip attribution by brute force, and no effect on training."""

import math

import pytest
import torch
from conftest import metric_lines, tiny_model, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.rl.probes import DEFAULT_PROBES, ProbeConfig, Prober, log_ratio_split
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate, to_rollout_batch
from moe_rl.routing.replay import record_routing, replay_routing
from moe_rl.tasks import CharTokenizer

SPLIT = (*DEFAULT_PROBES, "split")


def _rollout_batch(model, rows=8):
    tok = CharTokenizer()
    ids, valid = encode_prompts([f"{i}+{i + 1}=" for i in range(rows)], tok, "cpu")
    gen = generate(model, ids, valid, SamplingConfig(max_new_tokens=5), tok.eos_id, tok.pad_id,
                   torch.Generator().manual_seed(0), record=True)
    advantages = torch.tensor([1.0, -1.0] * (rows // 2))
    return to_rollout_batch(gen, torch.zeros(rows), advantages, 2, [""] * rows, [""] * rows)


def _prober(model, batch, **cfg):
    chunks = list(torch.arange(batch.size).tensor_split(2))
    prober = Prober(ProbeConfig(enabled=SPLIT, **cfg), batch, chunks, temperature=1.0, seed=0, step=0)
    prober.start(model, update=0, old_native=None, old_entropy=None, n_experts=model.cfg.n_experts)
    return prober


def _logp_BN(model, batch, replay=None):
    """Response log-probs from a plain forward of the whole batch (optionally replaying `replay`'s ids)."""
    with torch.no_grad(), (replay_routing(model, replay) if replay is not None else record_routing(model)) as rec:
        logits_BSV = model(batch.input_ids_BS, batch.input_valid_BS).logits_BSV
    logp_BNV = logits_BSV[:, batch.prompt_len - 1:].float().log_softmax(-1)
    return logp_BNV.gather(-1, batch.response_BN[..., None])[..., 0], (None if replay is not None else rec.trace())


def _perturb(modules, scale=0.3):
    with torch.no_grad():
        for module in modules:
            module.weight.add_(scale * torch.randn_like(module.weight))


def test_split_is_skipped_at_minibatch_zero_and_exactly_zero_without_a_change():
    model = tiny_model(vocab_size=99).eval()
    prober = _prober(model, _rollout_batch(model))
    assert not any(k.startswith("split/") for k in prober.before_update(model, update=0, minibatch=0))
    metrics = prober.before_update(model, update=1, minibatch=1)  # a new version with the same parameters
    assert metrics["split/routing_abs_mean"] == 0.0 and metrics["split/weights_abs_mean"] == 0.0
    assert metrics["split/clip_frac"] == 0.0 and math.isnan(metrics["split/clip_from_routing"])


def test_a_change_after_every_router_has_no_routing_part():
    model = tiny_model(vocab_size=99, tie_embeddings=False).eval()
    batch = _rollout_batch(model)
    prober = _prober(model, batch)
    _perturb([model.lm_head], scale=0.5)  # downstream of every router: the routing cannot move
    metrics = prober.before_update(model, update=1, minibatch=1)
    assert metrics["split/routing_abs_mean"] == 0.0 and metrics["split/routing_token_frac"] == 0.0
    assert metrics["split/weights_abs_mean"] > 0.01
    assert metrics["split/weights_abs_mean"] == pytest.approx(metrics["split/log_ratio_abs_mean"], rel=1e-12)


def test_split_parts_equal_forwards_computed_here_and_the_clip_attribution_a_brute_force_count():
    model = tiny_model(vocab_size=99).eval()
    batch = _rollout_batch(model)
    prober = _prober(model, batch)
    old_logp_BN, old_trace = _logp_BN(model, batch)
    _perturb([layer.router.gate for layer in model.moe_layers()])
    _perturb([model.lm_head], scale=0.2)
    new_logp_BN, _ = _logp_BN(model, batch)
    replayed_logp_BN, _ = _logp_BN(model, batch, replay=old_trace)
    routing_BN, weights_BN = new_logp_BN - replayed_logp_BN, replayed_logp_BN - old_logp_BN

    metrics = prober.before_update(model, update=1, minibatch=1)

    mask = batch.response_mask_BN
    assert metrics["split/routing_abs_mean"] == pytest.approx(routing_BN[mask].abs().mean().item(), rel=1e-4)
    assert metrics["split/weights_abs_mean"] == pytest.approx(weights_BN[mask].abs().mean().item(), rel=1e-4)
    assert metrics["split/routing_abs_mean"] > 1e-3, "the router perturbation must move routing"
    hi, lo = math.log(1.27), math.log(0.8)
    clipped = kept_by_weights = 0
    for b in range(batch.size):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            total, weight_only = routing_BN[b, t] + weights_BN[b, t], weights_BN[b, t]
            up = batch.advantages_B[b] > 0
            if (total > hi) if up else (total < lo):
                clipped += 1
                kept_by_weights += not ((weight_only > hi) if up else (weight_only < lo))
    assert clipped > 0
    assert metrics["split/clip_frac"] == pytest.approx(clipped / int(mask.sum()))
    assert metrics["split/clip_from_routing"] == pytest.approx(kept_by_weights / clipped)


def test_per_layer_routing_part_is_zero_in_layers_whose_routing_did_not_move():
    model = tiny_model(vocab_size=99).eval()
    prober = _prober(model, _rollout_batch(model), split_per_layer=True)
    last = len(model.moe_layers()) - 1
    _perturb([model.moe_layers()[last].router.gate], scale=1.0)  # only the last layer's routing can move
    metrics = prober.before_update(model, update=1, minibatch=1)
    for layer in range(last):
        assert metrics[f"split/routing_abs_mean/L{layer}"] == 0.0
    assert metrics[f"split/routing_abs_mean/L{last}"] > 1e-3
    assert metrics[f"split/routing_abs_mean/L{last}"] == pytest.approx(metrics["split/routing_abs_mean"], rel=1e-5)


def test_log_ratio_split_on_hand_numbers():
    routing = torch.tensor([[0.3, 0.0, -0.1]])
    weights = torch.tensor([[0.0, 0.4, -0.2]])
    metrics = log_ratio_split(routing, weights, torch.ones(1, 3, dtype=torch.bool), torch.tensor([1.0]), (0.2, 0.27))
    # log 1.27 = 0.239: tokens 0 (0.3) and 1 (0.4) are clipped; token 0 only because of its routing part
    assert metrics["split/clip_frac"] == pytest.approx(2 / 3)
    assert metrics["split/clip_from_routing"] == pytest.approx(1 / 2)
    assert metrics["split/routing_share"] == pytest.approx(0.4 / 1.0)
    assert metrics["split/routing_token_frac"] == pytest.approx(2 / 3)


def test_split_probe_runs_in_training_and_does_not_change_it(tmp_path):
    on = metric_lines(train(tiny_train_config(tmp_path / "on", total_steps=2, probes=ProbeConfig(enabled=SPLIT))))
    off = metric_lines(train(tiny_train_config(tmp_path / "off", total_steps=2)))
    for a, b in zip(on, off, strict=True):
        assert {k: a[k] for k in ("reward", "loss", "grad_norm")} == {k: b[k] for k in ("reward", "loss", "grad_norm")}
    split = [line for line in on if "split/log_ratio_abs_mean" in line]
    assert split and all(line["minibatch"] > 0 for line in split)
    assert all(line["split/log_ratio_abs_mean"] > 0 for line in split)


@pytest.mark.parametrize("region", [(1.0, 0.2), (-0.1, 0.2), (0.2, -1.0)])
def test_bad_trust_region_is_refused(region):
    with pytest.raises(ConfigError, match="split_trust_region"):
        ProbeConfig(split_trust_region=region)
