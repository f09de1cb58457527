"""Building an HFMoEModel: a tiny random model of a family, or a local checkpoint directory.

transformers is imported here lazily, so the native backend never needs it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.errors import ConfigError
from moe_rl.model.config import ModelConfig
from moe_rl.model.hf.families import FAMILIES, tiny_hf_config
from moe_rl.model.hf.model import HFMoEModel


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("backend 'hf' needs transformers 5.x: pip install 'moe-rl[hf]'") from None
    return transformers


def tiny_hf_model(family: str, cfg: ModelConfig) -> HFMoEModel:
    """A random-init model of `family` with `cfg`'s sizes (seed torch first for a reproducible init)."""
    transformers = _transformers()
    hf_model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(family, cfg), attn_implementation="eager",
                                                             dtype=torch.float32)
    if family == "deepseek_v3":
        # The correction bias is a buffer (zero at init, moved by load statistics in DeepSeek's training). A random
        # one makes the tiny model's choice differ from the plain top-k, as in a trained checkpoint.
        for layer in hf_model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return HFMoEModel(hf_model, cfg)


def checkpoint_model_type(path: str) -> str:
    """The model_type in `path`/config.json, checked before any weights are read."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"hf_path={path} has no config.json: expected a directory written by save_pretrained")
    model_type = _transformers().AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if model_type not in FAMILIES:
        raise ConfigError(f"hf_path={path}: model_type {model_type!r} is not a supported MoE family; "
                          f"supported: {', '.join(FAMILIES)}")
    return model_type


def pretrained_hf_model(path: str, cfg: ModelConfig) -> HFMoEModel:
    """The checkpoint in `path` (fp32 weights; bf16 autocast on GPU as for the native model)."""
    checkpoint_model_type(path)
    hf_model = _transformers().AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return HFMoEModel(hf_model, cfg)


def build_hf_model(cfg: ModelConfig) -> HFMoEModel:
    """`cfg.hf_path` if set, else a tiny random `cfg.hf_config` model."""
    if cfg.hf_in_memory:
        raise ConfigError("this config describes a model wrapped in Python (HFMoEModel.wrap), which it cannot "
                          "rebuild: build the transformers model yourself, load its weights and wrap it again")
    if cfg.hf_path is not None:
        return pretrained_hf_model(cfg.hf_path, cfg)
    return tiny_hf_model(cfg.hf_config, cfg)
