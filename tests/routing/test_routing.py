"""The routing contract: record/replay sessions are exact, replay errors name the layer, churn arithmetic."""

import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import RoutingError
from moe_rl.routing.churn import churn_stats
from moe_rl.routing.replay import record_routing, replay_routing
from moe_rl.routing.trace import RoutingTrace


def _batch(B=3, S=10, vocab=40):
    return torch.randint(0, vocab, (B, S)), torch.ones(B, S, dtype=torch.bool)


def _router_grads(model):
    return [layer.router.gate.weight.grad.clone() for layer in model.moe_layers()]


@pytest.mark.numerics
def test_replaying_a_recorded_trace_reproduces_logits_and_router_gradients_exactly():
    model = tiny_model()
    ids, valid = _batch()
    with record_routing(model) as rec:
        native = model(ids, valid)
    native.logits_BSV.sum().backward()
    native_grads = _router_grads(model)
    model.zero_grad()
    with replay_routing(model, rec.trace()):
        replayed = model(ids, valid)
    replayed.logits_BSV.sum().backward()
    assert (replayed.logits_BSV - native.logits_BSV).abs().max().item() == 0.0
    for native_grad, replay_grad in zip(native_grads, _router_grads(model)):
        assert torch.equal(native_grad, replay_grad)
        assert native_grad.abs().sum() > 0


def test_replaying_a_different_trace_reroutes_tokens_and_keeps_router_gradient():
    model = tiny_model()
    ids, valid = _batch()
    with record_routing(model) as rec:
        native = model(ids, valid).logits_BSV
    trace = rec.trace()
    shifted = RoutingTrace((trace.ids_LBSK.long() + 1) % 6)  # every token to different experts
    model.zero_grad()
    with replay_routing(model, shifted, record_native=True) as rep:
        replayed = model(ids, valid).logits_BSV
    replayed.sum().backward()
    assert not torch.allclose(replayed, native)
    # Layer 0's input does not depend on routing, so its native choice under replay is the recorded one.
    assert torch.equal(rep.native_trace().ids_LBSK[0], trace.ids_LBSK[0])  # layer 0 sees the same input
    assert churn_stats(trace, shifted).churn > 0.4
    for grad in _router_grads(model):
        assert grad.abs().sum() > 0


def test_replay_makes_the_routers_use_the_given_ids():
    model = tiny_model()
    ids, valid = _batch()
    forced = RoutingTrace(torch.zeros(3, 3, 10, 2, dtype=torch.int16))
    forced.ids_LBSK[..., 1] = 5
    # Only the forced experts 0 and 5 take part, so only they receive gradient.
    with replay_routing(model, forced):
        model(ids, valid).logits_BSV.sum().backward()
    grad_E = model.moe_layers()[1].experts.w_down.grad.abs().sum(dim=(1, 2))
    assert (grad_E[[0, 5]] > 0).all() and (grad_E[1:5] == 0).all()


@pytest.mark.parametrize(
    "make_ids, message",
    [
        (lambda t: t[:2], r"2 MoE layers but the model has 3; layer 2"),
        (lambda t: t[..., :1], r"MoE layer 0: the trace has K=1"),
        (lambda t: t[:, :, :7], r"MoE layer 0: the replay trace covers \(3, 7\)"),
        (lambda t: _set(t, 1, 9), r"MoE layer 1: expert ids span \[0, 9\]"),
        (lambda t: _set(t, 2, -1), r"MoE layer 2: expert ids span \[-1"),
    ],
)
def test_bad_replay_trace_is_refused_naming_the_layer(make_ids, message):
    model = tiny_model()
    ids, valid = _batch()
    with record_routing(model) as rec:
        model(ids, valid)
    bad = RoutingTrace(make_ids(rec.trace().ids_LBSK.clone()))
    with pytest.raises(RoutingError, match=message):
        with replay_routing(model, bad):
            model(ids, valid)
    assert all(layer.routing_session is None for layer in model.moe_layers()), "a failed session must detach"


