"""The engine trace schemas of today's engines (moe_rl/routing/engine_traces.py): vLLM 0.3x's HTTP responses (base64
`.npy`, uint8/uint16, every decoder layer, `routed_experts_prompt_start`) and SGLang's (base64 of the raw int32
buffer, every decoder layer). A model's own routing written in each schema compares with zero mismatch; a cut-short
array is a one-line DataError, never a traceback."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import DataError
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate
from moe_rl.routing.engine_traces import (
    EngineRequest,
    compare_with_model,
    decoder_layers_of,
    read_engine_trace,
    requests_from_trace,
    write_engine_trace,
)
from moe_rl.tasks import CharTokenizer

PROMPTS = ["1+2=", "12+345=", "7=", "40+5+61="]


@pytest.fixture(scope="module")
def dense_and_moe():
    """A model whose decoder layers 0 and 2 are dense and 1 and 3 MoE, and its own sampled routing as requests."""
    model = tiny_model(vocab_size=99, n_layers=4, moe_every=2).eval()
    tok = CharTokenizer()
    ids, valid = encode_prompts(PROMPTS, tok, "cpu")
    gen = generate(model, ids, valid, SamplingConfig(max_new_tokens=6), tok.eos_id, tok.pad_id,
                   torch.Generator().manual_seed(1), record=True)
    return model, requests_from_trace(gen.routing, gen.tokens_BS, gen.valid_BS, gen.prompt_len)


def _every_layer(model, ids_RLK: np.ndarray, dtype) -> np.ndarray:
    """The MoE-layer array spread over every decoder layer, dense layers all zeros (as vLLM 0.3x and SGLang)."""
    n_decoder, moe_index = decoder_layers_of(model)
    out = np.zeros((ids_RLK.shape[0], n_decoder, ids_RLK.shape[2]), dtype=dtype)
    out[:, moe_index] = ids_RLK
    return out


def _npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _vllm_response(model, requests, start: int = 0, dtype=np.uint8) -> dict:
    """A vLLM 0.3x completion response body (return_token_ids on, routed experts on), one choice per request."""
    choices = [{"index": i, "text": "", "prompt_token_ids": r.prompt_token_ids, "token_ids": r.output_token_ids,
                "routed_experts": _npy_b64(_every_layer(model, r.routed_experts_RLK[start:], dtype))}
               for i, r in enumerate(requests)]
    return {"id": "cmpl-1", "object": "text_completion", "choices": choices, "routed_experts_prompt_start": start}


def _sglang_response(model, request) -> dict:
    """An SGLang /generate response with the request's input_ids added."""
    flat = _every_layer(model, request.routed_experts_RLK, np.int32).tobytes()
    return {"text": "", "output_ids": request.output_token_ids, "input_ids": request.prompt_token_ids,
            "meta_info": {"id": f"sg-{request.request_id}", "routed_experts": base64.b64encode(flat).decode()}}


def _jsonl(path, bodies) -> str:
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return path


def _n_rows(requests, start=0) -> int:
    return sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 - start for r in requests)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_vllm_03x_http_every_layer_reads_back_with_zero_mismatch(dense_and_moe, tmp_path, dtype):
    model, requests = dense_and_moe
    assert decoder_layers_of(model) == (4, [1, 3])
    path = _jsonl(tmp_path / "vllm.jsonl", [_vllm_response(model, requests, dtype=dtype)])
    back = read_engine_trace(path)
    assert [r.routed_experts_RLK.shape[1] for r in back] == [4] * len(requests)  # every decoder layer as sent
    stats, _ = compare_with_model(path, model)
    assert stats.n_tokens == _n_rows(requests)
    assert (stats.churn, stats.set_change, stats.token_any) == (0.0, 0.0, 0.0)


