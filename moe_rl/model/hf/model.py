"""HFMoEModel: a Hugging Face MoE causal LM behind the interface of the native `MoETransformer`.

    model = HFMoEModel(hf_causal_lm, model_cfg)       # refuses an unknown family or router before touching it
    out = model(input_ids_BS, valid_BP, cache)        # ModelOutput(logits_BSV, aux_loss, lb_loss, z_loss)
    model.moe_layers()                                # HFRouterSite per MoE layer: record_routing / replay_routing
    cache = model.new_cache(B, max_len)               # the sampler's KV cache (a transformers DynamicCache inside)
    model.blocks                                      # the decoder layers (one FSDP unit each)
    model.hf.save_pretrained(dir)                     # back to a Hugging Face checkpoint

Shapes: B batch, S tokens in this call, P positions visible to attention (cache + this call), V vocabulary.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from moe_rl.errors import ConfigError, RoutingError
from moe_rl.model.config import ModelConfig
from moe_rl.model.hf.families import FAMILIES, Family
from moe_rl.model.hf.sites import HFRouterSite
from moe_rl.model.layers import positions_from_mask
from moe_rl.model.moe import load_balancing_loss, router_z_loss
from moe_rl.model.transformer import ModelOutput


class HFKVCache:
    """The native KVCache's protocol (`length`, `advance`, a size limit) over a transformers DynamicCache."""

    def __init__(self, hf_cache, max_len: int):
        self.hf_cache = hf_cache
        self.max_len = max_len
        self.length = 0

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; this step needs {self.length + n}")

    def advance(self, n: int) -> None:
        """Called once per model forward; the transformers cache itself was filled by the layers."""
        self.length += n


def family_of(hf_model: nn.Module) -> Family:
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ConfigError(
            f"{type(hf_model).__name__} (model_type={model_type!r}) is not a supported MoE family; "
            f"supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def decoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(hf_model).__name__} has no model.layers: not a decoder-only causal LM")
    return layers


def routing_plan(hf_model: nn.Module, family: Family) -> list[tuple[int, nn.Module, nn.Module]]:
    """(decoder layer index, MoE block, router) for every MoE layer. Every layer's feed-forward must be the family's
    MoE block with the family's router, or one of its dense feed-forwards: anything else is refused here, before
    a single hook is attached, so a model is never half-instrumented."""
    plan = []
    for index, layer in enumerate(decoder_layers(hf_model)):
        block = getattr(layer, "mlp", None)
        kind = type(block).__name__
        if kind in family.dense:
            continue
        if kind != family.moe_block:
            raise ConfigError(f"{family.name} decoder layer {index}: feed-forward class {kind} is not supported "
                              f"(expected {family.moe_block} or one of {family.dense or 'no dense class'})")
        router = getattr(block, family.router_attr, None)
        if type(router).__name__ != family.router:
            raise ConfigError(f"{family.name} decoder layer {index}: router class {type(router).__name__} is not "
                              f"supported (expected {family.router} at {kind}.{family.router_attr})")
        plan.append((index, block, router))
    if not plan:
        raise ConfigError(f"{type(hf_model).__name__} has no MoE layer: there is no routing to study")
    if family.name == "mixtral" and hf_model.config.router_jitter_noise > 0:
        raise ConfigError("mixtral router_jitter_noise > 0 makes training forwards random, so a replayed forward "
                          "could not reproduce a recorded one; set it to 0 in the checkpoint's config.json")
    return plan


