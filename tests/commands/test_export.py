"""moe-rl export: a checkpoint as a Hugging Face folder whose from_pretrained model computes the trained function.

- native backend: the exported Mixtral's fp32 logits equal the trained MoETransformer's (< 1e-5) on padded and
  unpadded rows, for a trained run and for a config with tied embeddings, another RoPE theta, eps and GQA group;
  a native config Mixtral cannot express is refused in one line naming the part, and nothing is written.
- hf backend: the exported model's logits equal the trained HFMoEModel's.
- the character tokenizer's tokenizer.json gives CharTokenizer's ids for every character, and the folder trains as
  `--model.backend hf --model.hf-path` with the same prompt ids and the same logits.
- `--out`: new, empty or an earlier export's; anything else is refused with its files untouched.
"""

from dataclasses import asdict

import pytest
import torch

pytest.importorskip("transformers")

from conftest import TINY_MODEL, cli, refused, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.model import ModelConfig
from moe_rl.rl.build import build_model, build_model_tokenizer
from moe_rl.runs.checkpoint import save_checkpoint
from moe_rl.tasks import CharTokenizer
from moe_rl.tasks.tokenizer import HF_SPECIAL_NAMES, char_tokenizer_as_hf

CPU = torch.device("cpu")
HF_SIZES = {"d_model": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "n_experts": 8, "top_k": 2, "d_expert": 32,
            "d_dense": 64}


def trained_run(out_dir, **model_fields):
    """One RL step of the real trainer: the checkpoint holds weights an optimizer moved."""
    cfg = tiny_train_config(out_dir, total_steps=1, model=ModelConfig(**{**TINY_MODEL, **model_fields}))
    train(cfg)
    return out_dir / "checkpoints" / "latest.pt"


def saved_model(out_dir, seed=0, **model_fields):
    """A checkpoint in the trainer's format ({"model", "model_config"}, as sft saves it) of a random model."""
    cfg = ModelConfig(**model_fields)
    torch.manual_seed(seed)
    model = build_model(cfg, CPU, seed, None)
    with torch.no_grad():  # norms away from 1 so that a norm mapped to the wrong place shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return save_checkpoint(out_dir, 0, {"model": model.state_dict(), "model_config": asdict(cfg)})


