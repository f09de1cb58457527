"""The sampler: KV cache equals full recomputation, routing trace equals a full forward, padding, EOS, top-p."""

import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import ConfigError
from moe_rl.kernels import native, sampler
from moe_rl.rl.rollout import SamplingConfig, generate, left_align, sample_next
from moe_rl.routing.churn import churn_stats
from moe_rl.routing.replay import record_routing

EOS, PAD = 2, 0


def _prompts(B=5, P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (B, P), generator=g)
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[1, :2] = False  # left padding of different amounts
    valid[3, :4] = False
    return ids.masked_fill(~valid, PAD), valid


def _generate(model, ids, valid, seed=1, **kw):
    cfg = SamplingConfig(max_new_tokens=kw.pop("max_new_tokens", 10), **kw.pop("sampling", {}))
    g = torch.Generator().manual_seed(seed)
    return generate(model, ids, valid, cfg, eos_id=EOS, pad_id=PAD, generator=g, **kw)


# Head dim 8 and expert width 24: the sampler runs torch's decode attention and expert products; head dim 16 and
# width 32: the C kernels (decode attention over a cache with transposed keys, the fused experts).
# Both with every kernel family on, whatever this machine's measurement chose (kernels_on, conftest.py).
DECODE_PATHS = pytest.mark.parametrize("head_dim", [8, 16], ids=["torch sampler", "C sampler kernels"])
pytestmark = pytest.mark.usefixtures("kernels_on")


def _model_for(head_dim: int):
    model = tiny_model(d_model=4 * head_dim, d_expert=2 * head_dim if head_dim == 16 else 24).eval()
    kernels = head_dim == 16 and native.library() is not None
    assert model.new_cache(1, 4).keys_transposed == kernels
    experts = model.moe_layers()[0].experts
    with torch.inference_mode():
        assert sampler.serves(torch.zeros(1, model.cfg.d_model), *experts.parameters()) == kernels
    return model


@pytest.mark.numerics
@DECODE_PATHS
def test_kv_cache_gives_the_same_next_token_distributions_as_a_full_forward(head_dim):
    model = _model_for(head_dim)
    ids, valid = _prompts()
    out = _generate(model, ids, valid, record=True)
    cache = model.new_cache(ids.shape[0], out.tokens_BS.shape[1])
    P = out.prompt_len
    with torch.no_grad():
        cached = [model(out.tokens_BS[:, :P], out.valid_BS[:, :P], cache).logits_BSV[:, -1]]
        for t in range(P, out.tokens_BS.shape[1] - 1):
            cached.append(model(out.tokens_BS[:, t : t + 1], out.valid_BS[:, : t + 1], cache).logits_BSV[:, -1])
        for step, logits_cached in enumerate(cached):
            prefix = P + step  # the full forward recomputes the whole prefix
            logits_full = model(out.tokens_BS[:, :prefix], out.valid_BS[:, :prefix]).logits_BSV[:, -1]
            rows = out.valid_BS[:, prefix]  # rows still generating at this step
            torch.testing.assert_close(
                logits_cached[rows].log_softmax(-1), logits_full[rows].log_softmax(-1), rtol=0, atol=1e-5
            )


@pytest.mark.numerics
@DECODE_PATHS
def test_sampler_logprobs_equal_a_full_forward_and_routing_trace_matches(head_dim):
    model = _model_for(head_dim)
    ids, valid = _prompts()
    out = _generate(model, ids, valid, record=True)
    with torch.no_grad(), record_routing(model) as rec:
        logits = model(out.input_ids_BS, out.input_valid_BS).logits_BSV
    full_trace = rec.trace()
    assert full_trace.ids_LBSK.shape == out.routing.ids_LBSK.shape
    # Every real token is routed identically (padding rows compute the same thing too, but are don't-care).
    assert churn_stats(full_trace, out.routing, out.input_valid_BS).set_change == 0.0
    logp = logits[:, out.prompt_len - 1 :].log_softmax(-1).gather(-1, out.response_BN[..., None]).squeeze(-1)
    mask = out.response_mask_BN
    torch.testing.assert_close(logp[mask], out.logprobs_BN[mask], rtol=0, atol=1e-5)
    assert (out.logprobs_BN[~mask] == 0).all()


@pytest.mark.numerics
@DECODE_PATHS
def test_cached_and_uncached_sampling_draw_the_same_tokens(head_dim):
    model = _model_for(head_dim)
    ids, valid = _prompts()
    cached = _generate(model, ids, valid, record=True)
    uncached = _generate(model, ids, valid, record=True, use_cache=False)
    assert torch.equal(cached.tokens_BS, uncached.tokens_BS)
    assert churn_stats(cached.routing, uncached.routing, cached.input_valid_BS).set_change == 0.0


def test_left_and_right_padded_prompts_give_the_same_generation():
    model = tiny_model().eval()
    ids, valid = _prompts()
    right_ids, right_valid = torch.full_like(ids, PAD), torch.zeros_like(valid)
    for row in range(ids.shape[0]):
        real = ids[row][valid[row]]
        right_ids[row, : len(real)] = real
        right_valid[row, : len(real)] = True
    left = _generate(model, ids, valid)
    right = _generate(model, right_ids, right_valid)
    assert torch.equal(left.tokens_BS, right.tokens_BS)
    assert torch.equal(left.valid_BS, right.valid_BS)


def test_left_align_keeps_token_order():
    ids = torch.tensor([[5, 6, 0, 0], [0, 7, 0, 8]])
    valid = ids != 0
    aligned, aligned_valid = left_align(ids, valid)
    assert aligned.tolist() == [[0, 0, 5, 6], [0, 0, 7, 8]]
    assert aligned_valid.tolist() == [[False, False, True, True], [False, False, True, True]]


def test_generation_stops_at_eos_per_sequence():
    model = tiny_model(vocab_size=40).eval()
    with torch.no_grad():  # make EOS likely so sequences finish at different steps
        model.lm_head.weight[EOS] += 0.8 * model.lm_head.weight.std() * torch.randn(model.cfg.d_model).sign()
    ids, valid = _prompts(B=16)
    out = _generate(model, ids, valid, max_new_tokens=12)
    response, mask = out.response_BN, out.response_mask_BN
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max(), "the test needs sequences of different lengths"
    for row in range(response.shape[0]):
        n = int(lengths[row])
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (response[row, n:] == PAD).all()
        if n < response.shape[1]:
            assert response[row, n - 1] == EOS  # ended by EOS, which is a (valid) response token
        assert (response[row, : n - 1] != EOS).all()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, SamplingConfig(top_p=0.7), g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample_next(logits, SamplingConfig(top_p=0.4), g)[0]) for _ in range(50)}
    assert draws == {0}


def test_temperature_scales_reported_logprobs():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    token, logp = sample_next(logits, SamplingConfig(temperature=0.5), g)
    expected = torch.log_softmax(logits / 0.5, -1)[0, token]
    torch.testing.assert_close(logp, expected)


@pytest.mark.parametrize("kw, field", [(dict(top_p=0.0), "top_p"), (dict(temperature=0.0), "temperature"),
                                       (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_sampling_config_names_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**kw)


def test_inverse_cdf_draw_matches_the_distribution_and_skips_zero_probabilities():
    from moe_rl.rl.rollout import inverse_cdf_draw

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).expand(20000, 4)
    draws = inverse_cdf_draw(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[1] == 0
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)
    unnormalised = inverse_cdf_draw(probs * 3.0, torch.Generator().manual_seed(0))
    assert torch.equal(unnormalised, draws)
