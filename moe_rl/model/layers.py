"""Dense building blocks: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention with a KV cache.

Functions marked @replaceable are torch references a kernel may stand in for (moe_rl/kernels/attention.py).

Shapes: B batch, S sequence (this call), P positions in the cache, H query heads, Hkv key/value heads,
Dh head dim, D model dim.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.model.config import ModelConfig
from moe_rl.model.replaceable import Kernels, replaceable


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):  # no casts (this runs twice per layer per decode step)
            return rms_norm(x, self.weight, self.eps, kernels=kernels)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).type_as(x)


@replaceable("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: on CPU torch computes it as six ops (pow, mean, add,
    rsqrt, two products), with autograd through each of them."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer), rotate-half layout, positions given per token."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each (B, S, Dh), contiguous; signed_sin = [-sin, sin] (apply_rotary)."""
        angles_BSh = positions_BS.float()[..., None] * self.inv_freq  # (B, S, Dh/2)
        cos_BSh, sin_BSh = angles_BSh.cos(), angles_BSh.sin()
        cos_BSDh = torch.cat([cos_BSh, cos_BSh], dim=-1)
        signed_sin_BSDh = torch.cat([-sin_BSh, sin_BSh], dim=-1)
        return cos_BSDh, signed_sin_BSDh


@replaceable("rotary")
def apply_rotary(x_BSHDh: torch.Tensor, cos_BSDh: torch.Tensor, signed_sin_BSDh: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over the heads of each token, with rotate_half(x) * sin = roll(x) *
    signed_sin (signed_sin = [-sin, sin]). Returns (B, S, H, Dh)."""
    x = x_BSHDh if x_BSHDh.dtype == torch.float64 else x_BSHDh.float()  # float64: the tests' reference model
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return (x * cos_BSDh[:, :, None] + rolled * signed_sin_BSDh[:, :, None]).type_as(x_BSHDh)


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_hidden, bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


# With transposed keys, each key dimension's row of positions is padded to a multiple of this (the decode kernel,
# moe_rl/kernels/attention.py, reads 16 positions as one vector).
TRANSPOSED_KEY_ROW_MULTIPLE = 16


def _padded_positions(positions: int) -> int:
    return -(-positions // TRANSPOSED_KEY_ROW_MULTIPLE) * TRANSPOSED_KEY_ROW_MULTIPLE


class KVCache:
    """Preallocated keys and values for every layer; `length` positions are filled.

    With `keys_transposed` the keys are stored (L, B, Hkv, Dh, P), P padded to a multiple of 16, the layout a decode
    kernel may want (`decode_keys_transposed`). `append` returns keys (B, Hkv, P, Dh) either way (then a transposed
    view)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype, keys_transposed: bool = False):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.keys_transposed = keys_transposed
        if keys_transposed:
            self.k = torch.zeros(*shape[:3], cfg.head_dim, _padded_positions(max_len), device=device, dtype=dtype)
        else:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.max_len = max_len

    def append(self, layer: int, k_BHSDh: torch.Tensor, v_BHSDh: torch.Tensor):
        """Store this call's keys/values for `layer`; return all keys/values up to and including them."""
        start, end = self.length, self.length + k_BHSDh.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; this step needs {end}")
        self.v[layer, :, :, start:end] = v_BHSDh
        if self.keys_transposed:
            self.k[layer, :, :, :, start:end] = k_BHSDh.transpose(-1, -2)
            return self.k[layer, :, :, :, :end].transpose(-1, -2), self.v[layer, :, :, :end]
        self.k[layer, :, :, start:end] = k_BHSDh
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Called once per model forward, after every layer appended its `n` new positions."""
        self.length += n


@replaceable("decode_attention")
def decode_keys_transposed(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a KV cache made now stores its keys transposed; the torch attention reads either layout."""
    return False


