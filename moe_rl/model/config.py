"""The one model config, documented field by field: the native MoE transformer, or a Hugging Face MoE model.

tyro turns the docstring under each field into `--help` text, so this file is the reference for every
architecture knob. Validation happens at construction: a bad value names its field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from moe_rl.errors import ConfigError, check_choice, check_positive

DISPATCH_MODES = ("grouped", "loop", "grouped_mm", "padded")
Backend = Literal["native", "hf"]
# Hugging Face MoE families with routing instruments (moe_rl.model.hf.families): transformers' model_type names.
HFFamily = Literal["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss"]
BACKENDS, HF_FAMILIES = get_args(Backend), get_args(HFFamily)
# Fields that do not change what the weights mean: a checkpoint loads into a config that differs only in these.
NON_ARCHITECTURE_FIELDS = ("aux_loss_coef", "z_loss_coef", "dispatch", "max_seq_len", "init_std")


@dataclass
class ModelConfig:
    """Architecture of the native MoE transformer (decoder-only, pre-norm, RoPE, GQA, SwiGLU experts), or which
    Hugging Face MoE model to use instead (backend, hf_config, hf_path)."""

    backend: Backend = "native"
    """native: moe-rl's own MoE transformer. hf: a Hugging Face transformers MoE causal LM (set hf_config or
    hf_path), with every router brought under the same routing contract (docs/models.md)."""
    hf_config: HFFamily | None = None
    """With backend hf: a tiny random model of this family (qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3,
    gpt_oss), sized by the fields below (d_model, n_layers, n_heads, n_kv_heads, n_experts, top_k, d_expert,
    d_dense, vocab_size) for CPU and the character tokenizer."""
    hf_path: str | None = None
    """With backend hf: a local checkpoint directory written by `save_pretrained` (config.json and weights, and
    a tokenizer used for the task prompts if it has one). Its own config fixes the architecture; of the fields
    below only aux_loss_coef, z_loss_coef and max_seq_len apply."""
    hf_in_memory: bool = False
    """Set by HFMoEModel.wrap for a transformers model built in Python: it has no hf_config or hf_path, so nothing
    can rebuild it from this config (build_hf_model refuses; load the weights into your model instead)."""

    vocab_size: int = 99
    """Number of token ids; must cover the tokenizer's vocabulary (99 for the character tokenizer)."""
    d_model: int = 64
    """Residual stream width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; must divide d_model (head dim = d_model / n_heads)."""
    n_kv_heads: int = 2
    """Key/value heads for grouped-query attention; must divide n_heads."""
    max_seq_len: int = 128
    """Longest sequence (prompt + response) the KV cache is sized for."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    n_experts: int = 8
    """Routed experts E per MoE layer."""
    top_k: int = 2
    """Experts K activated per token; 1 <= K <= E."""
    d_expert: int = 64
    """Hidden width of each routed SwiGLU expert."""
    moe_every: int = 1
    """Use an MoE feed-forward in every n-th block (blocks n-1, 2n-1, ...); the others are dense SwiGLU."""
    d_dense: int = 128
    """Hidden width of the dense SwiGLU feed-forward in non-MoE blocks."""
    d_shared_expert: int = 0
    """Hidden width of an always-active shared expert added to every MoE layer; 0 disables it."""
    norm_topk_prob: bool = True
    """Renormalise the K gathered router probabilities to sum to 1 (Qwen3-MoE style)."""
    aux_loss_coef: float = 0.01
    """Coefficient of the Switch-Transformer load-balancing loss E * sum_e f_e * P_e (mean over MoE layers)."""
    z_loss_coef: float = 0.0
    """Coefficient of the router z-loss mean(logsumexp(router logits)^2) (ST-MoE). At 0 it is not computed (it would
    add zero to the loss and to every gradient)."""
    dispatch: Literal[DISPATCH_MODES] = "grouped"  # the tuple spells the choices; --help lists them
    """Expert dispatch: 'grouped' (sort token-slots by expert; per call the faster of grouped_mm and padded for the
    shape), 'loop' (per-expert reference), or force one kernel: 'grouped_mm' or 'padded' (batched matmul)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init; output projections are scaled by 1/sqrt(2 init_depth)."""
    init_depth: int = 0
    """The depth in that 1/sqrt(2 x depth) scale of the residual output projections (GPT-2's init); 0: n_layers.
    Set it to one value across a depth sweep to hold the init scale fixed while the depth changes."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len",
                      "n_experts", "top_k", "d_expert", "moe_every", "d_dense"):
            check_positive(field, getattr(self, field))
        for field in ("d_shared_expert", "aux_loss_coef", "z_loss_coef", "init_std", "init_depth"):
            check_positive(field, getattr(self, field), allow_zero=True)
        check_positive("norm_eps", self.norm_eps)
        check_positive("rope_theta", self.rope_theta)
        check_choice("dispatch", self.dispatch, DISPATCH_MODES)
        self._check_backend()
        if self.top_k > self.n_experts:
            raise ConfigError(f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dim d_model/n_heads={self.head_dim} must be even for rotary embeddings")
        if self.moe_every > self.n_layers:
            raise ConfigError(f"moe_every={self.moe_every} must be <= n_layers={self.n_layers} (else no MoE layer)")

    def _check_backend(self) -> None:
        check_choice("backend", self.backend, BACKENDS)
        if self.hf_config is not None:  # the CLI checks the Literal types; a config built in Python is checked here
            check_choice("hf_config", self.hf_config, HF_FAMILIES)
        if self.backend == "native" and (self.hf_config or self.hf_path or self.hf_in_memory):
            raise ConfigError("hf_config / hf_path / hf_in_memory need backend='hf' (--model.backend hf)")
        if self.hf_in_memory:
            if self.hf_config is not None or self.hf_path is not None:
                raise ConfigError("hf_in_memory (a model wrapped with HFMoEModel.wrap) takes neither hf_config nor "
                                  "hf_path")
            return
        if self.backend == "hf" and (self.hf_config is None) == (self.hf_path is None):
            raise ConfigError("backend='hf' needs exactly one of hf_config (a tiny random model of a family) or "
                              "hf_path (a local checkpoint directory)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_moe_block(self, block_index: int) -> bool:
        """Whether block `block_index` has an MoE feed-forward (Qwen3-MoE's decoder_sparse_step rule)."""
        return (block_index + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    def dense_twin(self) -> ModelConfig:
        """The dense control of this native MoE: each MoE layer becomes one expert of width top_k x d_expert that
        every token takes (n_experts 1, top_k 1), so every token runs the same parameters, as many per token as the
        MoE activates. Attention, depth, width, dense blocks and a shared expert are unchanged. A one-expert router's
        softmax is exactly 1 whatever its logit, so its gate weight is the constant 1, the router and the
        load-balancing loss get zero gradient, and routing cannot churn; the run keeps every instrument of an MoE
        run (its routing probes then read 0)."""
        if self.backend != "native":
            raise ConfigError("dense_twin: only the native model has a dense twin (backend='native')")
        return replace(self, n_experts=1, top_k=1, d_expert=self.top_k * self.d_expert)
