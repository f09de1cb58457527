"""Replay variants (moe_rl.routing.replay.ReplayConfig): R3 replaying the sampler's gate weights, and margin-threshold
replay; both in a plain forward with known answers, and through a short training run."""

import math

import pytest
import torch
from conftest import metric_lines, tiny_model, tiny_train_config

from moe_rl.commands.train import check_inputs, train
from moe_rl.errors import ConfigError, RoutingError
from moe_rl.model.moe import topk_margin_T
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import RolloutConfig
from moe_rl.routing.replay import ReplayConfig, record_routing, replay_routing
from moe_rl.routing.trace import RoutingTrace


def _batch(B=3, S=10, vocab=40):
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones(B, S, dtype=torch.bool)


def _gate_grads(model):
    return [layer.router.gate.weight.grad for layer in model.moe_layers()]


def test_recorded_weights_are_the_gate_weights_the_experts_used():
    model = tiny_model()
    ids, valid = _batch()
    outputs = []
    hooks = [layer.router.register_forward_hook(lambda m, i, out: outputs.append(out)) for layer in model.moe_layers()]
    with torch.no_grad(), record_routing(model, with_weights=True) as rec:
        model(ids, valid)
    for hook in hooks:
        hook.remove()
    trace = rec.trace()
    assert trace.weights_LBSK.shape == trace.ids_LBSK.shape and trace.weights_LBSK.dtype == torch.float32
    for layer, out in enumerate(outputs):  # the softmax scores at the chosen ids, renormalised (norm_topk_prob)
        scores_TK = out.scores_TE.gather(-1, out.ids_TK)
        assert torch.equal(trace.weights_LBSK[layer].reshape(-1, 2), scores_TK / scores_TK.sum(-1, keepdim=True))
    assert torch.equal(trace.rows(torch.tensor([2, 0])).weights_LBSK, trace.weights_LBSK[:, [2, 0]])
    assert torch.equal(RoutingTrace.cat([trace, trace]).weights_LBSK, torch.cat([trace.weights_LBSK] * 2, dim=1))


def test_replayed_gate_weights_reach_the_experts_and_cut_the_router_gradient():
    model = tiny_model()
    ids, valid = _batch()
    with torch.no_grad(), record_routing(model, with_weights=True) as rec:
        reference = model(ids, valid).logits_BSV
    trace = rec.trace()
    options = ReplayConfig(gate_weights=True)
    # the trace's own weights: the same forward, bit for bit
    with replay_routing(model, trace, options=options):
        same = model(ids, valid).logits_BSV
    assert torch.equal(same, reference)
    same.sum().backward()
    assert all(g is None or g.abs().max() == 0 for g in _gate_grads(model)), "replayed weights pass no gradient"
    # doubled weights: a different output, and still no router gradient
    model.zero_grad()
    with replay_routing(model, RoutingTrace(trace.ids_LBSK, 2 * trace.weights_LBSK), options=options):
        doubled = model(ids, valid).logits_BSV
    assert not torch.allclose(doubled, reference)
    doubled.sum().backward()
    assert all(g is None or g.abs().max() == 0 for g in _gate_grads(model))
    # ids-only replay of the same trace keeps the router's gradient (docs/design.md section 4)
    model.zero_grad()
    with replay_routing(model, trace):
        model(ids, valid).logits_BSV.sum().backward()
    assert all(g is not None and g.abs().sum() > 0 for g in _gate_grads(model))


def test_gate_weights_need_a_trace_with_weights():
    model = tiny_model()
    ids, valid = _batch()
    with torch.no_grad(), record_routing(model) as rec:
        model(ids, valid)
    with pytest.raises(RoutingError, match="gate weights"):
        replay_routing(model, rec.trace(), options=ReplayConfig(gate_weights=True))


def _other_trace(trace: RoutingTrace, n_experts: int) -> RoutingTrace:
    """Every decision moved to other experts (a shift by one keeps the K ids distinct)."""
    return RoutingTrace(((trace.ids_LBSK.long() + 1) % n_experts).to(torch.int16))


def test_margin_replay_sends_each_decision_where_its_margin_says():
    model = tiny_model(n_layers=1)  # one MoE layer: its router input does not depend on any replay
    ids, valid = _batch()
    seen = []
    layer = model.moe_layers()[0]
    with torch.no_grad(), record_routing(model) as rec:
        hook = layer.router.register_forward_hook(lambda m, i, out: seen.append(out.scores_TE.detach()))
        model(ids, valid)
        hook.remove()
    native = rec.trace()
    margin_T = topk_margin_T(seen[0], layer.top_k)
    threshold = margin_T.median().item()
    other = _other_trace(native, layer.n_experts)
    used = []
    hook = layer.experts.register_forward_pre_hook(lambda m, args: used.append(args[2].clone()))
    with torch.no_grad(), replay_routing(model, other, options=ReplayConfig(margin_threshold=threshold)) as rep:
        model(ids, valid)
    hook.remove()
    low_T = margin_T < threshold
    expected_TK = torch.where(low_T[:, None], other.ids_LBSK[0].reshape(-1, layer.top_k).long(),
                              native.ids_LBSK[0].reshape(-1, layer.top_k).long())
    assert torch.equal(used[0], expected_TK)
    assert rep.margin_stats()["routing/margin_replay/replayed_frac"] == pytest.approx(low_T.float().mean().item())
    # a threshold no margin reaches replays everything; margins are >= 0, so a tiny one replays (almost) nothing
    with torch.no_grad(), replay_routing(model, other, options=ReplayConfig(margin_threshold=math.inf)) as rep:
        model(ids, valid)
    assert rep.margin_stats()["routing/margin_replay/replayed_frac"] == 1.0


@pytest.mark.parametrize("kw, mode, named", [
    (dict(gate_weights=True), "R2", "needs routing_mode R3"),
    (dict(margin_threshold=0.01), "native", "needs routing_mode R2 or R3"),
])
def test_replay_variants_need_a_replaying_mode(tmp_path, kw, mode, named):
    cfg = tiny_train_config(tmp_path / "run", routing_mode=mode, replay=ReplayConfig(**kw))
    with pytest.raises(ConfigError, match=named):
        check_inputs(cfg)
    with pytest.raises(ConfigError, match="must be > 0"):
        ReplayConfig(margin_threshold=0.0)


@pytest.mark.parametrize("replay", [ReplayConfig(gate_weights=True), ReplayConfig(margin_threshold=0.05)])
def test_replay_variants_train(tmp_path, replay):
    sampling = SamplingConfig(max_new_tokens=6, precision="bf16")
    cfg = tiny_train_config(tmp_path / "run", total_steps=2, routing_mode="R3", replay=replay,
                            rollout=RolloutConfig(prompts_per_step=4, group_size=4, sampling=sampling))
    lines = metric_lines(train(cfg))
    assert len(lines) == 8 and all(math.isfinite(line["loss"]) for line in lines)
    if replay.margin_threshold is not None:
        shares = [line["routing/margin_replay/replayed_frac"] for line in lines]
        assert all(0 <= s <= 1 for s in shares) and 0 < max(shares)
    for line in lines:
        assert line["routing/replay/replace_rate"] == line["routing/replay/set_change"]
