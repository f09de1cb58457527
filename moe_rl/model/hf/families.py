"""The Hugging Face MoE families moe-rl knows: where each keeps its router, how the router turns logits into gate
weights, and a tiny random config of each for CPU.

Every router here computes `logits_TE = linear(x_TD)` and then picks K experts and their gate weights by its
family's own rule (transformers 5.x, `modeling_<family>.py`):

| family      | choice of ids_TK                                  | gate weights_TK from the chosen ids             |
|-------------|---------------------------------------------------|-------------------------------------------------|
| qwen3_moe   | top-k of softmax(logits)                          | softmax gathered, renormalised if norm_topk_prob|
| qwen2_moe   | top-k of softmax(logits)                          | as qwen3_moe (default: no renormalisation); the |
|             |                                                   | shared expert has its own sigmoid gate          |
| olmoe       | top-k of softmax(logits)                          | as qwen3_moe                                    |
| mixtral     | top-k of softmax(logits)                          | softmax gathered and always renormalised        |
|             |                                                   | (= softmax over the K chosen logits)            |
| deepseek_v3 | top-k of sigmoid(logits) + e_score_correction_bias| sigmoid gathered (the bias never enters),       |
|             | within the topk_group best of n_group groups      | renormalised if norm_topk_prob, x routed_scaling|
| gpt_oss     | top-k of logits (the router has a bias)           | softmax over the K chosen logits                |

Replay keeps the family's weight rule and swaps only the ids, so the weights stay a function of the dense router
output and the router keeps its gradient (docs/design.md section 4).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_rl.model.config import HF_FAMILIES, ModelConfig

# ----------------------------------------------------------------------------------------------------------
# Router rules: (router module, logits_TE, ids_TK) -> weights_TK, and the dense views of the logits.


def softmax_gate(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE, Qwen2-MoE, OLMoE: softmax in fp32, gather, renormalise if norm_topk_prob, cast back."""
    weights_TK = F.softmax(logits_TE, dtype=torch.float, dim=-1).gather(-1, ids_TK)
    if router.norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype)


def mixtral_gate(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax in fp32, gather, always renormalise (no cast back)."""
    weights_TK = F.softmax(logits_TE.float(), dim=-1).gather(-1, ids_TK)
    return weights_TK / weights_TK.sum(dim=-1, keepdim=True)


def deepseek_gate(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores gathered; the correction bias only ever affects the choice, not the weights.
    HF divides by the sum in place, so the weights keep the scores' dtype even where the sum does not: CUDA's bf16
    autocast sums in fp32, and an out-of-place quotient would be fp32 there (replay then ran the experts with other
    weights than the model's own: logits 0.02 apart on an H200, exact on CPU)."""
    weights_TK = logits_TE.sigmoid().gather(1, ids_TK)
    if router.norm_topk_prob:
        weights_TK = (weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)).to(weights_TK.dtype)
    return weights_TK * router.routed_scaling_factor