def logits_of_both(checkpoint, folder):
    """(trained model's, from_pretrained's) fp32 logits of the same rows: one full, one left-padded."""
    from transformers import AutoModelForCausalLM

    from moe_rl.commands.evaluate import read_checkpoint

    model_cfg, _ = read_checkpoint(checkpoint)
    ours = build_model(model_cfg, CPU, 0, str(checkpoint)).eval()
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids_BS = torch.randint(3, model_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    valid_BS = torch.ones_like(ids_BS, dtype=torch.bool)
    valid_BS[1, :7] = False  # left padding: positions count real tokens only, in both
    positions_BS = (valid_BS.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(ids_BS, valid_BS).logits_BSV
        b = theirs(input_ids=ids_BS, attention_mask=valid_BS.long(), position_ids=positions_BS).logits
    return a[valid_BS], b[valid_BS], theirs


def export(checkpoint, out):
    code, stdout, stderr = cli("export", "--checkpoint", checkpoint, "--out", out)
    assert code == 0, stderr
    return stdout


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("native") / "run")


def test_a_trained_native_model_exports_as_a_mixtral_with_its_logits(native_run, tmp_path):
    out = tmp_path / "hf"
    said = export(native_run.parents[1], out)  # the run directory: its latest.pt
    assert "mixtral" in said and "step 1" in said
    ours, theirs, model = logits_of_both(native_run, out)
    assert model.config.model_type == "mixtral"
    assert (ours - theirs).abs().max() < 1e-5
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("fields", [
    {"tie_embeddings": True, "rope_theta": 500.0, "norm_eps": 1e-5, "n_heads": 4, "n_kv_heads": 2},
    {"n_heads": 4, "n_kv_heads": 4, "top_k": 3, "n_experts": 6},
])
def test_native_configs_that_map_give_the_same_logits(tmp_path, fields):
    checkpoint = saved_model(tmp_path / "run", **{**HF_SIZES, "vocab_size": 99, **fields})
    export(checkpoint, tmp_path / "hf")
    ours, theirs, model = logits_of_both(checkpoint, tmp_path / "hf")
    assert (ours - theirs).abs().max() < 1e-5
    assert model.config.tie_word_embeddings == fields.get("tie_embeddings", False)


@pytest.mark.parametrize("fields, part", [
    ({"moe_every": 2}, "the dense blocks: moe_every=2"),
    ({"norm_topk_prob": False}, "the router: norm_topk_prob=False"),
    ({"d_shared_expert": 16}, "the shared expert: d_shared_expert=16"),
])
def test_a_native_config_that_does_not_map_is_refused_by_name(tmp_path, fields, part):
    checkpoint = saved_model(tmp_path / "run", **{**HF_SIZES, "vocab_size": 99, **fields})
    out = tmp_path / "hf"
    line = refused(cli("export", "--checkpoint", checkpoint, "--out", out), "does not map exactly onto", part)
    assert "q/k norm" in line  # and why not Qwen3-MoE
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_an_hf_model_exports_with_its_logits(tmp_path, family):
    if family == "qwen3_moe":  # the trained policy, through the real trainer
        cfg = tiny_train_config(tmp_path / "run", total_steps=1,
                                model=ModelConfig(backend="hf", hf_config=family, **HF_SIZES))
        train(cfg)
        checkpoint = tmp_path / "run" / "checkpoints" / "latest.pt"
    else:
        checkpoint = saved_model(tmp_path / "run", backend="hf", hf_config=family, **HF_SIZES)
    export(checkpoint, tmp_path / "hf")
    ours, theirs, model = logits_of_both(checkpoint, tmp_path / "hf")
    assert model.config.model_type == family
    assert (ours - theirs).abs().max() < 1e-5


def test_a_model_the_character_tokenizer_does_not_fit_gets_no_tokenizer(tmp_path):
    checkpoint = saved_model(tmp_path / "run", **{**HF_SIZES, "vocab_size": 40})
    said = export(checkpoint, tmp_path / "hf")
    assert "no tokenizer: the model's vocab_size 40 is not the character tokenizer's 99" in said
    assert not (tmp_path / "hf" / "tokenizer.json").exists() and (tmp_path / "hf" / "model.safetensors").is_file()


def test_the_character_tokenizer_json_is_the_character_tokenizer():
    chars, hf = CharTokenizer(), char_tokenizer_as_hf()
    text = "".join(chr(c) for c in range(32, 127)) + "\n 12+34=\n\n<s></s><pad>[UNK]"
    assert hf.encode(text, add_special_tokens=False) == chars.encode(text)
    assert hf(text)["input_ids"] == [chars.bos_id] + chars.encode(text)  # BOS first, as the sampler feeds prompts
    assert hf.decode([chars.bos_id] + chars.encode(text) + [chars.eos_id], skip_special_tokens=True) == text
    assert (len(hf), hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (chars.vocab_size, 0, 1, 2)
    assert all(name not in text and len(chars.encode(name[1:-1])) > 1 for name in HF_SPECIAL_NAMES)
    with pytest.raises(Exception, match="Missing"):  # outside the vocabulary: an error, as CharTokenizer's, not a guess
        hf.encode("é", add_special_tokens=False)


def test_an_exported_native_model_trains_as_hf_path_with_the_same_ids_and_logits(native_run, tmp_path):
    out = tmp_path / "hf"
    export(native_run, out)
    cfg = ModelConfig(backend="hf", hf_path=str(out))
    tokenizer = build_model_tokenizer(cfg)  # the folder's tokenizer.json, not the fallback
    assert type(tokenizer).__name__ == "HFTokenizer"
    prompt = "3+41+7=\n"
    assert tokenizer.encode(prompt) == CharTokenizer().encode(prompt)
    from moe_rl.commands.evaluate import read_checkpoint

    native = build_model(read_checkpoint(native_run)[0], CPU, 0, str(native_run)).eval()
    wrapped = build_model(cfg, CPU, 0, None).eval()
    ids_BS = torch.tensor([[1, *tokenizer.encode(prompt)]])
    with torch.no_grad():
        assert (native(ids_BS).logits_BSV - wrapped(ids_BS).logits_BSV).abs().max() < 1e-5


def test_an_hf_path_run_exports_the_tokenizer_of_its_path(native_run, tmp_path):
    base = tmp_path / "base"
    export(native_run, base)  # a folder with a tokenizer, as a user's checkpoint would have
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer of its own: PAD renamed
        (base / name).write_text((base / name).read_text().replace("⟨pad⟩", "⟨PAD⟩"))
    checkpoint = saved_model(tmp_path / "run", backend="hf", hf_path=str(base))
    said = export(checkpoint, tmp_path / "hf")
    assert f"the tokenizer of {base}" in said
    assert "⟨PAD⟩" in (tmp_path / "hf" / "tokenizer.json").read_text()  # that one, not the character tokenizer's
    ours, theirs, _ = logits_of_both(checkpoint, tmp_path / "hf")
    assert (ours - theirs).abs().max() < 1e-5


def test_out_must_be_new_empty_or_an_earlier_export(native_run, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused(cli("export", "--checkpoint", native_run, "--out", foreign), "not written by moe-rl export", "notes.txt")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "keep me"

    empty = tmp_path / "empty"
    empty.mkdir()
    export(native_run, empty)
    (empty / "config.json").write_text("{}")
    export(native_run, empty)  # an earlier export's folder: its files are replaced
    assert '"mixtral"' in (empty / "config.json").read_text()
    (empty / "README.md").write_text("my notes")  # a file export did not write: the folder is the user's now
    refused(cli("export", "--checkpoint", native_run, "--out", empty), "README.md")
    assert (empty / "README.md").read_text() == "my notes" and (empty / "model.safetensors").is_file()
    refused(cli("export", "--checkpoint", native_run, "--out", native_run.parents[1]), "manifest.json")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_export_help_documents_its_fields():
    code, stdout, _ = cli("export", "--help")
    assert code == 0
    text = " ".join(stdout.replace("│", " ").split())
    assert "--checkpoint" in text and "--out" in text and "one an earlier `moe-rl export` wrote" in text
