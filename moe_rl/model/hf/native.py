"""The native MoETransformer as a Hugging Face Mixtral model: the same function, weight for weight, or a refusal.

    check_maps(cfg)                      # ConfigError naming the part that differs, else nothing
    hf = as_mixtral(model)               # a transformers MixtralForCausalLM holding the native weights (fp32 exact)
    as_mixtral(model, into=hf)           # the same weights copied into that model again (the vLLM weight sync)

Why Mixtral and not Qwen3-MoE. Part by part, the native model (moe_rl/model/) against the two:

| part           | native                                  | Qwen3-MoE                  | Mixtral                  |
|----------------|-----------------------------------------|----------------------------|--------------------------|
| norms          | pre-norm RMSNorm, one eps               | the same                   | the same                 |
| q/k norm       | none                                    | RMSNorm per head, always   | none                     |
| attention bias | none                                    | attention_bias False       | none                     |
| RoPE           | rotate-half, theta^(-2i/Dh)             | the same                   | the same                 |
| router         | softmax (fp32), top-k, renormalised     | the same (norm_topk_prob)  | the same, always         |
|                | if norm_topk_prob                       |                            | renormalised             |
| experts        | SwiGLU silu(gate) * up, no bias         | the same                   | the same                 |
| shared expert  | d_shared_expert > 0                     | none                       | none                     |
| dense blocks   | all but every moe_every-th              | decoder_sparse_step        | none                     |
| tied embedding | tie_embeddings                          | tie_word_embeddings        | tie_word_embeddings      |

Qwen3-MoE normalises every query and key head with its own RMSNorm (`q_norm`, `k_norm`, in transformers' and in
vLLM's Qwen3-MoE alike, with no switch to turn it off), and the native attention has none: no weight makes an RMSNorm
the identity, so no native model is a Qwen3-MoE. Mixtral is the native model exactly where its config has
norm_topk_prob on, no dense block (moe_every 1) and no shared expert; anything else is refused by name. The router
losses (load balancing, z-loss) are training terms, not part of the function, so they do not enter the map.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from moe_rl.errors import ConfigError
from moe_rl.model.config import ModelConfig
from moe_rl.model.hf.families import tiny_hf_config

TARGET = "mixtral"


def mismatch(cfg: ModelConfig) -> str | None:
    """The part of a native config that Mixtral cannot express, in words, or None when it maps exactly."""
    if cfg.backend != "native":
        return f"backend {cfg.backend!r} is not the native model"
    if not cfg.norm_topk_prob:
        return ("the router: norm_topk_prob=False keeps the gathered softmax weights, Mixtral always renormalises "
                "the top-k weights")
    if cfg.moe_every != 1:
        dense = cfg.n_layers - cfg.n_moe_layers
        return (f"the dense blocks: moe_every={cfg.moe_every} makes {dense} of the {cfg.n_layers} blocks dense "
                "SwiGLU feed-forwards, Mixtral has an MoE feed-forward in every block")
    if cfg.d_shared_expert:
        return f"the shared expert: d_shared_expert={cfg.d_shared_expert}, Mixtral has no shared expert"
    return None


def check_maps(cfg: ModelConfig, what: str = "the native model") -> None:
    """A one-line ConfigError naming the part of `cfg` that does not map onto Mixtral (Qwen3-MoE never does: its
    per-head q/k RMSNorm has no native counterpart)."""
    part = mismatch(cfg)
    if part is not None:
        raise ConfigError(f"{what} does not map exactly onto a Hugging Face Mixtral (Qwen3-MoE has a q/k norm the "
                          f"native attention lacks): {part}")


def mixtral_config(cfg: ModelConfig):
    """The MixtralConfig of a native config: the sizes, eps, RoPE theta, tied embeddings and the character
    tokenizer's PAD, BOS and EOS (moe_rl.model.hf.families), and the native load-balancing coefficient."""
    check_maps(cfg)
    hf_cfg = tiny_hf_config(TARGET, replace(cfg, backend="hf", hf_config=TARGET))
    hf_cfg.router_aux_loss_coef = cfg.aux_loss_coef  # read by transformers' training loss only, not by the forward
    return hf_cfg


def mixtral_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The native weights under the names and layouts of transformers' in-memory MixtralForCausalLM."""
    cfg = model.cfg
    check_maps(cfg)
    kv_rows = cfg.n_kv_heads * cfg.head_dim
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.blocks):
        at = f"model.layers.{i}."
        k_weight, v_weight = block.attn.kv.weight.split(kv_rows)  # kv rows: (2, Hkv, Dh), keys first
        state.update({
            at + "input_layernorm.weight": block.attn_norm.weight,
            at + "post_attention_layernorm.weight": block.ffn_norm.weight,
            at + "self_attn.q_proj.weight": block.attn.q.weight,
            at + "self_attn.k_proj.weight": k_weight,
            at + "self_attn.v_proj.weight": v_weight,
            at + "self_attn.o_proj.weight": block.attn.out.weight,
            at + "mlp.gate.weight": block.ffn.router.gate.weight,
            # native (E, D, 2F) and (E, F, D) are the transposes of transformers' (E, 2F, D) and (E, D, F); both
            # put the gate half first (silu(gate) * up)
            at + "mlp.experts.gate_up_proj": block.ffn.experts.w_gate_up.transpose(1, 2),
            at + "mlp.experts.down_proj": block.ffn.experts.w_down.transpose(1, 2),
        })
    return {name: tensor.detach() for name, tensor in state.items()}


def as_mixtral(model: nn.Module, into: nn.Module | None = None) -> nn.Module:
    """A MixtralForCausalLM with `model`'s weights (copied, in their dtype); `into`: load them into that model
    instead of building one. Refuses, naming the part, a native config that does not map."""
    check_maps(model.cfg)
    weights = mixtral_state_dict(model)
    if into is None:
        from transformers import AutoModelForCausalLM

        into = AutoModelForCausalLM.from_config(mixtral_config(model.cfg), dtype=model.embed.weight.dtype)
        into = into.to(model.embed.weight.device)
    into.load_state_dict(weights, strict=True)
    if model.cfg.tie_embeddings:
        into.tie_weights()
    return into.eval()