def gpt_oss_gate(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """gpt-oss: softmax over the K chosen logits."""
    return F.softmax(logits_TE.gather(-1, ids_TK), dim=1, dtype=logits_TE.dtype)


def softmax_scores(router, logits_TE: torch.Tensor) -> torch.Tensor:
    return F.softmax(logits_TE.float(), dim=-1)


def sigmoid_scores(router, logits_TE: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sigmoid scores normalised over experts, so entropy and the load-balancing loss read a
    distribution as for the softmax families; their order is that of the sigmoid scores."""
    s_TE = logits_TE.float().sigmoid()
    return s_TE / s_TE.sum(dim=-1, keepdim=True)


def deepseek_choice(router, logits_TE: torch.Tensor) -> torch.Tensor:
    """The scores DeepSeek-V3 ranks experts by: sigmoid + correction bias, -inf outside the best groups. The sigmoid in
    the logits' dtype, as the router takes it (bf16 under autocast), then the fp32 bias."""
    choice_TE = logits_TE.sigmoid().float() + router.e_score_correction_bias
    T, E, G = choice_TE.shape[0], router.num_experts, router.num_group
    group_scores_TG = choice_TE.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups_TG = torch.zeros_like(group_scores_TG).scatter_(
        1, group_scores_TG.topk(router.topk_group, dim=-1, sorted=False)[1], 1)
    keep_TE = best_groups_TG.bool()[:, :, None].expand(T, G, E // G).reshape(T, E)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


def logits_choice(router, logits_TE: torch.Tensor) -> torch.Tensor:
    return logits_TE.float()


# ----------------------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    """Where a family keeps its router and how the router works."""

    name: str  # transformers' model_type, the value of --model.hf-config
    moe_block: str  # class name of the MoE feed-forward (a decoder layer's `mlp`)
    router_attr: str  # the block's attribute holding the router
    router: str  # class name of the router
    dense: tuple[str, ...]  # class names of dense feed-forwards allowed in the other layers
    gate: Callable  # (router, logits_TE, ids_TK) -> weights_TK: the family's weight rule
    scores: Callable  # (router, logits_TE) -> scores_TE, a distribution over experts (entropy, aux loss)
    choice: Callable  # (router, logits_TE) -> the scores the router ranks experts by (native ids = their top-k)
    tiny: Callable  # (ModelConfig) -> a tiny random transformers config of this family


def _common(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, num_experts_per_tok=cfg.top_k,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,  # the character tokenizer's PAD, BOS, EOS
    )


def _tiny_qwen3_moe(cfg: ModelConfig):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(cfg), head_dim=cfg.head_dim, intermediate_size=cfg.d_dense,
                          moe_intermediate_size=cfg.d_expert, num_experts=cfg.n_experts,
                          norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.moe_every)


def _tiny_qwen2_moe(cfg: ModelConfig):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**_common(cfg), intermediate_size=cfg.d_dense, moe_intermediate_size=cfg.d_expert,
                          shared_expert_intermediate_size=cfg.d_shared_expert or cfg.d_expert,
                          num_experts=cfg.n_experts, norm_topk_prob=False, decoder_sparse_step=cfg.moe_every)


def _tiny_olmoe(cfg: ModelConfig):
    from transformers import OlmoeConfig

    return OlmoeConfig(**_common(cfg), intermediate_size=cfg.d_expert, num_experts=cfg.n_experts,
                       norm_topk_prob=cfg.norm_topk_prob)


def _tiny_mixtral(cfg: ModelConfig):
    from transformers import MixtralConfig

    return MixtralConfig(**_common(cfg), head_dim=cfg.head_dim, intermediate_size=cfg.d_expert,
                         num_local_experts=cfg.n_experts, router_jitter_noise=0.0)


def _tiny_deepseek_v3(cfg: ModelConfig):
    from transformers import DeepseekV3Config

    # Group-limited routing needs groups of at least 2 experts (a group's score is the sum of its best two).
    n_group = 4 if cfg.n_experts % 4 == 0 and cfg.n_experts >= 8 else 1
    head = cfg.head_dim
    common = {**_common(cfg), "num_key_value_heads": cfg.n_heads}  # multi-head latent attention: no GQA
    return DeepseekV3Config(
        **common, intermediate_size=cfg.d_dense, moe_intermediate_size=cfg.d_expert,
        n_routed_experts=cfg.n_experts, n_shared_experts=1, n_group=n_group, topk_group=max(1, n_group // 2),
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1 if cfg.n_layers > 1 else 0,
        q_lora_rank=cfg.d_model // 2, kv_lora_rank=cfg.d_model // 4, qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head // 2, v_head_dim=head,
    )


def _tiny_gpt_oss(cfg: ModelConfig):
    from transformers import GptOssConfig

    return GptOssConfig(
        **_common(cfg), head_dim=cfg.head_dim, intermediate_size=cfg.d_expert, num_local_experts=cfg.n_experts,
        sliding_window=16, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                        for i in range(cfg.n_layers)],
    )


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", "Qwen3MoeTopKRouter", ("Qwen3MoeMLP",),
           softmax_gate, softmax_scores, softmax_scores, _tiny_qwen3_moe),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", "Qwen2MoeTopKRouter", ("Qwen2MoeMLP",),
           softmax_gate, softmax_scores, softmax_scores, _tiny_qwen2_moe),
    Family("olmoe", "OlmoeSparseMoeBlock", "gate", "OlmoeTopKRouter", ("OlmoeMLP",),
           softmax_gate, softmax_scores, softmax_scores, _tiny_olmoe),
    Family("mixtral", "MixtralSparseMoeBlock", "gate", "MixtralTopKRouter", (),
           mixtral_gate, softmax_scores, softmax_scores, _tiny_mixtral),
    Family("deepseek_v3", "DeepseekV3MoE", "gate", "DeepseekV3TopkRouter", ("DeepseekV3MLP",),
           deepseek_gate, sigmoid_scores, deepseek_choice, _tiny_deepseek_v3),
    Family("gpt_oss", "GptOssMLP", "router", "GptOssTopKRouter", (),
           gpt_oss_gate, softmax_scores, logits_choice, _tiny_gpt_oss),
)}
assert tuple(FAMILIES) == HF_FAMILIES, "moe_rl.model.config.HF_FAMILIES must list the families here"


def tiny_hf_config(family: str, cfg: ModelConfig):
    """A random-init config of `family` with the sizes of `cfg` (width, layers, heads, experts, K, widths, vocab),
    fp32 weights. Returns a fresh object: transformers 5.x mutates a model's config in place
    (`set_experts_implementation`), so two models must never share one."""
    return copy.deepcopy(FAMILIES[family].tiny(cfg))
