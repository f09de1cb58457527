"""Hugging Face MoE causal LMs under the routing contract, behind the native model's interface.

    from moe_rl.model.hf import build_hf_model, HFMoEModel
    model = build_hf_model(ModelConfig(backend="hf", hf_config="qwen3_moe"))    # tiny random Qwen3-MoE
    model = build_hf_model(ModelConfig(backend="hf", hf_path="ckpt/"))          # a save_pretrained directory
    model = HFMoEModel.wrap(AutoModelForCausalLM.from_pretrained(...))           # a model built in Python

transformers is imported only when a model is built.
"""

from moe_rl.model.hf.families import FAMILIES, Family, tiny_hf_config
from moe_rl.model.hf.load import build_hf_model, checkpoint_model_type, pretrained_hf_model, tiny_hf_model
from moe_rl.model.hf.model import HFKVCache, HFMoEModel, family_of, routing_plan
from moe_rl.model.hf.sites import HFRouterOutput, HFRouterSite

__all__ = [
    "FAMILIES", "Family", "HFKVCache", "HFMoEModel", "HFRouterOutput", "HFRouterSite", "build_hf_model",
    "checkpoint_model_type", "family_of", "pretrained_hf_model", "routing_plan", "tiny_hf_config", "tiny_hf_model",
]
