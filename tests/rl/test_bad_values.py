"""Nothing silent, round two: numbers that reject NaN and Inf, choices typed as choices, and the inputs that used to
print a traceback, through `moe_rl.cli.main` in this process (the real command's path, without a process start).

Every case asserts the exit status, that the culprit is named, that no traceback is printed and that nothing was
written (no run directory appears, an existing one keeps its bytes).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
from conftest import cli, refused

from moe_rl.cli import main
from moe_rl.errors import ConfigError, check_finite_fields
from moe_rl.rl.run_config import SFTConfig, TrainConfig

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]


def run_cli(capsys, argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr on one line) of `moe-rl argv`, as the entry point gives them (tyro exits with 2)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    if err.count("\n") == 1:  # the one line every refusal should be: as printed
        return code, out, err
    return code, out, " ".join(err.replace("│", " ").split())  # else joined, to name what it says


# --- finite checks on every float field, in one place ---------------------------------------------------------------


@pytest.mark.parametrize("command, flag, value, named", [
    ("train", "--optim.grad-clip", "nan", "grad_clip=nan must be a finite number"),
    ("train", "--kl-coef", "nan", "kl_coef=nan must be a finite number"),
    ("train", "--optim.lr", "nan", "lr=nan must be a finite number"),
    ("train", "--optim.lr", "inf", "lr=inf must be a finite number"),
    ("train", "--rollout.sampling.temperature", "nan", "temperature=nan must be a finite number"),
    ("train", "--rollout.sampling.top-p", "nan", "top_p=nan"),
    ("train", "--model.rope-theta", "0", "rope_theta=0.0 must be > 0"),
    ("train", "--model.rope-theta", "nan", "rope_theta=nan must be a finite number"),
    ("train", "--objective.clip-high", "inf", "clip_high=inf must be a finite number"),
    ("train", "--task.eval-fraction", "nan", "eval_fraction=nan"),
    ("sft", "--optim.lr", "nan", "lr=nan must be a finite number"),
    ("sft", "--optim.grad-clip", "-inf", "grad_clip=-inf must be a finite number"),
    ("probe", "--optim.lr", "nan", "lr=nan must be a finite number"),
    ("probe", "--low-margin-quantile", "nan", "low_margin_quantile=nan must be a finite number"),
])
def test_nan_and_inf_are_refused_naming_the_field_before_anything_is_written(capsys, tmp_path, command, flag, value,
                                                                              named):
    out = ["--out", tmp_path / "run"] if command == "probe" else ["--out-dir", tmp_path / "run"]
    code, stdout, stderr = run_cli(capsys, [command, *out, flag, value])
    assert code == 2 and named in stderr and "Traceback" not in stderr + stdout, stderr
    assert stderr.count("\n") == 1 and stderr.startswith(f"moe-rl {command}: error: "), stderr  # one line, no box
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_flag_is_one_line_with_the_flag_it_resembles(capsys, tmp_path):
    code, _, stderr = run_cli(capsys, ["train", "--out-dir", tmp_path / "run", "--optim.lrr", "3"])
    assert code == 2 and stderr == ("moe-rl train: error: Unrecognized options: --optim.lrr, 3 (did you mean "
                                    "--optim.lr?); see moe-rl train --help\n")
    assert list(tmp_path.iterdir()) == []


def test_every_float_field_of_every_command_is_checked():
    """The walk reaches each float field of the nested configs (a new field is covered without a new line)."""
    from moe_rl.commands.probe import ProbeCommandConfig

    for config in (TrainConfig(), SFTConfig(), ProbeCommandConfig()):
        paths = float_paths(config)
        assert paths, type(config).__name__
        for path in paths:
            with pytest.raises(ConfigError, match=f"{path.rsplit('.', 1)[-1]}=nan must be a finite number"):
                check_finite_fields(with_value(config, path, math.nan))


def float_paths(config, prefix: str = "") -> list[str]:
    paths = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            paths += float_paths(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) or (isinstance(value, tuple) and value and isinstance(value[0], float)):
            paths.append(f"{prefix}{f.name}")
    return paths


def with_value(config, path: str, value):
    """A copy of `config` with one field set, bypassing validation (object.__setattr__ on copies)."""
    head, _, rest = path.partition(".")
    changed, current = copy.copy(config), getattr(config, head)
    if rest:
        new = with_value(current, rest, value)
    else:
        new = (value,) if isinstance(current, tuple) else value
    object.__setattr__(changed, head, new)
    return changed


@pytest.mark.parametrize("flag, value", [("--device", "tpu"), ("--routing-mode", "R4"), ("--tokens", "some"),
                                         ("--parallel", "zero3")])
def test_probe_choice_fields_are_choices(capsys, tmp_path, flag, value):
    code, stdout, stderr = run_cli(capsys, ["probe", "--out", tmp_path / "p", flag, value])
    assert code == 2 and f"invalid choice '{value}'" in stderr and flag in stderr and "Traceback" not in stderr
    assert stderr.count("\n") == 1, stderr
    assert list(tmp_path.iterdir()) == []


# --- inputs that used to print a traceback ---------------------------------------------------------------------------

TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "4", "--quiet"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("bad") / "run"
    code, _, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "2", "--checkpoint-every", "1")
    assert code == 0, err
    return run


@pytest.mark.parametrize("text, named", [
    ("rollout: 5\n", "'rollout' is a group of fields (RolloutConfig): it needs a mapping"),
    ("rollout: null\n", "'rollout' is a group of fields"),
    ("optim: [1, 2]\n", "'optim' is a group of fields (OptimConfig)"),
    ("rollout:\n  sampling: 3\n", "'sampling' is a group of fields (SamplingConfig)"),
])
def test_a_config_section_that_is_not_a_mapping_is_named(tmp_path, text, named):
    (tmp_path / "c.yaml").write_text(text)
    refused(cli(*TRAIN, "--config-file", tmp_path / "c.yaml", "--out-dir", tmp_path / "run"), "c.yaml", named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize("text", ['{"experiment": "smo', "[]\n", "{}\n"])
def test_a_truncated_sweep_json_is_named_and_kept(tmp_path, text):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(text)
    refused(cli("sweep", "smoke", "--sweep-dir", sweep, "--dry-run"), f"{sweep / 'sweep.json'}")
    assert (sweep / "sweep.json").read_text() == text and [p.name for p in sweep.iterdir()] == ["sweep.json"]


@pytest.mark.parametrize("argv", [[*TRAIN, "--out-dir"], ["sft", *TINY, "--out-dir"],
                                  ["sweep", "smoke", "--dry-run", "--sweep-dir"]])
def test_a_300_character_directory_name_is_one_line(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    refused(cli(*argv, "x" * 300), "is 300 bytes long; the file system allows 255")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_cannot_be_written_mid_run_is_one_line_and_resumes(tmp_path, monkeypatch):
    import moe_rl.rl.trainer

    saved = moe_rl.rl.trainer.save_checkpoint

    def unwritable_at_step_2(run_dir, step, state, keep_every=None):
        if step == 2:
            raise PermissionError(13, "Permission denied", str(run_dir / "checkpoints" / "latest.pt"))
        return saved(run_dir, step, state, keep_every)

    run = tmp_path / "run"
    monkeypatch.setattr(moe_rl.rl.trainer, "save_checkpoint", unwritable_at_step_2)
    refused(cli(*TRAIN, "--out-dir", run, "--total-steps", "3", "--checkpoint-every", "1"),
                    f"{run / 'checkpoints' / 'latest.pt'}: Permission denied", "--resume")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "PermissionError" in manifest["reason"]
    assert manifest["checkpoints"]["latest.pt"]["step"] == 1
    monkeypatch.setattr(moe_rl.rl.trainer, "save_checkpoint", saved)
    code, _, err = cli(*TRAIN, "--out-dir", run, "--total-steps", "3", "--checkpoint-every", "1", "--resume")
    assert code == 0, err
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"


def test_a_kv_cache_larger_than_memory_is_refused_with_a_sizing_hint(tmp_path):
    line = refused(cli(*TRAIN, "--out-dir", tmp_path / "run", "--model.max-seq-len", "200000000",
                               "--rollout.sampling.max-new-tokens", "100000000"),
                           "rollout.sampling.max_new_tokens=100000000: the sampler's KV cache needs about",
                           "--rollout.sampling.max-new-tokens")
    assert "GiB" in line and list(tmp_path.iterdir()) == []


def test_report_on_a_truncated_routing_table_names_it(finished_run, tmp_path):
    import shutil

    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    table = sorted((run / "routing").glob("*.parquet"))[0]
    table.write_bytes(table.read_bytes()[:100])
    refused(cli("report", run, "--out", tmp_path / "report"), f"{table} cannot be read as Parquet")


@pytest.mark.parametrize("path", ["fifo", "/dev/zero"])
def test_a_fifo_or_device_as_task_path_is_named_as_such(tmp_path, path):
    import os

    if path == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    refused(cli(*TRAIN, "--out-dir", tmp_path / "run", "--task.source", "file", "--task.path", path),
                    f"{path} is not a regular file (a FIFO, a device or a socket)")
    assert not (tmp_path / "run").exists()


def test_probe_updates_that_do_not_divide_the_batch_blame_updates(tmp_path):
    line = refused(cli("probe", "--updates", "3", "--out", tmp_path / "p"), "updates=3 must divide")
    assert "minibatches" not in line and list(tmp_path.iterdir()) == []


def test_a_unicode_run_directory_prints_under_an_ascii_terminal(finished_run, tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    run = Path(shutil.copytree(finished_run, tmp_path / "résumé-运行"))
    env = {**os.environ, "LC_ALL": "C", "PYTHONIOENCODING": "ascii", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "moe_rl.cli", *TRAIN, "--out-dir", str(run), "--total-steps", "2",
                           "--resume"], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert b"nothing to do: " in done.stdout and b"r\\xe9sum\\xe9" in done.stdout


# --- engine traces and Hugging Face checkpoints ----------------------------------------------------------------------


def test_probe_trace_refuses_an_empty_parquet_and_a_text_file_named_pt(tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "text.pt").write_text("not a trace\n")
    refused(cli("probe", "--trace", tmp_path / "empty.parquet", "--out", tmp_path / "p"),
                    "empty.parquet cannot be read as Parquet")
    refused(cli("probe", "--trace", tmp_path / "text.pt", "--out", tmp_path / "p"),
                    "text.pt is not a torch file")
    assert not (tmp_path / "p").exists()


def test_pt_traces_with_numpy_values_load_as_the_docs_say(tmp_path):
    import numpy as np
    import torch

    from moe_rl.errors import DataError
    from moe_rl.routing.engine_traces import EngineRequest, read_engine_trace, write_engine_trace

    ids_RLK = np.arange(2 * 1 * 2, dtype=np.int16).reshape(2, 1, 2)
    own = EngineRequest(np.str_("a"), [np.int64(5), np.int64(6)], [np.int64(7)], ids_RLK)  # numpy scalars
    read = read_engine_trace(write_engine_trace(tmp_path / "own.pt", [own]))
    assert (read[0].request_id, read[0].prompt_token_ids, read[0].output_token_ids) == ("a", [5, 6], [7])
    torch.save([{"request_id": "b", "prompt_token_ids": np.array([5, 6]), "output_token_ids": np.array([7]),
                 "routed_experts": ids_RLK}], tmp_path / "arrays.pt")
    read = read_engine_trace(tmp_path / "arrays.pt")
    assert read[0].prompt_token_ids == [5, 6] and (read[0].routed_experts_RLK == ids_RLK).all()
    import pandas as pd

    pd.DataFrame({c: [] for c in ("request_id", "prompt_token_ids", "output_token_ids", "routed_experts",
                                  "routed_experts_shape")}).to_parquet(tmp_path / "none.parquet")
    with pytest.raises(DataError, match="holds no requests"):
        read_engine_trace(tmp_path / "none.parquet")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint directory with a 128-token vocabulary (more than the default 99)."""
    pytest.importorskip("transformers")
    from moe_rl.model import ModelConfig
    from moe_rl.model.hf import build_hf_model

    path = tmp_path_factory.mktemp("hf") / "qwen"
    model = build_hf_model(ModelConfig(backend="hf", hf_config="qwen3_moe", d_model=32, n_layers=2, n_heads=4,
                                       n_kv_heads=2, n_experts=4, top_k=2, d_expert=32, d_dense=64, vocab_size=128))
    model.hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("damage, named", [
    ("config", "config.json cannot be read"),
    ("no weights", "the weights cannot be loaded (OSError"),
    ("truncated", "the weights cannot be loaded (SafetensorError"),
])
def test_a_broken_hf_checkpoint_is_one_line(hf_checkpoint, tmp_path, damage, named):
    import shutil

    broken = Path(shutil.copytree(hf_checkpoint, tmp_path / "broken"))
    weights = broken / "model.safetensors"
    # the character tokenizer's 99 ids: without tokenizer files a vocabulary of 128 is refused before the weights load
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "vocab_size": 99}))
    if damage == "config":
        (broken / "config.json").write_text((broken / "config.json").read_text()[:40])
    elif damage == "no weights":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:3000])
    refused(cli("train", "--model.backend", "hf", "--model.hf-path", broken, "--out-dir", tmp_path / "run",
                        "--rollout.prompts-per-step", "2", "--rollout.group-size", "2", "--minibatches", "1",
                        "--total-steps", "1"), f"hf_path={broken}", named)
    assert not (tmp_path / "run").exists()


def test_probe_trace_checks_token_ids_against_the_checkpoints_vocabulary(hf_checkpoint, tmp_path):
    import numpy as np

    from moe_rl.routing.engine_traces import EngineRequest, write_engine_trace

    tokens = list(range(1, 123))  # ids above the default vocabulary of 99, inside the checkpoint's 128
    ids_RLK = np.tile(np.array([[0, 1], [2, 3]], np.int16), (len(tokens) - 1, 1, 1))
    write_engine_trace(tmp_path / "trace.pt", [EngineRequest("r", tokens[:100], tokens[100:], ids_RLK)])
    code, out, err = cli("probe", "--model.backend", "hf", "--model.hf-path", hf_checkpoint, "--trace",
                         tmp_path / "trace.pt", "--out", tmp_path / "p")
    assert code == 0, err
    rows = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert rows and "set_change" in out


@pytest.mark.slow  # the report's figures take seconds; the first-hour walk-through checks this default too
def test_report_writes_next_to_the_runs_by_default_never_into_results(finished_run, tmp_path, monkeypatch):
    import shutil

    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("report", "run")
    assert code == 0, err
    assert (run / "report" / "README.md").is_file() and not (tmp_path / "results").exists()
    assert "run/report/README.md" in out
