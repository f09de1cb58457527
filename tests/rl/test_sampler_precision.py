"""The emulated bf16 inference engine (`sampling.precision bf16`): its routing differs from the fp32 trainer's at a
measurable rate, and the default sampler routes exactly like the trainer."""

from __future__ import annotations

import pytest
from conftest import sample_and_refit

from moe_rl.errors import ConfigError
from moe_rl.rl.rollout import SamplingConfig


def test_bf16_engine_routes_differently_from_the_fp32_trainer_and_the_default_does_not():
    same, same_gap = sample_and_refit("trainer")
    assert same.set_change == 0.0 and same_gap < 1e-5
    engine, engine_gap = sample_and_refit("bf16")
    assert 0.001 < engine.set_change < 0.5  # some router decisions flip, most do not
    assert engine.token_any > engine.set_change and engine_gap > 1e-4


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="precision"):
        SamplingConfig(precision="fp4")
