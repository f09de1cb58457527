"""The dense twin (ModelConfig.dense_twin): each MoE layer is one always-taken expert of width K x d_expert, which
computes exactly a dense SwiGLU of that width; its router is inert; a run of it reads zero churn."""

import pytest
import torch
import torch.nn.functional as F
from conftest import metric_lines, tiny_config, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig, MoETransformer


def test_twin_has_as_many_active_feed_forward_parameters_per_token_as_the_moe():
    moe = tiny_config(n_experts=8, top_k=2, d_expert=32, d_shared_expert=16, moe_every=2, n_layers=4)
    twin = moe.dense_twin()
    assert (twin.n_experts, twin.top_k, twin.d_expert) == (1, 1, 64)
    assert (twin.d_shared_expert, twin.moe_every, twin.n_layers, twin.d_model) == (16, 2, 4, moe.d_model)
    active = lambda cfg: cfg.top_k * 3 * cfg.d_model * cfg.d_expert  # noqa: E731  gate, up, down per expert
    assert active(twin) == active(moe)


@pytest.mark.parametrize("dispatch", ["grouped", "loop", "padded"])
def test_twin_layer_equals_a_dense_swiglu_with_its_weights(dispatch):
    torch.manual_seed(0)
    model = MoETransformer(tiny_config(dispatch=dispatch).dense_twin())
    layer = model.moe_layers()[0]
    x_BSD = torch.randn(2, 5, model.cfg.d_model)
    y_BSD, _, _ = layer(x_BSD, torch.ones(2, 5, dtype=torch.bool))
    gate, up = (x_BSD @ layer.experts.w_gate_up[0]).chunk(2, dim=-1)
    expected_BSD = (F.silu(gate) * up) @ layer.experts.w_down[0]
    torch.testing.assert_close(y_BSD, expected_BSD, rtol=1e-5, atol=1e-6)


def test_twin_router_gets_exactly_zero_gradient():
    torch.manual_seed(0)
    model = MoETransformer(tiny_config(aux_loss_coef=0.01).dense_twin())
    ids_BS = torch.randint(0, model.cfg.vocab_size, (2, 7))
    out = model(ids_BS, torch.ones_like(ids_BS, dtype=torch.bool))
    (out.logits_BSV.square().mean() + out.aux_loss).backward()
    for layer in model.moe_layers():
        assert torch.count_nonzero(layer.router.gate.weight.grad) == 0
    assert model.moe_layers()[0].experts.w_down.grad.abs().sum() > 0


def test_a_twin_run_reads_zero_churn_and_moves_only_by_the_policy_loss(tmp_path):
    """A random tiny policy earns no reward, so the policy loss is 0: the MoE still moves (its load-balancing loss
    trains the routers), while the twin, whose only other loss has zero gradient, stays exactly where it was."""
    cfg = tiny_train_config(tmp_path / "moe", total_steps=2)
    moe = metric_lines(train(cfg))
    twin = metric_lines(train(tiny_train_config(tmp_path / "twin", total_steps=2, model=cfg.model.dense_twin())))
    assert all(line["reward"] == 0.0 for line in moe + twin)
    assert max(line["update/kl"] for line in moe) > 0
    assert all(line["update/kl"] == 0.0 and line["routing/update/set_change"] == 0.0 for line in twin)


def test_only_the_native_model_has_a_twin():
    with pytest.raises(ConfigError, match="dense_twin"):
        ModelConfig(backend="hf", hf_config="qwen3_moe").dense_twin()


def test_the_stability_sweep_nests_seeds_within_warm_starts_and_takes_its_own_learning_rates():
    """`warm_starts=3`: run seed s trains from SFT seed s mod 3 (the second sitting of results/dense_twin relies on
    seeds 1 and 4 sharing a warm start); `lrs` replaces the lr axis; a bad value names the argument."""
    from moe_rl.experiments.stability import stability

    spec = stability(axes="lr", methods="grpo", seeds=6, warm_starts=3, lrs="5.7e-4,1.13e-3")
    assert spec.warmstart_seeds == 3
    assert sorted({point["optim.lr"] for point in spec.grid}) == [5.7e-4, 1.13e-3]
    assert len(spec.grid) == 6 * 2
    with pytest.raises(ConfigError, match="lrs="):
        stability(axes="lr", lrs="2e-4,fast")
    with pytest.raises(ConfigError, match="warm_starts=0"):
        stability(axes="lr", warm_starts=0)
