"""moe-rl export: a checkpoint as a Hugging Face model folder that `AutoModelForCausalLM.from_pretrained` loads.

The folder holds what `save_pretrained` writes (config.json, model.safetensors, generation_config.json), a tokenizer,
and export.json (where it came from: the checkpoint, its step, the model config, the check below):

- `--model.backend hf`: the trained transformers model itself.
- `--model.backend native`: the native MoETransformer mapped weight for weight onto a transformers Mixtral
  (moe_rl/model/hf/native.py says part by part why Mixtral and not Qwen3-MoE). A native config that does not map
  exactly (norm_topk_prob off, dense blocks, a shared expert) is refused in one line naming the part; nothing
  approximate is written.
- The tokenizer: a run whose prompts used the character tokenizer (the native model, `--model.hf-config`, an
  hf_path without one) gets that tokenizer as tokenizer.json (the `tokenizers` library, id for id); a run on an
  hf_path with a tokenizer gets that tokenizer.

Before the folder is put in place, it is loaded back with `from_pretrained` and its fp32 logits on a fixed row of
tokens are compared with the trained model's: a difference above MAX_LOGIT_DIFF refuses the export (measured on the
test models: about 1e-6). It simplifies on purpose: one process, fp32 weights as trained, the whole model in memory
twice (the trained one and the loaded copy).

`--out` must be new, empty, or a folder an earlier export wrote (its export.json lists every file in it); anything
else is refused before a byte is written. The folder is written beside `--out` first and moved into place at the end,
so an export that fails leaves `--out` as it was.

    moe-rl export --checkpoint runs/grpo/checkpoints/latest.pt --out exports/grpo       # CPU
    moe-rl export --checkpoint runs/grpo --out exports/grpo                              # a run's latest.pt
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_rl.commands.evaluate import locate, read_checkpoint
from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig
from moe_rl.rl.build import build_model, build_model_tokenizer
from moe_rl.runs.atomic import current_umask
from moe_rl.runs.claim import check_out_dir
from moe_rl.runs.progress import say
from moe_rl.runs.provenance import utc_now
from moe_rl.tasks.tokenizer import CharTokenizer, char_tokenizer_as_hf

RECORD = "export.json"
KIND = "moe-rl export"
MAX_LOGIT_DIFF = 1e-4  # fp32, the same function computed by two codes: ~1e-6 on the test models
CHECK_TOKENS = 32


@dataclass
class ExportConfig:
    """A checkpoint of `moe-rl train` or `sft`, and the folder to write its Hugging Face model into."""

    checkpoint: str
    """A checkpoint file (a run's checkpoints/latest.pt or step_XXXXXX.pt) or a run directory (its latest.pt)."""
    out: str
    """The folder to write: new, empty, or one an earlier `moe-rl export` wrote (its files are replaced)."""


def export(cfg: ExportConfig) -> Path:
    """Write the checkpoint's model, tokenizer and export.json to cfg.out; returns the folder."""
    out = Path(cfg.out).expanduser()
    earlier = check_export_dir(out)
    path, _ = locate(cfg.checkpoint)
    model_cfg, step = read_checkpoint(path)
    if model_cfg.backend == "native":
        from moe_rl.model.hf.native import check_maps

        check_maps(model_cfg, what=f"checkpoint {path} (the native model)")
    model = build_model(model_cfg, torch.device("cpu"), 0, str(path)).eval()
    from transformers.utils import logging

    logging.disable_progress_bar()  # two bars per export (save, load back) say nothing to a user
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".export", dir=out.absolute().parent))
    staging.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would become the folder's
    try:
        hf_model = as_hf(model)
        hf_model.save_pretrained(staging)
        tokenizer = save_tokenizer(model_cfg, staging)
        diff = logit_diff(model, staging)
        write_record(staging, path, step, model_cfg, hf_model, tokenizer, diff)
        put_in_place(staging, out, earlier)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"wrote {out} ({hf_model.config.model_type}, step {step}, {tokenizer}); "
        f"from_pretrained logits within {diff:.1e} of the checkpoint's")
    return out


