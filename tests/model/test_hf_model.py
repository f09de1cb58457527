"""The Hugging Face backend on tiny random models of every family (CPU, fp32, nothing downloaded): the adapter
computes exactly what the HF model computes, record and replay obey the routing contract, the sampler's stitched
trace is a full forward's routing, and what cannot be instrumented is refused before anything is touched."""

import copy

import pytest
import torch
from torch import nn

from moe_rl.errors import ConfigError, RoutingError
from moe_rl.model import ModelConfig
from moe_rl.model.hf import FAMILIES, HFMoEModel, tiny_hf_config, tiny_hf_model
from moe_rl.rl.rollout import SamplingConfig, generate
from moe_rl.routing.churn import churn_stats
from moe_rl.routing.replay import record_routing, replay_routing
from moe_rl.routing.trace import RoutingTrace

SIZES = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, d_expert=32, d_dense=64,
             init_std=0.1)
ALL = list(FAMILIES)


def hf_model(family: str, seed: int = 0) -> HFMoEModel:
    torch.manual_seed(seed)
    return tiny_hf_model(family, ModelConfig(backend="hf", hf_config=family, **SIZES))


def padded_batch(B=3, S=10):
    g = torch.Generator().manual_seed(1)
    ids_BS = torch.randint(3, 99, (B, S), generator=g)
    valid_BS = torch.ones(B, S, dtype=torch.bool)
    valid_BS[0, :4] = False  # left padding
    valid_BS[1, -3:] = False  # right padding
    return ids_BS, valid_BS


@pytest.mark.parametrize("family", ALL)
def test_adapter_logits_equal_the_unwrapped_hf_model(family):
    model = hf_model(family).eval()
    ids_BS, valid_BS = padded_batch()
    positions_BS = (valid_BS.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        assert torch.equal(model(ids_BS).logits_BSV, model.hf(input_ids=ids_BS).logits)
        ours = model(ids_BS, valid_BS).logits_BSV
        theirs = model.hf(input_ids=ids_BS, attention_mask=valid_BS.long(), position_ids=positions_BS).logits
    assert (ours - theirs)[valid_BS].abs().max().item() == 0.0


@pytest.mark.parametrize("family", ALL)
def test_the_gate_rule_reproduces_the_family_router_and_its_choice(family):
    """Our weight rule at the router's own ids gives bitwise the router's weights; the top-k of `choice` is its ids."""
    model = hf_model(family)
    x_TD = torch.randn(64, SIZES["d_model"])
    for site in model.moe_layers():
        logits_TE, weights_TK, ids_TK = site.router(x_TD)
        assert torch.equal(site.family.gate(site.router, logits_TE, ids_TK), weights_TK)
        choice_ids_TK = site.family.choice(site.router, logits_TE).topk(site.top_k, dim=-1).indices
        assert torch.equal(choice_ids_TK.sort(-1).values, ids_TK.sort(-1).values)
        scores_TE = site.family.scores(site.router, logits_TE)
        torch.testing.assert_close(scores_TE.sum(-1), torch.ones(64))


def test_deepseek_v3_routes_by_bias_and_groups_not_by_the_plain_top_k():
    """The correction bias and group limit change the choice: the recorded ids are the router's, not top-k(scores)."""
    model = hf_model("deepseek_v3")
    ids_BS, valid_BS = padded_batch()
    with torch.no_grad(), record_routing(model) as rec:
        model(ids_BS, valid_BS)
    site = model.moe_layers()[0]
    router = site.router
    assert router.num_group == 4 and router.topk_group == 2 and router.e_score_correction_bias.abs().sum() > 0
    trace = rec.trace().ids_LBSK[0].reshape(-1, 2).long().sort(-1).values
    # An independent reference: sigmoid + bias, keep the 2 best groups (by the sum of their top-2), then top-2.
    hidden = {}
    router.register_forward_hook(lambda m, args, out: hidden.update(x=args[0].reshape(-1, 32)))
    with torch.no_grad():
        model(ids_BS, valid_BS)
        s_TE = (hidden["x"] @ router.weight.T).sigmoid() + router.e_score_correction_bias
    group_TG = s_TE.view(-1, 4, 2).sum(-1)
    keep_TE = torch.zeros_like(group_TG).scatter(1, group_TG.topk(2, dim=-1).indices, 1.0).repeat_interleave(2, 1)
    reference = s_TE.masked_fill(keep_TE == 0, -1.0).topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(trace, reference)
    plain = (hidden["x"] @ router.weight.T).sigmoid().topk(2, dim=-1).indices.sort(-1).values
    assert (plain != reference).any(), "the bias should change some choices, or the test shows nothing"


@pytest.mark.parametrize("family", ALL)
def test_replaying_the_recorded_routing_reproduces_the_logits_exactly(family):
    model = hf_model(family)
    ids_BS, valid_BS = padded_batch()
    with record_routing(model) as rec:
        recorded = model(ids_BS, valid_BS)
    trace = rec.trace()
    assert trace.n_layers == len(model.moe_layers()) and trace.ids_LBSK.shape[1:] == (3, 10, 2)
    with replay_routing(model, trace, record_native=True) as rep:
        replayed = model(ids_BS, valid_BS)
    assert (recorded.logits_BSV - replayed.logits_BSV).abs().max().item() == 0.0
    assert recorded.aux_loss.item() == replayed.aux_loss.item()
    assert torch.equal(rep.native_trace().ids_LBSK, trace.ids_LBSK)


def _expert_inputs(model):
    """Capture the ids each MoE block hands its experts (the second positional argument in every family)."""
    seen = []
    for site in model.moe_layers():
        site.experts.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[1].detach().clone()))
    return seen


