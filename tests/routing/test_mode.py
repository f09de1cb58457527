"""The routing mode as one object (moe_rl.routing.mode) and the router's replay as arguments (moe_rl.model.moe)."""

import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import ConfigError
from moe_rl.model.moe import ReplayInputs, Router, topk_margin_T
from moe_rl.routing.mode import RoutingMode
from moe_rl.routing.replay import ReplayConfig
from moe_rl.routing.trace import RoutingTrace


def _trace(tag: int) -> RoutingTrace:
    return RoutingTrace(torch.full((1, 2, 3, 2), tag, dtype=torch.int16))


@pytest.mark.parametrize("name, old_pass, update",
                         [("native", None, None), ("R2", None, "old"), ("R3", "sampler", "sampler")])
def test_each_mode_says_what_the_old_pass_and_each_update_replay(name, old_pass, update):
    sampler, old = _trace(1), _trace(2)
    mode = RoutingMode.of(name)
    named = {None: None, "sampler": sampler, "old": old}
    assert mode.old_pass_replay(sampler) is named[old_pass]
    assert mode.update_replay(sampler, old) is named[update]
    assert mode.replays_sampler == (name == "R3") and mode.replays_old_pass == (name == "R2")


def test_a_mode_is_refused_with_a_variant_it_cannot_apply_or_an_unknown_name():
    assert RoutingMode.of("R3", ReplayConfig(gate_weights=True)).sampler_records_weights
    with pytest.raises(ConfigError, match="needs routing_mode R3, not 'R2'"):
        RoutingMode.of("R2", ReplayConfig(gate_weights=True))
    with pytest.raises(ConfigError, match="needs routing_mode R2 or R3"):
        RoutingMode.of("native", ReplayConfig(margin_threshold=0.1))
    with pytest.raises(ConfigError, match="routing_mode='R4' is not valid; choose one of: 'native', 'R2', 'R3'"):
        RoutingMode.of("R4")


def _router_input(seed=0):
    torch.manual_seed(seed)
    router = Router(d_model=8, n_experts=6, top_k=2, norm_topk_prob=True)
    return router, torch.randn(10, 8)


def test_the_router_takes_replayed_ids_weights_and_a_margin_as_arguments():
    router, x_TD = _router_input()
    own = router(x_TD)
    other_TK = (own.ids_TK + 1) % 6
    # ids only: weights gathered from the router's own scores at the replayed ids, with their gradient
    ids_only = router(x_TD, ReplayInputs(other_TK))
    gathered_TK = own.scores_TE.gather(-1, other_TK)
    assert torch.equal(ids_only.ids_TK, other_TK)
    assert torch.equal(ids_only.weights_TK, gathered_TK / gathered_TK.sum(-1, keepdim=True))
    assert ids_only.weights_TK.requires_grad
    # ids and weights: the given weights, constants (no gradient back to the gate)
    weights_TK = torch.full((10, 2), 0.5)
    both = router(x_TD, ReplayInputs(other_TK, weights_TK))
    assert torch.equal(both.weights_TK, weights_TK) and not both.weights_TK.requires_grad
    # a margin: replayed exactly where the router's own margin is below it, its own choice elsewhere
    margin_T = topk_margin_T(own.scores_TE.detach(), 2)
    threshold = margin_T.median().item()
    some = router(x_TD, ReplayInputs(other_TK, margin=threshold))
    below_T = margin_T < threshold
    assert 0 < below_T.sum() < 10
    assert torch.equal(some.replayed_T, below_T)
    assert torch.equal(some.ids_TK, torch.where(below_T[:, None], other_TK, own.ids_TK))
    assert torch.equal(some.native_ids_TK, own.ids_TK)


def test_replay_attaches_no_hook_to_the_routers():
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 5))
    valid = torch.ones(2, 5, dtype=torch.bool)
    from moe_rl.routing.replay import record_routing, replay_routing

    with torch.no_grad(), record_routing(model, with_weights=True) as rec:
        model(ids, valid)
    options = ReplayConfig(gate_weights=True, margin_threshold=0.05)
    with torch.no_grad(), replay_routing(model, rec.trace(), options=options):
        for layer in model.moe_layers():
            assert not layer.router._forward_pre_hooks and not layer.router._forward_hooks
        model(ids, valid)
