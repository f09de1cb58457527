"""The native MoE transformer: embedding -> blocks (attention + MoE or dense feed-forward) -> logits.

Shapes: B batch, S tokens in this call, P positions visible to attention (cache + this call), D model dim,
V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from moe_rl.model.config import ModelConfig
from moe_rl.model.layers import (
    Attention,
    KVCache,
    RMSNorm,
    Rotary,
    SwiGLU,
    attention_mask,
    decode_keys_transposed,
    decode_mask,
    init_weights,
    last_positions,
    positions_from_mask,
)
from moe_rl.model.moe import MoEFeedForward
from moe_rl.model.precision import Numerics
from moe_rl.model.replaceable import Kernels


class ModelOutput(NamedTuple):
    logits_BSV: torch.Tensor
    aux_loss: torch.Tensor | None  # aux_loss_coef * lb_loss + z_loss_coef * z_loss; None without grad
    lb_loss: torch.Tensor | None  # load-balancing loss, mean over MoE layers
    z_loss: torch.Tensor | None  # router z-loss, mean over MoE layers; None without grad or at z_loss_coef 0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, moe_index: int | None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, index)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if moe_index is None:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_dense)
        else:
            self.ffn = MoEFeedForward(cfg, moe_index)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoEFeedForward)

    def forward(self, x_BSD, cos, sin, mask_B1SP, valid_BS, cache, numerics: Numerics):
        kernels = numerics.kernels
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD, kernels), cos, sin, mask_B1SP, cache, kernels)
        h_BSD = self.ffn_norm(x_BSD, kernels)
        if not self.is_moe:
            return x_BSD + self.ffn(h_BSD), None, None
        y_BSD, lb_loss, z_loss = self.ffn(h_BSD, valid_BS, kernels, numerics.router_dtype)
        return x_BSD + y_BSD, lb_loss, z_loss


class MoETransformer(nn.Module):
    """`kernels`: the fast implementations its forward may use (moe_rl.kernels.machine(), as moe_rl/rl/build.py
    builds it), handed down every forward's calls; None: torch's code everywhere (model/replaceable.py)."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        moe_indices = _moe_indices(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i, moe_indices[i]) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def moe_layers(self) -> list[MoEFeedForward]:
        """MoE feed-forwards in depth order: the layer axis of every routing trace."""
        return [block.ffn for block in self.blocks if block.is_moe]

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """A KV cache for `batch` rows; made inside the sampler's precision context, in the key layout the decode
        attention that will read it wants (layers.decode_keys_transposed)."""
        param = self.embed.weight
        transposed = decode_keys_transposed(param.device, param.dtype, self.cfg.head_dim, kernels=self.kernels)
        return KVCache(self.cfg, batch, max_len or self.cfg.max_seq_len, param.device, param.dtype, transposed)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        valid_BP: torch.Tensor | None = None,
        cache: KVCache | None = None,
        numerics: Numerics | None = None,
    ) -> ModelOutput:
        """Run S new tokens. `valid_BP` marks real (non-padding) tokens over every position attention sees:
        the cached ones followed by these S (without a cache, P = S). Padding may sit on either side. `numerics`:
        the sampler's (precision.sampler_numerics); the trainer's, with this model's kernels, when None."""
        numerics = Numerics(self.kernels) if numerics is None else numerics
        B, S = input_ids_BS.shape
        if valid_BP is None:
            past = cache.length if cache is not None else 0
            valid_BP = torch.ones(B, past + S, dtype=torch.bool, device=input_ids_BS.device)
        valid_BS = valid_BP[:, -S:]
        full_causal = cache is None and bool(valid_BP.all())
        if S == 1:  # a decode step: the same position and mask from a sum and a copy instead of P-wide scans
            cos, sin = self.rotary.cos_sin(last_positions(valid_BP))
            # A single query at the last position sees every key: without padding no mask is needed at all.
            mask_B1SP = None if full_causal or bool(valid_BP.all()) else decode_mask(valid_BP)
        else:
            cos, sin = self.rotary.cos_sin(positions_from_mask(valid_BP)[:, -S:])
            mask_B1SP = None if full_causal else attention_mask(valid_BP, S)

        x_BSD = self.embed(input_ids_BS)
        lb_losses, z_losses = [], []
        for block in self.blocks:
            x_BSD, lb_loss, z_loss = block(x_BSD, cos, sin, mask_B1SP, valid_BS, cache, numerics)
            if lb_loss is not None:
                lb_losses.append(lb_loss)
            if z_loss is not None:
                z_losses.append(z_loss)
        if cache is not None:
            cache.advance(S)
        logits_BSV = self.lm_head(self.norm(x_BSD, numerics.kernels))
        return ModelOutput(logits_BSV, *self._aux_losses(lb_losses, z_losses))

    def _aux_losses(self, lb_losses, z_losses):
        if not lb_losses:
            return None, None, None
        lb_loss = torch.stack(lb_losses).mean()
        if not z_losses:  # z_loss_coef 0: adding 0 * z_loss would change no bit of the loss or its gradient
            return self.cfg.aux_loss_coef * lb_loss, lb_loss, None
        z_loss = torch.stack(z_losses).mean()
        return self.cfg.aux_loss_coef * lb_loss + self.cfg.z_loss_coef * z_loss, lb_loss, z_loss

    def num_params(self) -> dict[str, int]:
        """Total parameters and those active per token (K of E experts)."""
        total = sum(p.numel() for p in self.parameters())
        expert = sum(p.numel() for layer in self.moe_layers() for p in layer.experts.parameters())
        active_expert = expert * self.cfg.top_k // self.cfg.n_experts
        return {"total": total, "active": total - expert + active_expert}


def _moe_indices(cfg: ModelConfig) -> list[int | None]:
    """For each block, its index among MoE layers, or None for a dense block."""
    indices, next_index = [], 0
    for i in range(cfg.n_layers):
        if cfg.is_moe_block(i):
            indices.append(next_index)
            next_index += 1
        else:
            indices.append(None)
    return indices