@pytest.mark.parametrize("family", ALL)
def test_shifted_replay_moves_tokens_between_experts_and_keeps_the_router_gradient(family):
    model = hf_model(family)
    ids_BS, valid_BS = padded_batch()
    with torch.no_grad(), record_routing(model) as rec:
        native = model(ids_BS, valid_BS).logits_BSV
    trace = rec.trace()
    shifted = RoutingTrace(((trace.ids_LBSK.long() + 1) % SIZES["n_experts"]).to(torch.int16))
    seen = _expert_inputs(model)
    with replay_routing(model, shifted, record_native=True) as rep:
        out = model(ids_BS, valid_BS)
    for layer, ids_TK in enumerate(seen):  # the experts ran on the shifted ids
        assert torch.equal(ids_TK, shifted.ids_LBSK[layer].reshape(-1, 2).long())
    assert torch.equal(rep.native_trace().ids_LBSK[0], trace.ids_LBSK[0])  # what the router chose itself
    assert (out.logits_BSV - native).abs().max() > 1e-3
    out.logits_BSV[valid_BS].logsumexp(-1).mean().backward()
    for site in model.moe_layers():
        assert site.router.weight.grad is not None and site.router.weight.grad.abs().sum() > 0, site.moe_index


@pytest.mark.parametrize("family", ALL)
def test_the_sampler_trace_equals_a_full_forward(family):
    model = hf_model(family).eval()
    ids_BP, valid_BP = padded_batch(4, 8)
    valid_BP[1] = True
    gen = generate(model, ids_BP, valid_BP, SamplingConfig(max_new_tokens=10), eos_id=2, pad_id=0,
                   generator=torch.Generator().manual_seed(0), record=True)
    with torch.no_grad(), record_routing(model) as rec:
        logits_BSV = model(gen.input_ids_BS, gen.input_valid_BS).logits_BSV
    full = rec.trace()
    assert full.ids_LBSK.shape == gen.routing.ids_LBSK.shape
    assert churn_stats(full, gen.routing, gen.input_valid_BS).set_change == 0.0
    logp_BN = logits_BSV[:, gen.prompt_len - 1:].log_softmax(-1).gather(-1, gen.response_BN[..., None])[..., 0]
    mask_BN = gen.response_mask_BN
    torch.testing.assert_close(logp_BN[mask_BN], gen.logprobs_BN[mask_BN], rtol=0, atol=1e-5)


def test_a_deep_copy_routes_through_its_own_sites():
    """trainer.py's frozen reference model is a deepcopy: its hooks must report to the copy's sessions."""
    model = hf_model("qwen3_moe")
    ref = copy.deepcopy(model)
    ids_BS, valid_BS = padded_batch()
    with torch.no_grad(), record_routing(ref) as rec:
        ref(ids_BS, valid_BS)
    assert all(site.routing_session is None for site in model.moe_layers())
    with torch.no_grad(), record_routing(model) as rec2:
        model(ids_BS, valid_BS)
    assert torch.equal(rec.trace().ids_LBSK, rec2.trace().ids_LBSK)