def test_vllm_prompt_start_skips_the_first_prompt_tokens(dense_and_moe, tmp_path):
    model, requests = dense_and_moe
    path = _jsonl(tmp_path / "turn2.jsonl", [_vllm_response(model, requests, start=2)])
    stats, batch = compare_with_model(path, model)
    assert stats.n_tokens == _n_rows(requests, start=2) == int(batch.reported_BS.sum())
    assert stats.set_change == 0.0
    # The engine's first row sits at the request's third token: the two before are not reported.
    P = max(len(r.prompt_token_ids) for r in requests)
    for b, r in enumerate(requests):
        first = P - len(r.prompt_token_ids)
        assert not batch.reported_BS[b, first:first + 2].any() and batch.reported_BS[b, first + 2]
    # Rows of a request read with the wrong start no longer fit its tokens.
    bad = _vllm_response(model, requests, start=2)
    bad["routed_experts_prompt_start"] = 1
    with pytest.raises(DataError, match=r"routed_experts has \d+ positions .* less the 1 skipped prompt tokens"):
        read_engine_trace(_jsonl(tmp_path / "bad.jsonl", [bad]))


def test_sidecar_prompt_start_and_uint16_npy(dense_and_moe, tmp_path):
    model, requests = dense_and_moe
    r = requests[1]
    ids = _every_layer(model, r.routed_experts_RLK[3:], np.uint16)
    path = write_engine_trace(tmp_path / "one.npy", [EngineRequest("a", r.prompt_token_ids, r.output_token_ids,
                                                                   ids, prompt_start=3)])
    assert json.loads(path.with_suffix(".json").read_text())["routed_experts_prompt_start"] == 3
    stats, _ = compare_with_model(path, model)
    assert stats.n_tokens == _n_rows([r], start=3) and stats.set_change == 0.0


def test_sglang_http_reads_back_with_zero_mismatch(dense_and_moe, tmp_path):
    model, requests = dense_and_moe
    path = _jsonl(tmp_path / "sglang.jsonl", [_sglang_response(model, r) for r in requests])
    stats, _ = compare_with_model(path, model)
    assert stats.n_tokens == _n_rows(requests) and stats.set_change == 0.0
    with pytest.raises(DataError, match=r"line 1: SGLang's routed_experts is a flat int32 buffer; reading it needs "
                                        r"the router's K"):
        read_engine_trace(path)
    assert read_engine_trace(path, top_k=2)[0].routed_experts_RLK.shape[1:] == (4, 2)


def _one_line_error(path, **kwargs) -> str:
    with pytest.raises(DataError) as caught:
        read_engine_trace(path, **kwargs)
    message = str(caught.value)
    error = caught.value  # no chained traceback either: no cause, and any context suppressed
    assert "\n" not in message and error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    return message


def test_cut_short_arrays_are_one_line_errors(dense_and_moe, tmp_path):
    model, requests = dense_and_moe
    # A .npy file cut short (half its bytes), and one with nothing but half a header.
    path = write_engine_trace(tmp_path / "cut.npy", requests[:1])
    whole = path.read_bytes()
    for size in (len(whole) // 2, 40):
        path.write_bytes(whole[:size])
        assert "cut.npy cannot be read as a .npy integer array" in _one_line_error(path)
    # vLLM 0.3x's base64 .npy cut short in the response.
    body = _vllm_response(model, requests[:1])
    text = body["choices"][0]["routed_experts"]
    body["choices"][0]["routed_experts"] = text[: (len(text) // 2) // 4 * 4]
    assert "choice 0: routed_experts is not a whole .npy integer array" in _one_line_error(
        _jsonl(tmp_path / "cut.jsonl", [body]))
    body["choices"][0]["routed_experts"] = "not base64!"
    assert "routed_experts is not valid base64" in _one_line_error(_jsonl(tmp_path / "junk.jsonl", [body]))
    # SGLang's raw buffer cut short: by a byte, and by a whole row.
    sg = _sglang_response(model, requests[0])
    raw = base64.b64decode(sg["meta_info"]["routed_experts"])
    for cut in (raw[:-1], raw[: -4 * 2]):
        sg["meta_info"]["routed_experts"] = base64.b64encode(cut).decode()
        message = _one_line_error(_jsonl(tmp_path / "sg.jsonl", [sg]), top_k=2)
        assert "cut short" in message
    # A line that is neither engine's response.
    assert "neither a vLLM completion" in _one_line_error(_jsonl(tmp_path / "other.jsonl", [{"x": 1}]))
