"""Shared test set-up: one torch thread (small tensors are much faster that way on these machines), seeds,
and tiny model factories."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from moe_rl.model import ModelConfig, MoETransformer  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64,
                n_experts=6, top_k=2, d_expert=24, d_dense=48, init_std=0.1)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(tiny_config(**overrides))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