def _set(ids, layer, value):
    ids[layer, 0, 0, 0] = value
    return ids


def test_sessions_do_not_nest():
    model = tiny_model()
    with record_routing(model):
        with pytest.raises(RoutingError, match="already has an active routing session"):
            with record_routing(model):
                pass


def test_recording_stitches_successive_forwards_along_positions():
    model = tiny_model().eval()
    ids, valid = _batch(B=2, S=9)
    with record_routing(model) as full:
        model(ids, valid)
    cache = model.new_cache(2, 9)
    with record_routing(model) as stepwise:
        model(ids[:, :5], valid[:, :5], cache)
        for t in range(5, 9):
            model(ids[:, t : t + 1], valid[:, : t + 1], cache)
    assert torch.equal(stepwise.trace().ids_LBSK, full.trace().ids_LBSK)


def test_router_entropy_recorded_per_token():
    model = tiny_model()
    ids, valid = _batch()
    with record_routing(model, with_entropy=True) as rec:
        model(ids, valid)
    entropy_LBS = rec.router_entropy_LBS()
    assert entropy_LBS.shape == (3, 3, 10)
    assert (entropy_LBS > 0).all() and (entropy_LBS <= torch.log(torch.tensor(6.0)) + 1e-5).all()


# --- churn arithmetic on hand-built traces -------------------------------------------------------------


def _trace(rows):
    """rows: per layer, per token, K expert ids; one sequence."""
    return RoutingTrace(torch.tensor(rows, dtype=torch.int16)[:, None])


def test_churn_of_identical_traces_is_zero():
    a = _trace([[[0, 1], [2, 3]], [[4, 5], [0, 2]]])
    stats = churn_stats(a, a)
    assert (stats.churn, stats.set_change, stats.token_any, stats.layers_changed) == (0.0, 0.0, 0.0, 0.0)


def test_churn_k2_with_one_shared_expert_is_half():
    stats = churn_stats(_trace([[[0, 1]]]), _trace([[[1, 3]]]))
    assert stats.churn == 0.5 and stats.set_change == 1.0


def test_churn_ignores_slot_order():
    assert churn_stats(_trace([[[0, 1]]]), _trace([[[1, 0]]])).churn == 0.0


def test_churn_metrics_on_a_two_layer_example():
    # Layer 0: token 0 keeps {0,1}; token 1 {2,3} -> {2,4} (half).  Layer 1: token 0 {4,5} -> {0,1} (all),
    # token 1 keeps {0,2}.
    a = _trace([[[0, 1], [2, 3]], [[4, 5], [0, 2]]])
    b = _trace([[[1, 0], [4, 2]], [[0, 1], [2, 0]]])
    stats = churn_stats(a, b)
    assert stats.churn_per_layer == [0.25, 0.5]
    assert stats.churn == pytest.approx(0.375)
    assert stats.set_change == 0.5  # 2 of 4 (token, layer) decisions changed
    assert stats.token_any == 1.0  # both tokens changed somewhere
    assert stats.layers_changed == 1.0  # each token changed in exactly one layer
    metrics = stats.as_metrics("routing/update/")
    assert metrics["routing/update/churn/L1"] == 0.5


def test_churn_respects_the_token_mask():
    a = _trace([[[0, 1], [2, 3]]])
    b = _trace([[[0, 1], [4, 5]]])
    assert churn_stats(a, b, torch.tensor([[True, False]])).churn == 0.0
    assert churn_stats(a, b, torch.tensor([[False, True]])).churn == 1.0
    assert churn_stats(a, b, torch.tensor([[False, False]])).n_tokens == 0


def test_churn_refuses_traces_of_different_shape():
    with pytest.raises(RoutingError, match="different shape"):
        churn_stats(_trace([[[0, 1]]]), _trace([[[0, 1], [2, 3]]]))