def test_num_params_counts_k_of_e_routed_experts_as_active():
    model = hf_model("qwen2_moe")
    counts = model.num_params()
    expert = sum(p.numel() for site in model.moe_layers() for p in site.experts.parameters())
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["active"] == expert * 6 // 8


# --- refusals ------------------------------------------------------------------------------------------------


def test_an_unsupported_family_is_refused_naming_its_class():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ConfigError, match="LlamaForCausalLM.*'llama'.*not a supported MoE family"):
        HFMoEModel(llama, ModelConfig(backend="hf", hf_config="qwen3_moe"))


def test_an_unknown_router_class_is_refused_before_any_layer_is_hooked():
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(backend="hf", hf_config="qwen3_moe", **SIZES)
    hf = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe", cfg))

    class MyRouter(nn.Module):
        pass

    hf.model.layers[2].mlp.gate = MyRouter()
    with pytest.raises(ConfigError, match="decoder layer 2: router class MyRouter is not supported"):
        HFMoEModel(hf, cfg)
    assert not hf.model.layers[0].mlp.gate._forward_hooks  # never half-instrumented


def test_a_kernel_that_bypasses_the_router_is_caught():
    model = hf_model("olmoe")
    block = model.moe_layers()[1].block
    block.forward = lambda x: torch.zeros_like(x)  # a fused kernel would route without calling the router
    with pytest.raises(RoutingError, match="MoE layer 1 .*ran 0 times"):
        model(*padded_batch())


@pytest.mark.parametrize("kw, match", [
    (dict(backend="hf"), "exactly one of hf_config"),
    (dict(backend="hf", hf_config="qwen3_moe", hf_path="x"), "exactly one of hf_config"),
    (dict(hf_config="qwen3_moe"), "need backend='hf'"),
    (dict(backend="hf", hf_config="llama"), "hf_config='llama' is not valid"),
])
def test_model_config_checks_the_backend_fields(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**kw)


def test_a_model_built_in_python_is_wrapped_with_its_own_vocabulary_and_routes_alike():
    """HFMoEModel.wrap: no hf_config or hf_path needed; the same logits and routing as the adapter the run builds,
    and a config that nothing can rebuild from is refused by name where a run would try."""
    from moe_rl.model.hf import build_hf_model

    built = hf_model("qwen3_moe").eval()
    wrapped = HFMoEModel.wrap(copy.deepcopy(built.hf), aux_loss_coef=0.02)
    assert wrapped.cfg.hf_in_memory and wrapped.cfg.aux_loss_coef == 0.02
    assert wrapped.cfg.vocab_size == built.hf.config.vocab_size
    assert wrapped.cfg.max_seq_len == built.hf.config.max_position_embeddings
    ids_BS, valid_BS = padded_batch()
    with torch.no_grad(), record_routing(built) as ours, record_routing(wrapped) as theirs:
        assert torch.equal(built(ids_BS, valid_BS).logits_BSV, wrapped(ids_BS, valid_BS).logits_BSV)
    assert torch.equal(ours.trace().ids_LBSK, theirs.trace().ids_LBSK)
    with pytest.raises(ConfigError, match="wrapped in Python"):
        build_hf_model(wrapped.cfg)
    with pytest.raises(ConfigError, match="exactly one of hf_config"):
        ModelConfig(backend="hf")


class _SumInFloat32(torch.overrides.TorchFunctionMode):
    """CUDA's autocast policy for `sum` (it runs in fp32 and returns fp32), on CPU, where autocast keeps bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.sum, torch.Tensor.sum) and args[0].dtype == torch.bfloat16:
            return func(args[0].float(), *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ALL)
def test_the_gate_rule_gives_the_routers_own_weights_under_an_autocast_that_sums_in_fp32(family):
    # Found on an H200: under CUDA's bf16 autocast DeepSeek-V3's router sums in fp32 but divides in place, so its
    # weights stay bf16; a rule that divided out of place ran the experts with fp32 weights under replay.
    model = hf_model(family)
    router = model.moe_layers()[0].router
    x_TD = torch.randn(12, SIZES["d_model"], generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16), _SumInFloat32():
        logits_TE, weights_TK, ids_TK = router(x_TD)
        ours_TK = FAMILIES[family].gate(router, logits_TE, ids_TK)
    assert ours_TK.dtype == weights_TK.dtype and torch.equal(ours_TK, weights_TK)
