"""Engine routing traces (vLLM's `routed_experts` layout): a model's own routing written as an engine trace reads back
with zero mismatch in every file layout; a perturbed one gives the mismatch a brute-force set count gives; malformed
and mismatched traces are refused naming the file, the request and the layer."""

import numpy as np
import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import DataError, RoutingError
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate
from moe_rl.routing.engine_traces import (
    EngineRequest,
    compare_with_model,
    engine_batch,
    read_engine_trace,
    requests_from_trace,
    write_engine_trace,
)
from moe_rl.tasks import CharTokenizer

PROMPTS = ["1+2=", "12+345=", "7=", "40+5+61=", "3+3=", "99+1="]  # unequal lengths: left padding differs per row


@pytest.fixture(scope="module")
def model_and_requests():
    """A tiny model and its own sampled rollouts (prefill + decode routing) as vLLM-layout requests."""
    model = tiny_model(vocab_size=99).eval()
    tok = CharTokenizer()
    ids, valid = encode_prompts(PROMPTS, tok, "cpu")
    sample = lambda eos: generate(model, ids, valid, SamplingConfig(max_new_tokens=7), eos, tok.pad_id,
                                  torch.Generator().manual_seed(3), record=True)
    # A random model rarely samples EOS; taking a token it samples early as "EOS" gives outputs of unequal lengths.
    first = sample(tok.eos_id)
    gen = sample(int(first.tokens_BS[0, first.prompt_len + 2]))
    return model, requests_from_trace(gen.routing, gen.tokens_BS, gen.valid_BS, gen.prompt_len)


def test_requests_have_vllm_layout(model_and_requests):
    model, requests = model_and_requests
    for r in requests:
        assert r.routed_experts_RLK.dtype == np.int16
        assert r.routed_experts_RLK.shape == (len(r.prompt_token_ids) + len(r.output_token_ids) - 1,
                                              model.cfg.n_moe_layers, model.cfg.top_k)
    assert len({len(r.prompt_token_ids) for r in requests}) > 1 and len({len(r.output_token_ids) for r in requests}) > 1


@pytest.mark.parametrize("suffix", [".parquet", ".pt"])
def test_own_routing_reads_back_with_zero_mismatch(model_and_requests, tmp_path, suffix):
    model, requests = model_and_requests
    path = write_engine_trace(tmp_path / f"trace{suffix}", requests)
    back = read_engine_trace(path)
    assert [r.request_id for r in back] == [r.request_id for r in requests]
    assert all(np.array_equal(a.routed_experts_RLK, b.routed_experts_RLK) for a, b in zip(back, requests))
    stats, _ = compare_with_model(path, model)
    assert stats.n_tokens == sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in requests)
    assert (stats.churn, stats.set_change, stats.token_any) == (0.0, 0.0, 0.0)
    assert stats.churn_per_layer == [0.0] * model.cfg.n_moe_layers


def test_npy_request_with_its_json(model_and_requests, tmp_path):
    model, requests = model_and_requests
    path = write_engine_trace(tmp_path / "one.npy", requests[1:2])
    stats, batch = compare_with_model(path, model, tokens="response")
    assert stats.churn == 0.0 and stats.n_tokens == len(requests[1].output_token_ids) == batch.response_BS.sum()
    path.with_suffix(".json").unlink()
    with pytest.raises(DataError, match=r"one\.npy: a \.npy engine trace needs one\.json"):
        read_engine_trace(path)


def _perturbed(requests, seed=0, n_changes=25, n_experts=6):
    """Replace the expert in a random slot of random (request, position, layer) cells by another one."""
    rng = np.random.default_rng(seed)
    out = [EngineRequest(r.request_id, r.prompt_token_ids, r.output_token_ids, r.routed_experts_RLK.copy())
           for r in requests]
    for _ in range(n_changes):
        r = out[rng.integers(len(out))]
        i, layer, slot = (rng.integers(n) for n in r.routed_experts_RLK.shape)
        unused = sorted(set(range(n_experts)) - set(r.routed_experts_RLK[i, layer].tolist()))
        r.routed_experts_RLK[i, layer, slot] = rng.choice(unused)  # a top-k set never repeats an expert
    return out