class Attention(nn.Module):
    """Causal grouped-query attention through scaled_dot_product_attention."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x_BSD, cos, sin, mask_B1SP, cache: KVCache | None = None, kernels: Kernels | None = None):
        B, S, _ = x_BSD.shape
        q = self.q(x_BSD).view(B, S, self.n_heads, self.head_dim)
        kv = self.kv(x_BSD).view(B, S, 2, self.n_kv_heads, self.head_dim)
        k, v = kv.unbind(2)
        q = apply_rotary(q, cos, sin, kernels=kernels).transpose(1, 2)  # (B, H, S, Dh)
        k = apply_rotary(k, cos, sin, kernels=kernels).transpose(1, 2)
        v = v.transpose(1, 2)  # (B, Hkv, S, Dh)
        if cache is not None:
            k, v = cache.append(self.layer_index, k, v)  # (B, Hkv, P, Dh)
        if S == 1 and cache is not None:
            y = decode_attention(q, k, v, mask_B1SP, kernels=kernels)
        else:
            # mask None means "no padding anywhere": plain causal attention, which has a faster kernel.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SP, is_causal=mask_B1SP is None,
                                               enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(B, S, -1))


@replaceable("decode_attention")
def decode_attention(q_BH1Dh, k_BGPDh, v_BGPDh, mask_B11P: torch.Tensor | None) -> torch.Tensor:
    """One query per row against the cache. Query head h reads key/value head h // (H / Hkv), as SDPA's enable_gqa
    does. Two batched matmuls: on CPU the fused SDPA kernel's setup costs more than this arithmetic for a single
    query (~25% of a decode step's attention). Equal to SDPA up to fp32 rounding."""
    B, H, _, Dh = q_BH1Dh.shape
    G = k_BGPDh.shape[1]
    q_BGhDh = q_BH1Dh.reshape(B, G, H // G, Dh)
    scores_BGhP = (q_BGhDh @ k_BGPDh.transpose(-1, -2)) * (1.0 / math.sqrt(Dh))
    if mask_B11P is not None:  # masked_fill(~mask, -inf) in one op
        scores_BGhP = torch.where(mask_B11P, scores_BGhP, float("-inf"))
    return (scores_BGhP.softmax(dim=-1) @ v_BGPDh).view(B, H, 1, Dh)


def attention_mask(valid_BP: torch.Tensor, query_len: int) -> torch.Tensor:
    """Boolean mask (B, 1, S, P) for the last `query_len` of P positions: causal, padding keys hidden.

    Each query may always see itself, so a padding query never has an empty row (which would give NaN);
    its output is garbage but finite, and padding positions are masked out of every loss and metric.
    """
    P = valid_BP.shape[1]
    q_pos = torch.arange(P - query_len, P, device=valid_BP.device)
    k_pos = torch.arange(P, device=valid_BP.device)
    causal_SP = k_pos[None, :] <= q_pos[:, None]
    self_SP = k_pos[None, :] == q_pos[:, None]
    return ((causal_SP[None] & valid_BP[:, None, :]) | self_SP[None])[:, None]


def positions_from_mask(valid_BS: torch.Tensor) -> torch.Tensor:
    """Position ids counting valid tokens only, so left padding does not shift a prompt's positions."""
    return (valid_BS.long().cumsum(-1) - 1).clamp(min=0)


def decode_mask(valid_BP: torch.Tensor) -> torch.Tensor:
    """attention_mask(valid_BP, 1): the last position's query sees every valid key and itself."""
    mask_BP = valid_BP.clone()
    mask_BP[:, -1] = True
    return mask_BP[:, None, None, :]


def last_positions(valid_BP: torch.Tensor) -> torch.Tensor:
    """positions_from_mask(valid_BP)[:, -1:]: the last cumsum is the row sum."""
    return (valid_BP.sum(-1, keepdim=True) - 1).clamp(min=0)


def autocast_context(device: torch.device):
    """bf16 autocast on GPU (the routers opt out and stay fp32); fp32, no autocast, on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()



def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """Normal(0, init_std) for matrices; residual output projections scaled down by depth (GPT-2): by
    1/sqrt(2 init_depth), init_depth defaulting to n_layers."""
    out_std = cfg.init_std / math.sqrt(2 * (cfg.init_depth or cfg.n_layers))
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue
        is_residual_out = name.endswith(("out.weight", "down.weight", "w_down"))
        nn.init.normal_(p, mean=0.0, std=out_std if is_residual_out else cfg.init_std)
