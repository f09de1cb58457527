"""`moe-rl train` and `moe-rl sft` with Hugging Face models: every family under R2 and R3 writes the native model's
metrics, an HF run warm-starts from an HF SFT checkpoint, and a local save_pretrained directory trains with its own
tokenizer. The commands run in-process through `moe_rl.cli.main`, so the flags are parsed exactly as on the shell."""

import re
import string

import pytest
import torch
from conftest import metric_lines

from moe_rl.cli import main
from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig
from moe_rl.model.hf import FAMILIES, tiny_hf_config
from moe_rl.rl.build import build_model_tokenizer
from moe_rl.runs.runlog import read_manifest
from moe_rl.tasks.tokenizer import HFTokenizer

SIZES = ["--model.d-model", "32", "--model.n-layers", "3", "--model.n-heads", "4", "--model.n-kv-heads", "2",
         "--model.n-experts", "8", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
STEP = ["--total-steps", "2", "--minibatches", "2", "--rollout.prompts-per-step", "2", "--rollout.group-size", "4",
        "--rollout.sampling.max-new-tokens", "6"]


def moe_rl(*args) -> int:
    return main([str(a) for a in args])


def key_patterns(run) -> set[str]:
    """Metric names with the layer index wildcarded, so models of different depth compare."""
    return {re.sub(r"/L\d+$", "/L*", key) for line in metric_lines(run) for key in line}


@pytest.fixture(scope="module")
def native_keys(tmp_path_factory):
    run = tmp_path_factory.mktemp("native") / "run"
    assert moe_rl("train", "--out-dir", run, "--routing-mode", "R2", *SIZES, *STEP) == 0
    return key_patterns(run)


@pytest.mark.parametrize("mode", ["R2", "R3"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_runs_every_family_and_writes_the_native_metrics(tmp_path, native_keys, family, mode):
    run = tmp_path / "run"
    assert moe_rl("train", "--out-dir", run, "--routing-mode", mode, "--model.backend", "hf",
                  "--model.hf-config", family, *SIZES, *STEP) == 0
    assert read_manifest(run)["status"] == "finished"
    assert key_patterns(run) == native_keys
    lines = metric_lines(run)
    n_moe = 2 if family == "deepseek_v3" else 3  # DeepSeek-V3's first layer is dense (first_k_dense_replace)
    assert {k for k in lines[-1] if k.startswith("routing/update/churn/L")} == {
        f"routing/update/churn/L{i}" for i in range(n_moe)}
    for line in metric_lines(run, minibatch=0):
        if mode == "R2":  # the replayed old-pass routing reproduces the old log-probs exactly
            assert line["routing/replay/churn"] == 0.0 and line["ratio/log_abs_max"] == 0.0
        else:  # the sampler routed exactly like the trainer's old pass
            assert line["routing/rollout/churn"] == 0.0 and line["rollout/log_ratio_abs_mean"] < 1e-5
    assert sorted(p.name for p in (run / "routing").iterdir()) == ["step_000000.parquet", "step_000001.parquet"]


def test_sft_then_rl_with_an_hf_model(tmp_path):
    hf = ["--model.backend", "hf", "--model.hf-config", "mixtral", *SIZES]
    assert moe_rl("sft", "--out-dir", tmp_path / "sft", "--total-steps", "3", "--batch-size", "8",
                  "--log.eval-every", "3", "--log.eval-prompts", "4", "--sampling.max-new-tokens", "6", *hf) == 0
    losses = [line["loss"] for line in metric_lines(tmp_path / "sft")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    ckpt = tmp_path / "sft" / "checkpoints" / "latest.pt"
    assert moe_rl("train", "--out-dir", tmp_path / "rl", "--init-from", ckpt, *hf, *STEP) == 0
    saved = torch.load(ckpt, weights_only=True)["model"]
    assert any(k.startswith("hf.model.layers.0.mlp.gate") for k in saved)
    with pytest.raises(ConfigError, match="backend"):  # a native model refuses the HF checkpoint, naming why
        from moe_rl.rl.build import build_model

        build_model(ModelConfig(d_model=32, n_layers=3), torch.device("cpu"), 0, str(ckpt))


def _bpe_tokenizer():
    """A byte-level BPE tokenizer trained here on a few strings: a real HF tokenizer, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["3 + 4 - 2 = 5", "12 + 7 - 1 = 18", string.printable] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _save_checkpoint(path, family="qwen3_moe", vocab=320, tokenizer=None):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2,
                      d_expert=32, d_dense=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_hf_config(family, cfg)).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def test_train_from_a_local_checkpoint_directory_with_its_own_tokenizer(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save_checkpoint(ckpt, tokenizer=_bpe_tokenizer())
    tokenizer = build_model_tokenizer(ModelConfig(backend="hf", hf_path=str(ckpt)))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 300
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    ids = tokenizer.encode("12 + 7 = ?")
    assert len(ids) < len("12 + 7 = ?")  # multi-character tokens: not the character tokenizer
    assert tokenizer.decode([1, *ids, 2, 5, 0]) == "12 + 7 = ?"
    assert moe_rl("train", "--out-dir", tmp_path / "run", "--model.backend", "hf", "--model.hf-path", ckpt,
                  *STEP) == 0
    assert len(metric_lines(tmp_path / "run")) == 4
    # Without tokenizer files the character tokenizer is used, if its 99 ids fit the model's vocabulary.
    _save_checkpoint(tmp_path / "bare", vocab=64)
    with pytest.raises(ConfigError, match="character tokenizer .* has 99 ids but the model's vocab_size is 64"):
        build_model_tokenizer(ModelConfig(backend="hf", hf_path=str(tmp_path / "bare")))


def test_an_unsupported_checkpoint_is_a_one_line_error(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # save_pretrained's progress bar
    assert moe_rl("train", "--out-dir", tmp_path / "run", "--model.backend", "hf", "--model.hf-path",
                  tmp_path / "llama", *STEP) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model_type 'llama' is not a supported MoE family" in err
    assert moe_rl("train", "--out-dir", tmp_path / "run2", "--model.backend", "hf", "--model.hf-path",
                  tmp_path / "nothing", *STEP) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_hf_tokenizer_special_ids_fall_back_and_collisions_are_refused():
    from transformers import PreTrainedTokenizerFast

    base = _bpe_tokenizer()
    no_bos = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="</s>", unk_token="<unk>")
    tokenizer = HFTokenizer(no_bos)  # Qwen-style: no BOS, no PAD
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (2, 2, 3)  # BOS = EOS, PAD = UNK
    clash = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="</s>", pad_token="</s>")
    with pytest.raises(ValueError, match="PAD .* distinct from BOS and EOS"):
        HFTokenizer(clash)