def _brute_force(engine, trainer, response_only=False):
    """(churn, set_change, token_any, churn per layer) with Python sets over the reported (or response) rows."""
    slots, changed, tokens_changed, per_layer = [], [], [], {}
    for e, t in zip(engine, trainer):
        first = len(e.prompt_token_ids) - 1 if response_only else 0
        for i in range(first, e.routed_experts_RLK.shape[0]):
            any_layer = False
            for layer in range(e.routed_experts_RLK.shape[1]):
                a, b = set(e.routed_experts_RLK[i, layer].tolist()), set(t.routed_experts_RLK[i, layer].tolist())
                K = e.routed_experts_RLK.shape[2]
                slots.append(1 - len(a & b) / K)
                changed.append(a != b)
                any_layer |= a != b
                per_layer.setdefault(layer, []).append(1 - len(a & b) / K)
            tokens_changed.append(any_layer)
    mean = lambda xs: sum(xs) / len(xs)
    return mean(slots), mean(changed), mean(tokens_changed), [mean(per_layer[l]) for l in sorted(per_layer)]


@pytest.mark.parametrize("tokens", ["all", "response"])
def test_perturbed_trace_gives_the_brute_force_mismatch(model_and_requests, tmp_path, tokens):
    model, requests = model_and_requests
    perturbed = _perturbed(requests)
    path = write_engine_trace(tmp_path / "perturbed.parquet", perturbed)
    stats, _ = compare_with_model(path, model, tokens=tokens)
    churn, set_change, token_any, per_layer = _brute_force(perturbed, requests, response_only=tokens == "response")
    assert set_change > 0 and token_any > set_change  # several layers: a token differs somewhere more often
    assert stats.churn == pytest.approx(churn, abs=1e-6)
    assert stats.set_change == pytest.approx(set_change, abs=1e-6)
    assert stats.token_any == pytest.approx(token_any, abs=1e-6)
    assert stats.churn_per_layer == pytest.approx(per_layer, abs=1e-6)


def test_alignment_puts_engine_rows_at_the_trainer_columns(model_and_requests):
    _, requests = model_and_requests
    batch = engine_batch(requests)
    P = max(len(r.prompt_token_ids) for r in requests)
    for b, r in enumerate(requests):
        start = P - len(r.prompt_token_ids)
        assert batch.input_ids_BS[b, start].item() == r.prompt_token_ids[0]
        assert batch.input_ids_BS[b, P].item() == r.output_token_ids[0]
        assert torch.equal(batch.trace.ids_LBSK[:, b, start], torch.from_numpy(r.routed_experts_RLK[0]))
        assert batch.response_BS[b].sum() == len(r.output_token_ids)


def _with(requests, index, ids):
    changed = list(requests)
    r = requests[index]
    changed[index] = EngineRequest(r.request_id, r.prompt_token_ids, r.output_token_ids, ids)
    return changed


def test_mismatched_and_malformed_traces_are_refused_naming_the_cause(model_and_requests, tmp_path):
    model, requests = model_and_requests
    ids = requests[2].routed_experts_RLK
    cases = [
        (ids[:, :1], RoutingError, r"trace\.pt: request 2: the trace has 1 layers but the model has 3 MoE layers of 3 "
                                   r"decoder layers; layer 1"),
        (ids[:, :, :1], RoutingError, r"request 2, MoE layer 0: the trace has K=1 but the router uses K=2"),
        (np.where(np.arange(3)[None, :, None] == 2, 6, ids).astype(np.int16), RoutingError,
         r"request 2, MoE layer 2: expert ids span \[\d, 6\] but the layer has experts 0..5"),
        (np.concatenate([ids[:, :, :1], ids[:, :, :1]], axis=2), RoutingError,
         r"request 2, MoE layer 0: position 0 lists expert \d+ twice"),
        (ids[:-2], DataError, r"request 2: routed_experts has \d+ positions but prompt \+ output is \d+ tokens"),
        (ids[:, 0], DataError, r"request 2: routed_experts must be an integer array \(positions, layers, K\)"),
    ]
    for bad, error, message in cases:
        path = write_engine_trace(tmp_path / "trace.pt", _with(requests, 2, bad))
        with pytest.raises(error, match=message):
            compare_with_model(path, model)
    frame_path = write_engine_trace(tmp_path / "flat.parquet", requests)
    import pandas as pd

    frame = pd.read_parquet(frame_path)
    frame.at[4, "routed_experts_shape"] = [1, 2, 3]
    frame.to_parquet(frame_path)
    with pytest.raises(DataError, match=r"flat\.parquet: request 4 \(row 4\): routed_experts has \d+ values"):
        read_engine_trace(frame_path)