class HFMoEModel(nn.Module):
    """A transformers MoE causal LM (`hf`) with every router under the routing contract (docs/design.md
    section 4). `cfg` is the run's ModelConfig: backend, the aux-loss coefficients and max_seq_len."""

    def __init__(self, hf_model: nn.Module, cfg: ModelConfig):
        super().__init__()
        family = family_of(hf_model)
        plan = routing_plan(hf_model, family)
        self.cfg = cfg
        self.family = family.name
        self.hf = hf_model
        self.sites = [HFRouterSite(i, layer, block, router, family) for i, (layer, block, router) in enumerate(plan)]
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x

    @classmethod
    def wrap(cls, hf_model: nn.Module, **model_fields) -> HFMoEModel:
        """A transformers MoE causal LM built in Python (from_pretrained, a config, your own training) under the
        routing contract. The ModelConfig takes the model's vocabulary and context length; `model_fields` set the
        others that apply (aux_loss_coef, z_loss_coef, max_seq_len)."""
        hf_cfg = hf_model.config
        fields = {"vocab_size": hf_cfg.vocab_size,
                  "max_seq_len": getattr(hf_cfg, "max_position_embeddings", None) or ModelConfig.max_seq_len}
        cfg = ModelConfig(backend="hf", hf_in_memory=True, **{**fields, **model_fields})
        return cls(hf_model, cfg)

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers, in depth order (what FSDP shards one by one)."""
        return decoder_layers(self.hf)

    def moe_layers(self) -> list[HFRouterSite]:
        """Routing sites in depth order: the layer axis of every routing trace."""
        return list(self.sites)

    def new_cache(self, batch: int, max_len: int | None = None) -> HFKVCache:
        from transformers import DynamicCache

        return HFKVCache(DynamicCache(config=self.hf.config), max_len or self.cfg.max_seq_len)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        valid_BP: torch.Tensor | None = None,
        cache: HFKVCache | None = None,
        numerics=None,
    ) -> ModelOutput:
        """Run S new tokens. `valid_BP` marks real tokens over the cached positions followed by these S; padding
        may sit on either side. Positions count real tokens only, as in the native model. `numerics` (the
        sampler's precision.Numerics) is not read: the family's routers are transformers' own, and an emulated
        engine reaches them through the sampler's autocast only."""
        B, S = input_ids_BS.shape
        if valid_BP is None:
            past = cache.length if cache is not None else 0
            valid_BP = torch.ones(B, past + S, dtype=torch.bool, device=input_ids_BS.device)
        if cache is not None:
            cache.check_room(S)
        for site in self.sites:
            site.start(B, S)
        try:
            logits_BSV = self._hf_logits(input_ids_BS, valid_BP, cache)
            self._check_every_router_ran()
            return ModelOutput(logits_BSV, *self._aux_losses(valid_BP[:, -S:]))
        finally:
            for site in self.sites:
                site.finish()

    def _hf_logits(self, input_ids_BS, valid_BP, cache):
        S = input_ids_BS.shape[1]
        full_causal = cache is None and bool(valid_BP.all())
        out = self.hf(
            input_ids=input_ids_BS,
            attention_mask=None if full_causal else valid_BP.long(),
            position_ids=positions_from_mask(valid_BP)[:, -S:],
            use_cache=cache is not None,
            **{self._cache_kwarg: cache.hf_cache if cache is not None else None},
        )
        if cache is not None:
            cache.advance(S)
        return out.logits

    def _check_every_router_ran(self) -> None:
        for site in self.sites:
            if site.calls != 1:
                raise RoutingError(
                    f"MoE layer {site.moe_index} (decoder layer {site.layer_index}): its router ran {site.calls} "
                    "times in one forward; a fused kernel that bypasses the router cannot be recorded or replayed"
                )

    def _aux_losses(self, valid_BS: torch.Tensor):
        """The native model's router losses over valid tokens: load balancing and z-loss, mean over MoE layers."""
        if not torch.is_grad_enabled():
            return None, None, None
        valid_T = valid_BS.reshape(-1)
        routings = [site.last for site in self.sites]
        lb_loss = torch.stack([load_balancing_loss(r.scores_TE[valid_T], r.ids_TK[valid_T]) for r in routings]).mean()
        z_loss = torch.stack([router_z_loss(r.logits_TE[valid_T]) for r in routings]).mean()
        return self.cfg.aux_loss_coef * lb_loss + self.cfg.z_loss_coef * z_loss, lb_loss, z_loss

    def num_params(self) -> dict[str, int]:
        """Total parameters and those active per token (K of E routed experts in each MoE layer)."""
        total = sum(p.numel() for p in self.parameters())
        idle = 0
        for site in self.sites:
            expert = sum(p.numel() for p in site.experts.parameters())
            idle += expert - expert * site.top_k // site.n_experts
        return {"total": total, "active": total - idle}