def as_hf(model) -> torch.nn.Module:
    """The transformers model to save: the trained one (hf backend) or the native model's exact Mixtral."""
    if hasattr(model, "hf"):
        return model.hf
    from moe_rl.model.hf.native import as_mixtral

    return as_mixtral(model)


def save_tokenizer(model_cfg: ModelConfig, folder: Path) -> str:
    """Save the tokenizer the run's prompts were encoded with; returns what was written, in words."""
    tokenizer = build_model_tokenizer(model_cfg)
    if isinstance(tokenizer, CharTokenizer):
        if model_cfg.hf_path is None and model_cfg.vocab_size != tokenizer.vocab_size:
            # moe-rl train and sft refuse this pair, so no run of theirs encoded prompts with it (a model saved
            # from Python may have any vocabulary)
            return (f"no tokenizer: the model's vocab_size {model_cfg.vocab_size} is not the character tokenizer's "
                    f"{tokenizer.vocab_size}")
        char_tokenizer_as_hf().save_pretrained(folder)
        return "the character tokenizer as tokenizer.json"
    tokenizer.transformers_tokenizer.save_pretrained(folder)
    return f"the tokenizer of {model_cfg.hf_path}"


@torch.no_grad()
def logit_diff(model, folder: Path) -> float:
    """max |logits| difference between the trained model and `folder` loaded by from_pretrained, fp32, on a fixed
    row of tokens; ConfigError above MAX_LOGIT_DIFF (an export that is not the same function is not written)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    vocab, length = loaded.config.vocab_size, min(CHECK_TOKENS, model.cfg.max_seq_len)
    ids_BS = torch.randint(3 if vocab > 3 else 0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    diff = float((model(ids_BS).logits_BSV.float() - loaded(input_ids=ids_BS).logits.float()).abs().max())
    if not diff <= MAX_LOGIT_DIFF:
        raise ConfigError(f"the exported model's logits differ from the checkpoint's by {diff:.2e} (allowed "
                          f"{MAX_LOGIT_DIFF:g}): the export is not the trained function, so nothing was written")
    return diff


def write_record(folder: Path, checkpoint: Path, step, model_cfg: ModelConfig, hf_model, tokenizer: str,
                 diff: float) -> None:
    record = {"kind": KIND, "checkpoint": str(checkpoint.absolute()), "step": step,
              "model_type": hf_model.config.model_type, "model_config": asdict(model_cfg), "tokenizer": tokenizer,
              "max_abs_logit_diff": diff, "exported_at": utc_now(),
              "files": sorted(p.name for p in folder.iterdir()) + [RECORD]}
    (folder / RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# The output folder: nothing is written over files export did not write


def check_export_dir(out: Path) -> list[str]:
    """Refuse an `--out` that is not new, empty, or an earlier export's; returns the files of an earlier export
    (to be replaced), else []."""
    if not str(out).strip():
        raise ConfigError("--out is empty: give the folder to write the Hugging Face model into")
    check_out_dir(out, flag="--out")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not names:
        return []
    listed = _earlier_files(out)
    foreign = [name for name in names if name not in listed]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(f"--out {out} is not empty and was not written by moe-rl export (it holds {shown}"
                          f"{'' if listed else f', and no {RECORD} of an export'}); nothing was changed: choose a "
                          "new or empty folder")
    return names


def _earlier_files(out: Path) -> set[str]:
    """The files an earlier export's export.json lists, or nothing when there is no readable one."""
    try:
        record = json.loads((out / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    if not isinstance(record, dict) or record.get("kind") != KIND or not isinstance(record.get("files"), list):
        return set()
    return {str(name) for name in record["files"]}


def put_in_place(staging: Path, out: Path, earlier: list[str]) -> None:
    """Move the written folder to `out`: an earlier export's files go first, then the folder is renamed over the
    empty one (one rename: a reader never sees half an export)."""
    for name in earlier:
        (out / name).unlink()
    if out.is_dir():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, out)
