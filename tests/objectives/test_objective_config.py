"""The objective registry and ObjectiveConfig: names, defaults, trainer flags, and refusal of bad input."""

from __future__ import annotations

import pytest
import torch

from moe_rl.errors import ConfigError
from moe_rl.objectives import OBJECTIVES, ObjectiveConfig, get_objective, register_objective

torch.set_num_threads(1)

NAMES = ["grpo", "gspo", "gspo_token", "dr_grpo", "dapo", "cispo", "gmpo"]


def small_batch():
    """(logp, old_logp, advantages, mask): 2 sequences of 3 and 6 tokens, T = 6."""
    mask = torch.arange(6)[None, :] < torch.tensor([3, 6])[:, None]
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 6, generator=g)
    return old + 0.1 * torch.randn(2, 6, generator=g), old, torch.tensor([1.0, -1.0]), mask


def test_specs_carry_the_trainer_flags():
    assert not get_objective("dr_grpo").normalize_adv_by_std
    assert get_objective("dapo").drop_zero_std_groups
    others = [n for n in NAMES if n not in ("dr_grpo", "dapo")]
    assert all(OBJECTIVES[n].normalize_adv_by_std and not OBJECTIVES[n].drop_zero_std_groups for n in others)
    assert get_objective("gspo").default_clip == (3e-4, 4e-4) and get_objective("grpo").default_clip == (0.2, 0.27)
    assert all(OBJECTIVES[n].summary for n in NAMES)


def test_unknown_name_lists_valid_names():
    for make in (lambda: ObjectiveConfig(name="ppo"), lambda: get_objective("ppo")):
        with pytest.raises(ConfigError) as err:
            make()
        assert "ppo" in str(err.value) and all(repr(n) in str(err.value) for n in NAMES)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_low": -0.1}, {"clip_high": -1e-4}, {"clip_low": 1.0}, {"name": "gspo", "clip_low": 1.5},
        {"name": "gmpo", "clip_high": -0.4}, {"name": "dr_grpo", "max_response_len": 0},
    ],
)
def test_bad_clip_or_length_is_refused(kwargs):
    with pytest.raises(ConfigError):
        ObjectiveConfig(**kwargs)


def test_clip_low_of_one_or_more_is_fine_outside_ratio_space():
    ObjectiveConfig(name="gmpo", clip_low=1.5)  # log-space bound -1.5
    ObjectiveConfig(name="cispo", clip_low=1.5)  # weight floor -0.5: no floor


def test_config_for_another_objective_is_checked_when_called():
    logp, old, adv, mask = small_batch()
    with pytest.raises(ConfigError):
        get_objective("grpo").fn(logp, old, adv, mask, ObjectiveConfig(name="gmpo", clip_low=1.5))


def test_bad_shapes_and_too_short_max_len_are_refused():
    logp, old, adv, mask = small_batch()
    with pytest.raises(ValueError, match="advantages"):
        get_objective("grpo")(logp, old, adv[:1], mask, ObjectiveConfig())
    with pytest.raises(ValueError, match="same"):
        get_objective("grpo")(logp, old[:, :4], adv, mask, ObjectiveConfig())
    with pytest.raises(ValueError, match="max_response_len"):
        get_objective("dr_grpo")(logp, old, adv, mask, ObjectiveConfig(name="dr_grpo", max_response_len=4))


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        register_objective("grpo", default_clip=(0.2, 0.2))(lambda *a: None)


def test_tyro_parses_the_config():
    tyro = pytest.importorskip("tyro")
    cfg = tyro.cli(ObjectiveConfig, args=["--name", "gspo", "--clip-high", "0.001"])
    assert cfg == ObjectiveConfig(name="gspo", clip_high=0.001)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_log_probs_give_a_float32_loss_and_a_bf16_gradient(name):
    logp, old, adv, mask = small_batch()
    logp = logp.bfloat16().requires_grad_(True)
    cfg = ObjectiveConfig(name=name, clip_low=0.5, clip_high=0.5)  # wide: nothing clipped, every gradient flows
    loss, _ = get_objective(name)(logp, old.bfloat16(), adv, mask, cfg)
    loss.backward()
    assert loss.dtype == torch.float32 and logp.grad.dtype == torch.bfloat16
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum() > 0
