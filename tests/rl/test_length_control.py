"""Length control (`sampling.min_new_tokens`): EOS is never drawn before the n-th response token, the sampler's
log-probs are those of the banned distribution (checked against full forwards computed here), and with
`keep_sampling_mask` the trainer scores that same distribution."""

import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import ConfigError
from moe_rl.rl.policy import policy_forward
from moe_rl.rl.rollout import SamplingConfig, generate, to_rollout_batch

PAD, EOS, MIN = 0, 2, 3


def _eos_prone_model():
    """A tiny model whose EOS logit is raised by a constant, so that an unbanned sampler stops early often."""
    model = tiny_model().eval()
    bias_V = torch.zeros(model.cfg.vocab_size)
    bias_V[EOS] = 3.0  # added to the output projection's logits by a forward hook
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias_V)
    return model


def _generate(model, cfg, seed=1):
    ids = torch.randint(3, 40, (32, 5), generator=torch.Generator().manual_seed(0))
    return generate(model, ids, torch.ones_like(ids, dtype=torch.bool), cfg, eos_id=EOS, pad_id=PAD,
                    generator=torch.Generator().manual_seed(seed))


def test_no_completion_ends_before_the_length_control_and_unbanned_ones_do():
    model = _eos_prone_model()
    free = _generate(model, SamplingConfig(max_new_tokens=8))
    banned = _generate(model, SamplingConfig(max_new_tokens=8, min_new_tokens=MIN))
    assert (free.response_BN[:, :MIN] == EOS).any(), "the model must stop early unbanned for the test to mean much"
    assert not (banned.response_BN[:, :MIN] == EOS).any()
    assert (banned.response_BN[:, MIN:] == EOS).any()  # and it still stops after


def test_sampler_log_probs_are_those_of_the_banned_distribution():
    model = _eos_prone_model()
    gen = _generate(model, SamplingConfig(max_new_tokens=8, min_new_tokens=MIN, temperature=0.8))
    with torch.no_grad():  # a full forward, no KV cache, written out here
        logits_BNV = model(gen.input_ids_BS, gen.input_valid_BS).logits_BSV[:, gen.prompt_len - 1:].float() / 0.8
    banned_BNV = logits_BNV.clone()
    banned_BNV[:, :MIN, EOS] = -torch.inf
    expected_BN = banned_BNV.log_softmax(-1).gather(-1, gen.response_BN[..., None])[..., 0]
    unbanned_BN = logits_BNV.log_softmax(-1).gather(-1, gen.response_BN[..., None])[..., 0]
    mask = gen.response_mask_BN
    torch.testing.assert_close(gen.logprobs_BN[mask], expected_BN[mask], rtol=0, atol=1e-5)
    assert (gen.logprobs_BN[:, :MIN] - unbanned_BN[:, :MIN]).min() > 0.1  # the ban moved every early token


def test_kept_support_lets_the_trainer_score_the_banned_distribution():
    model = _eos_prone_model()
    gen = _generate(model, SamplingConfig(max_new_tokens=8, min_new_tokens=MIN, keep_sampling_mask=True))
    assert not gen.support_BNV[:, :MIN, EOS].any() and gen.support_BNV[:, MIN:, EOS].all()
    zeros = torch.zeros(32)
    batch = to_rollout_batch(gen, zeros, zeros, 4, [""] * 32, [""] * 32)
    with torch.no_grad():
        kept = policy_forward(model, batch, 1.0)
    mask = batch.response_mask_BN
    torch.testing.assert_close(kept.logp_BN[mask], batch.sampler_logp_BN[mask], rtol=0, atol=1e-5)


def test_a_length_control_that_leaves_no_room_for_eos_is_refused():
    with pytest.raises(ConfigError, match="min_new_tokens=8 must be < max_new_tokens=8"):
        SamplingConfig(max_new_tokens=8, min_new_tokens=8)
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingConfig(min_new_tokens=-1)
