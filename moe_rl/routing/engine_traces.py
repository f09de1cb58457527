"""Routing traces from inference engines: read them, lay them out like the trainer's input, compare.

Three engine schemas are read. Each gives per request an integer array `[rows, layers, K]` whose row i holds the
experts each layer chose for token i of prompt + output, the forward whose logits predict token i + 1 (the last
token is never fed back, hence sequence length - 1 rows):

| engine            | where                                        | dtype                 | layers                 |
|-------------------|----------------------------------------------|-----------------------|------------------------|
| vLLM 0.21         | `CompletionOutput.routed_experts`            | int16                 | MoE layers only        |
| vLLM 0.3x (0.32)  | `CompletionOutput.routed_experts`; over HTTP | uint8 (<= 256 experts)| every decoder layer    |
|                   | each choice's `routed_experts`: base64 of    | else uint16 (int32    | (dense ones all zeros) |
|                   | `.npy` bytes, `np.load(BytesIO(b64decode))`  | documented too)       |                        |
| SGLang (current)  | `meta_info["routed_experts"]`: base64 of the | int32, raw bytes, no  | every decoder layer    |
|                   | raw C-order buffer, no header                | shape: K must be given| (dense ones all zeros) |

vLLM 0.3x's request field `routed_experts_prompt_start` = s skips the first s prompt tokens: the array then has
sequence length - 1 - s rows, starting at token s (multi-turn agents ask only for the new part). SGLang's buffer
keeps the fused shared-expert columns out of the returned K. A trace whose layer axis counts every decoder layer is
narrowed to the model's MoE layers by their decoder index (`check_against_model`), so both layouts compare.

An engine trace is a list of `EngineRequest`s, read from one of three file layouts:

    .parquet  one row per request: request_id (string), prompt_token_ids (list<int64>), output_token_ids
              (list<int64>), routed_experts (list<int16 or int32>, the [positions, layers, K] array flattened in
              C order) and routed_experts_shape (list<int64>, its 3 sizes)
    .pt       torch.save of a list of dicts with the same keys; routed_experts a tensor or array of 3 dimensions
              (routed_experts_shape not needed)
    .npy      one request's routed_experts array; its request_id, prompt_token_ids and output_token_ids (and
              optionally routed_experts_prompt_start) in the JSON object of a file next to it with the same stem and
              suffix .json
    .jsonl    one HTTP response body a line, as the engine returned it: a vLLM 0.3x completion (every choice with
              prompt_token_ids, token_ids and routed_experts; `return_token_ids` on), or an SGLang /generate
              response (output_ids, meta_info.routed_experts) with the request's `input_ids` added to it; an
              optional `routed_experts_prompt_start` beside a vLLM response or in a choice

A request may also carry one row per token (sequence length rows, as an engine that reports the last token too):
the last row is dropped, since no teacher-forced forward consumes the last token.

`engine_batch` lays the requests out as the trainer's input (prompts left-padded to P, outputs right-padded to N,
the input being tokens[:, :-1] as in moe_rl.rl.rollout), which puts engine row i of a request with a prompt of p tokens
at input column P - p + i. `compare_with_model` runs the model natively over that input, records its routing and
returns `churn_stats` of engine vs trainer (docs/design.md section 5) over the positions the engine reported.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_rl.errors import DataError, RoutingError
from moe_rl.model.layers import autocast_context
from moe_rl.routing.churn import ChurnStats, churn_stats
from moe_rl.routing.replay import record_routing
from moe_rl.routing.trace import RoutingTrace, routing_sites

TRACE_SUFFIXES = (".parquet", ".pt", ".npy", ".jsonl")
TOKEN_SETS = ("all", "response")


@dataclass
class EngineRequest:
    """One request of an engine trace; `routed_experts_RLK` has R = len(prompt) + len(output) - 1 - prompt_start rows,
    row r for token prompt_start + r (vLLM 0.3x's `routed_experts_prompt_start`; 0: every token)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    routed_experts_RLK: np.ndarray
    prompt_start: int = 0


@dataclass
class EngineBatch:
    """Requests laid out as the trainer's input: `input_ids_BS` (S = P + N - 1 columns), `valid_BS` (real tokens),
    `trace` (engine ids, 0 where `reported_BS` is false), `reported_BS` (positions the engine reported) and
    `response_BS` (positions whose logits score an output token)."""

    request_ids: list[str]
    input_ids_BS: torch.Tensor
    valid_BS: torch.Tensor
    trace: RoutingTrace
    reported_BS: torch.Tensor
    response_BS: torch.Tensor

    def mask_BS(self, tokens: str) -> torch.Tensor:
        if tokens not in TOKEN_SETS:
            raise DataError(f"tokens={tokens!r} is not valid; choose one of: {', '.join(TOKEN_SETS)}")
        return self.reported_BS if tokens == "all" else self.response_BS


# ----------------------------------------------------------------------------------------------------------
# Reading and writing


def read_engine_trace(path: str | Path, top_k: int | None = None) -> list[EngineRequest]:
    """The requests of an engine trace file (.parquet, .pt, .npy with its .json, or .jsonl of HTTP responses), each
    array checked to be 3-D with sequence length - 1 (or sequence length) rows, less the skipped prompt tokens.
    `top_k`: the router's K, needed to shape SGLang's flat int32 arrays only."""
    path = Path(path)
    if path.suffix not in TRACE_SUFFIXES:
        raise DataError(f"{path}: an engine trace is a {', '.join(TRACE_SUFFIXES)} file")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such engine trace file")
    if path.suffix == ".jsonl":
        raw = _read_jsonl(path, top_k)
    else:
        raw = {".parquet": _read_parquet, ".pt": _read_pt, ".npy": _read_npy}[path.suffix](path)
    requests = [_checked(path, request) for request in raw]
    if not requests:
        raise DataError(f"{path} holds no requests: nothing to compare")
    _check_unique_ids(path, requests)
    return requests


def _check_unique_ids(path: Path, requests: list[EngineRequest]) -> None:
    """Refuse two requests with one request_id: the per-request rows of the comparison would be ambiguous, and a
    trace written twice into one file (or two engines' traces concatenated) would count every token twice."""
    first: dict[str, int] = {}
    for index, request in enumerate(requests):
        seen = first.setdefault(request.request_id, index)
        if seen != index:
            raise DataError(f"{path}: request_id {request.request_id!r} appears twice (entries {seen} and {index}); "
                            "each request of a trace needs its own id")


def write_engine_trace(path: str | Path, requests: list[EngineRequest]) -> Path:
    """Write requests in one of the layouts `read_engine_trace` reads (by suffix; .npy takes one request)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame([_flat_row(r) for r in requests]).to_parquet(path, index=False)
    elif path.suffix == ".pt":
        torch.save([{**_ids(r), "routed_experts": torch.from_numpy(np.ascontiguousarray(r.routed_experts_RLK))}
                    for r in requests], path)
    elif path.suffix == ".npy":
        if len(requests) != 1:
            raise DataError(f"{path}: a .npy engine trace holds one request, not {len(requests)}")
        np.save(path, requests[0].routed_experts_RLK)
        path.with_suffix(".json").write_text(json.dumps(_ids(requests[0])))
    else:
        raise DataError(f"{path}: an engine trace is a {', '.join(TRACE_SUFFIXES)} file")
    return path


def _ids(request: EngineRequest) -> dict:
    """Plain Python values, so that the .pt loads with weights_only and the .json sidecar serialises."""
    ids = {"request_id": str(request.request_id), "prompt_token_ids": _int_list(request.prompt_token_ids),
           "output_token_ids": _int_list(request.output_token_ids)}
    if request.prompt_start:
        ids["routed_experts_prompt_start"] = int(request.prompt_start)
    return ids


def _flat_row(request: EngineRequest) -> dict:
    ids_RLK = np.asarray(request.routed_experts_RLK)
    return {**_ids(request), "routed_experts": ids_RLK.reshape(-1), "routed_experts_shape": list(ids_RLK.shape)}


def _read_parquet(path: Path) -> list[EngineRequest]:
    import pandas as pd

    try:
        frame = pd.read_parquet(path)
    except Exception as err:  # pyarrow's ArrowInvalid for an empty, cut-short or foreign file
        raise DataError(f"{path} cannot be read as Parquet ({type(err).__name__}): empty, cut short or not a "
                        "Parquet file") from None
    missing = {"request_id", "prompt_token_ids", "output_token_ids", "routed_experts",
               "routed_experts_shape"} - set(frame.columns)
    if missing:
        raise DataError(f"{path}: missing column(s) {sorted(missing)}")
    requests = []
    for row, record in enumerate(frame.to_dict("records")):
        flat, shape = np.asarray(record["routed_experts"]), [int(n) for n in record["routed_experts_shape"]]
        if len(shape) != 3 or int(np.prod(shape)) != flat.size:
            raise DataError(f"{path}: request {record['request_id']} (row {row}): routed_experts has {flat.size} "
                            f"values but routed_experts_shape is {shape} (positions, layers, K)")
        requests.append(EngineRequest(str(record["request_id"]),
                                      _int_list(record["prompt_token_ids"], path, row, "prompt_token_ids"),
                                      _int_list(record["output_token_ids"], path, row, "output_token_ids"),
                                      flat.reshape(shape)))
    return requests


# What a .pt trace may hold besides tensors and plain data: numpy arrays and scalars (the module docstring's "a tensor
# or array"), loaded through weights_only with these reconstructors allowed and nothing else.
NUMPY_GLOBALS = ("numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar", "numpy.core.multiarray."
                 "_reconstruct", "numpy.core.multiarray.scalar", "numpy.ndarray", "numpy.dtype")


def _read_pt(path: Path) -> list[EngineRequest]:
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path} is not a torch file (not a zip archive: a text file, random bytes, or a file cut "
                        "short); an engine trace .pt is torch.save of a list of dicts")
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    foreign = [name for name in needed if not name.startswith("numpy.")]
    if foreign:
        raise DataError(f"{path} holds objects other than tensors, numpy arrays and plain data "
                        f"({', '.join(foreign[:3])}); it is not loaded")
    allowed = [_global(name) for name in needed if name in NUMPY_GLOBALS]
    allowed += [getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType")]  # not listed in `needed`
    try:
        with torch.serialization.safe_globals(allowed):
            records = torch.load(path, weights_only=True)
    except Exception as err:  # corrupt archive, a numpy object we do not allow: torch's paragraph is not shown
        raise DataError(f"{path} cannot be loaded safely ({type(err).__name__}): corrupt, or it holds objects other "
                        "than tensors, numpy arrays and plain data") from None
    if isinstance(records, dict):
        records = [records]
    requests = []
    for row, record in enumerate(records):
        if not isinstance(record, dict) or "routed_experts" not in record:
            raise DataError(f"{path}: entry {row} is not a dict with routed_experts, prompt_token_ids and "
                            "output_token_ids")
        requests.append(_from_dict(path, row, record, np.asarray(record["routed_experts"])))
    return requests


def _global(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _read_npy(path: Path) -> list[EngineRequest]:
    sidecar = path.with_suffix(".json")
    if not sidecar.exists():
        raise DataError(f"{path}: a .npy engine trace needs {sidecar.name} next to it with request_id, "
                        "prompt_token_ids and output_token_ids")
    try:
        record = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{sidecar}: the sidecar of {path.name} cannot be read as JSON ({err}); it holds request_id, "
                        "prompt_token_ids and output_token_ids") from None
    if not isinstance(record, dict):
        raise DataError(f"{sidecar}: expected a JSON object with request_id, prompt_token_ids and output_token_ids, "
                        f"got {type(record).__name__}")
    try:
        ids_RLK = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:  # cut short, not a .npy, or an object array (never unpickled)
        raise DataError(f"{path} cannot be read as a .npy integer array ({_first_line(err)}): empty, cut short, "
                        "or not a numeric array") from None
    return [_from_dict(path, 0, record, ids_RLK)]


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]


def _from_dict(path: Path, row: int, record: dict, ids_RLK: np.ndarray) -> EngineRequest:
    for key in ("prompt_token_ids", "output_token_ids"):
        if key not in record:
            raise DataError(f"{path}: entry {row} has no {key}")
    return EngineRequest(str(record.get("request_id", row)), _int_list(record["prompt_token_ids"], path, row,
                                                                   "prompt_token_ids"),
                         _int_list(record["output_token_ids"], path, row, "output_token_ids"), ids_RLK,
                         _prompt_start(record.get("routed_experts_prompt_start", 0), path, row))


def _prompt_start(value, path: Path, row) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise DataError(f"{path}: entry {row}: routed_experts_prompt_start must be a non-negative integer, got "
                        f"{value!r}")
    return int(value)


# ----------------------------------------------------------------------------------------------------------
# HTTP responses (.jsonl): vLLM 0.3x completions and SGLang /generate


def _read_jsonl(path: Path, top_k: int | None) -> list[EngineRequest]:
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                body = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not a JSON object ({err})") from None
            if isinstance(body, dict) and "choices" in body:
                requests += _vllm_http(where, body)
            elif isinstance(body, dict) and "meta_info" in body:
                requests.append(_sglang_http(where, body, top_k))
            else:
                raise DataError(f"{where}: neither a vLLM completion (choices) nor an SGLang /generate response "
                                "(meta_info)")
    return requests


def _b64(where: str, text) -> bytes:
    if not isinstance(text, str):
        raise DataError(f"{where}: routed_experts is {type(text).__name__}, not a base64 string (was "
                        "--enable-return-routed-experts on?)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise DataError(f"{where}: routed_experts is not valid base64 ({_first_line(err)})") from None


def _vllm_http(where: str, body: dict) -> list[EngineRequest]:
    """Every choice of a vLLM 0.3x completion: routed_experts holds base64 `.npy` bytes."""
    out = []
    for choice in body["choices"]:
        index = choice.get("index", len(out)) if isinstance(choice, dict) else len(out)
        at = f"{where}, choice {index}"
        if not isinstance(choice, dict) or choice.get("token_ids") is None or choice.get("prompt_token_ids") is None:
            raise DataError(f"{at}: needs prompt_token_ids and token_ids (request with return_token_ids=true)")
        try:
            ids_RLK = np.load(io.BytesIO(_b64(at, choice.get("routed_experts"))), allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise DataError(f"{at}: routed_experts is not a whole .npy integer array ({_first_line(err)}): cut "
                            "short, or not vLLM 0.3x's encoding") from None
        start = choice.get("routed_experts_prompt_start", body.get("routed_experts_prompt_start", 0))
        record = {"request_id": f"{body.get('id', where)}-{index}", "prompt_token_ids": choice["prompt_token_ids"],
                  "output_token_ids": choice["token_ids"], "routed_experts_prompt_start": start}
        out.append(_from_dict(Path(at), index, record, ids_RLK))
    return out


def _sglang_http(where: str, body: dict, top_k: int | None) -> EngineRequest:
    """An SGLang /generate response with the request's input_ids: meta_info.routed_experts holds base64 of the raw
    int32 buffer [len(input) + len(output) - 1, every layer, K], flattened."""
    meta = body["meta_info"]
    if body.get("input_ids") is None or body.get("output_ids") is None:
        raise DataError(f"{where}: an SGLang response needs output_ids and the request's input_ids added to it")
    if top_k is None:
        raise DataError(f"{where}: SGLang's routed_experts is a flat int32 buffer; reading it needs the router's K "
                        "(read_engine_trace(path, top_k=K); compare_with_model passes the model's)")
    raw = _b64(where, meta.get("routed_experts"))
    if len(raw) % 4:
        raise DataError(f"{where}: routed_experts holds {len(raw)} bytes, not a whole number of int32 values: cut "
                        "short")
    flat = np.frombuffer(raw, dtype=np.int32)
    rows = len(body["input_ids"]) + len(body["output_ids"]) - 1
    if rows <= 0 or flat.size % (rows * top_k):
        raise DataError(f"{where}: routed_experts holds {flat.size} int32 values, not a multiple of (input + output "
                        f"- 1 = {rows} positions) x (K = {top_k}): cut short, or another K")
    record = {"request_id": str(meta.get("id", where)), "prompt_token_ids": body["input_ids"],
              "output_token_ids": body["output_ids"]}
    return _from_dict(Path(where), 0, record, flat.reshape(rows, -1, top_k))


def _int_list(values, path: Path | None = None, row: int = 0, key: str = "token ids") -> list[int]:
    """A list of token ids as ints; DataError naming the file, entry and key for anything else (a string, None,
    floats with a fraction)."""
    try:
        items = values.tolist() if hasattr(values, "tolist") else values
        if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
            raise TypeError(type(items).__name__)
        out = [int(v) for v in items]
        if any(isinstance(v, float) and v != int(v) for v in items):
            raise ValueError("a fraction")
        return out
    except (TypeError, ValueError) as err:
        if path is None:
            raise
        raise DataError(f"{path}: entry {row}: {key} must be a list of integer token ids ({type(err).__name__}: "
                        f"{err})") from None


def _checked(path: Path, request: EngineRequest) -> EngineRequest:
    """Refuse a routed_experts array that is not [positions, layers, K] integers with sequence length - 1 rows;
    drop the extra last row of an engine that reports every token."""
    ids = np.asarray(request.routed_experts_RLK)
    where = f"{path}: request {request.request_id}"
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"{where}: routed_experts must be an integer array (positions, layers, K); got "
                        f"{ids.dtype} of shape {ids.shape}")
    if not request.output_token_ids:
        raise DataError(f"{where}: no output tokens")
    start = request.prompt_start
    if start > len(request.prompt_token_ids):
        raise DataError(f"{where}: routed_experts_prompt_start {start} is past the prompt's "
                        f"{len(request.prompt_token_ids)} tokens")
    seq_len = len(request.prompt_token_ids) + len(request.output_token_ids)
    if ids.shape[0] == seq_len - start:
        ids = ids[:-1]
    elif ids.shape[0] != seq_len - 1 - start:
        skipped = f", less the {start} skipped prompt tokens" if start else ""
        raise DataError(f"{where}: routed_experts has {ids.shape[0]} positions but prompt + output is {seq_len} "
                        f"tokens; expected {seq_len - 1 - start} (every token but the last{skipped})")
    return EngineRequest(request.request_id, request.prompt_token_ids, request.output_token_ids, ids, start)


# ----------------------------------------------------------------------------------------------------------
# Alignment with the trainer's layout


def decoder_layers_of(model) -> tuple[int, list[int]]:
    """(number of decoder layers, decoder index of each MoE layer in depth order): how an engine trace that reports
    every layer (vLLM 0.3x, SGLang) maps onto the model's MoE layers."""
    sites = routing_sites(model)
    if hasattr(model, "hf"):  # HFMoEModel: each site knows its decoder layer
        return len(model.blocks), [site.layer_index for site in sites]
    blocks = list(model.blocks)
    return len(blocks), [i for i, block in enumerate(blocks) if block.is_moe]


def moe_layers_only(requests: list[EngineRequest], model) -> list[EngineRequest]:
    """The requests with their layer axis narrowed to the model's MoE layers where it counts every decoder layer
    (and the model has dense ones); unchanged otherwise."""
    n_decoder, moe_index = decoder_layers_of(model)
    if n_decoder == len(moe_index):
        return requests
    return [EngineRequest(r.request_id, r.prompt_token_ids, r.output_token_ids,
                          r.routed_experts_RLK[:, moe_index], r.prompt_start)
            if r.routed_experts_RLK.shape[1] == n_decoder else r for r in requests]


def check_against_model(path, requests: list[EngineRequest], model) -> list[EngineRequest]:
    """Refuse requests whose layer count, K, expert ids or token ids do not fit `model`, naming file, request and
    layer; return them with an every-decoder-layer axis narrowed to the MoE layers."""
    sites = routing_sites(model)
    vocab = _vocab_size(model)
    n_decoder = decoder_layers_of(model)[0]
    requests = moe_layers_only(requests, model)
    for request in requests:
        where = f"{path}: request {request.request_id}"
        n_layers, top_k = request.routed_experts_RLK.shape[1:]
        if n_layers != len(sites):
            raise RoutingError(f"{where}: the trace has {n_layers} layers but the model has {len(sites)} MoE layers "
                               f"of {n_decoder} decoder layers; layer {min(n_layers, len(sites))} has no match")
        for layer, site in enumerate(sites):
            ids_RK = request.routed_experts_RLK[:, layer]
            if top_k != site.top_k:
                raise RoutingError(f"{where}, MoE layer {layer}: the trace has K={top_k} but the router uses "
                                   f"K={site.top_k} (fused shared-expert columns? drop them first)")
            if ids_RK.size and (ids_RK.min() < 0 or ids_RK.max() >= site.n_experts):
                raise RoutingError(f"{where}, MoE layer {layer}: expert ids span [{ids_RK.min()}, {ids_RK.max()}] "
                                   f"but the layer has experts 0..{site.n_experts - 1}")
            sorted_RK = np.sort(ids_RK, axis=1)
            repeats_R = (sorted_RK[:, 1:] == sorted_RK[:, :-1]).any(axis=1)
            if repeats_R.any():
                i = int(repeats_R.argmax())
                raise RoutingError(f"{where}, MoE layer {layer}: position {i} lists expert "
                                   f"{_repeated(sorted_RK[i])} twice; a top-k set holds K distinct experts")
        tokens = request.prompt_token_ids + request.output_token_ids
        if vocab is not None and (min(tokens) < 0 or max(tokens) >= vocab):
            raise DataError(f"{where}: token ids span [{min(tokens)}, {max(tokens)}] but the model's vocabulary "
                            f"is 0..{vocab - 1}")
    return requests


def _vocab_size(model) -> int | None:
    """The model's own vocabulary: a Hugging Face checkpoint's config, not the ModelConfig default beside it."""
    hf_config = getattr(getattr(model, "hf", None), "config", None)
    if hf_config is not None:
        return hf_config.vocab_size
    return model.cfg.vocab_size if hasattr(model, "cfg") else None


def _repeated(sorted_K: np.ndarray) -> int:
    return int(sorted_K[1:][sorted_K[1:] == sorted_K[:-1]][0])


def engine_batch(requests: list[EngineRequest], pad_id: int = 0, device="cpu") -> EngineBatch:
    """The requests in the trainer's teacher-forcing layout (see the module docstring)."""
    P = max(len(r.prompt_token_ids) for r in requests)
    N = max(len(r.output_token_ids) for r in requests)
    B, S = len(requests), P + N - 1
    L, K = requests[0].routed_experts_RLK.shape[1:]
    tokens_BS = torch.full((B, P + N), pad_id, dtype=torch.long)
    valid_BS = torch.zeros(B, P + N, dtype=torch.bool)
    ids_LBSK = torch.zeros(L, B, S, K, dtype=torch.int16)
    reported_BS = torch.zeros(B, S, dtype=torch.bool)
    response_BS = torch.zeros(B, S, dtype=torch.bool)
    for b, r in enumerate(requests):
        p, n = len(r.prompt_token_ids), len(r.output_token_ids)
        start = P - p  # column of the request's first token
        tokens_BS[b, start:P + n] = torch.tensor(r.prompt_token_ids + r.output_token_ids)
        valid_BS[b, start:P + n] = True
        first, rows = start + r.prompt_start, p + n - 1 - r.prompt_start  # the engine's first reported token
        ids_LBSK[:, b, first:first + rows] = torch.from_numpy(r.routed_experts_RLK.astype(np.int16)).permute(1, 0, 2)
        reported_BS[b, first:first + rows] = True
        response_BS[b, P - 1:P - 1 + n] = True  # the positions whose logits score output tokens 0..n-1
    return EngineBatch([r.request_id for r in requests], tokens_BS[:, :-1].to(device), valid_BS[:, :-1].to(device),
                       RoutingTrace(ids_LBSK.to(device)), reported_BS.to(device), response_BS.to(device))


@torch.no_grad()
def trainer_routing(model, batch: EngineBatch) -> RoutingTrace:
    """The model's native routing of the batch's input (one forward, as the trainer's old pass)."""
    with record_routing(model) as recorder, autocast_context(batch.input_ids_BS.device):
        model(batch.input_ids_BS, batch.valid_BS)
    return recorder.trace()


def compare_with_model(path, model, tokens: str = "all", pad_id: int = 0) -> tuple[ChurnStats, EngineBatch]:
    """Read the engine trace at `path`, check it against `model`, and measure engine vs trainer routing over the
    reported positions (`tokens='all'`) or those that score an output token ('response')."""
    requests = read_engine_trace(path, top_k=routing_sites(model)[0].top_k)
    requests = check_against_model(path, requests, model)
    device = next(model.parameters()).device
    batch = engine_batch(requests, pad_id, device)
    return churn_stats(batch.trace, trainer_routing(model, batch), batch.mask_BS(tokens)), batch


def requests_from_trace(trace: RoutingTrace, tokens_BS: torch.Tensor, valid_BS: torch.Tensor,
                        prompt_len: int) -> list[EngineRequest]:
    """The rows of a trainer batch as engine requests in vLLM's layout (what an engine would have returned for
    them): the inverse of `engine_batch`. `tokens_BS` and `valid_BS` are whole rows, prompt left-padded to
    `prompt_len`, response right-padded (moe_rl.rl.rollout's Generation); `trace` covers tokens_BS[:, :-1]."""
    requests = []
    for b in range(tokens_BS.shape[0]):
        columns = valid_BS[b].nonzero().squeeze(1)
        start, end = int(columns[0]), int(columns[-1]) + 1  # the row's real tokens are contiguous
        ids_LRK = trace.ids_LBSK[:, b, start:end - 1]
        requests.append(EngineRequest(
            request_id=str(b), prompt_token_ids=tokens_BS[b, start:prompt_len].tolist(),
            output_token_ids=tokens_BS[b, prompt_len:end].tolist(),
            routed_experts_RLK=ids_LRK.permute(1, 0, 2).to(torch.int16).cpu().numpy()))
    return requests
