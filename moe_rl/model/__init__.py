"""The native MoE transformer with instrumented routers."""

from moe_rl.model.config import ModelConfig
from moe_rl.model.layers import KVCache, positions_from_mask
from moe_rl.model.moe import MoEFeedForward, Router, RouterOutput
from moe_rl.model.transformer import ModelOutput, MoETransformer

__all__ = [
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "MoEFeedForward",
    "MoETransformer",
    "Router",
    "RouterOutput",
    "positions_from_mask",
]
