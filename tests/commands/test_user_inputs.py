"""Nothing lost, round three (issue 50, the inputs half): task files, CLI values, model folders, engine traces, the
kernel cache, pipes and full disks, each tried the way a user would misuse them, through the real `moe-rl` command
(in this process through `moe_rl.cli.main`, or as a process where pipes are the point) or the real function.

Every refusal is one line on stderr naming the field or file and what is allowed, exit status 2, nothing written.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli, refused

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "4", "--quiet", "--total-steps", "1"]
SFT = ["sft", *TINY, "--batch-size", "8", "--log.eval-prompts", "4", "--sampling.max-new-tokens", "6",
       "--total-steps", "1", "--quiet"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "PYTHONWARNINGS": "ignore::SyntaxWarning"}


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


PROBLEMS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(12)]


# --- item 6 and item 12: task files ------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["path", "eval-path"])
def test_a_task_path_without_the_file_source_is_refused_not_ignored(tmp_path, field):
    data = jsonl(tmp_path / "f.jsonl", PROBLEMS)
    refused(cli(*TRAIN, "--out-dir", tmp_path / "run", f"--task.{field}", data),
            f"task.{field.replace('-', '_')}=", "task.source='reasoning_gym'", "--task.source file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.jsonl"]


@pytest.mark.parametrize("text", [json.dumps(PROBLEMS, indent=2), json.dumps(PROBLEMS) + "\n",
                                  json.dumps(PROBLEMS[0], indent=2)])
def test_a_json_array_or_pretty_printed_task_file_says_json_means_json_lines(tmp_path, text):
    (tmp_path / "f.json").write_text(text)
    refused(cli(*TRAIN, "--out-dir", tmp_path / "run", "--task.source", "file", "--task.path", tmp_path / "f.json"),
            f"{tmp_path / 'f.json'}, line 1", "JSON Lines, one JSON object per line")
    assert not (tmp_path / "run").exists()


def test_eval_path_equal_to_path_is_refused(tmp_path, monkeypatch):
    """Refused, not warned: every eval problem would be a training problem, so every held-out number of the run
    would be a training number, and a warning scrolls away while the run's tables still say "eval"."""
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "f.jsonl", PROBLEMS)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "f.jsonl")
    for spelling in ("./f.jsonl", tmp_path / "link.jsonl"):
        refused(cli(*TRAIN, "--out-dir", "run", "--task.source", "file", "--task.path", "f.jsonl",
                    "--task.eval-path", spelling), "task.eval_path=", "is the same file as task.path")
    assert not (tmp_path / "run").exists()


# --- item 8: a closed stdout does not fail the run -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_reader_that_closes_the_pipe_early_does_not_fail_the_run(tmp_path, command):
    """`moe-rl train ... | head -1`: a real pipe, closed after the first line; the run finishes, exit 0."""
    run = tmp_path / "run"
    argv = [*TRAIN[:-3], "--total-steps", "4"] if command == "train" else [*SFT[:-3], "--total-steps", "4",
                                                                             "--log.print-every", "1"]
    child = subprocess.Popen([sys.executable, "-m", "moe_rl.cli", *argv, "--out-dir", str(run)], cwd=tmp_path,
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = child.stdout.readline()
    child.stdout.close()  # what `head -1` does
    err = child.stderr.read()
    assert child.wait(timeout=300) == 0, err
    assert first.startswith("step 1/4") and "Traceback" not in err and "BrokenPipe" not in err, err
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"


def test_a_run_whose_manifest_says_failed_exits_non_zero(tmp_path):
    from moe_rl.cli import _exit_status

    (tmp_path / "manifest.json").write_text(json.dumps({"status": "failed", "reason": "BrokenPipeError"}))
    assert _exit_status(tmp_path) == 1
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "finished"}))
    assert _exit_status(tmp_path) == 0


# --- item 9: a full disk during a checkpoint save -------------------------------------------------------------------


class _FullDisk(io.FileIO):
    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_saving_a_checkpoint_is_named_and_latest_stays(tmp_path, monkeypatch):
    """The write of the second latest.pt fails with ENOSPC inside torch.save (which turns it into a RuntimeError
    about inline_container.cc): one line naming the file, the manifest says the same, latest.pt still holds step 1,
    no temp file is left, and --resume continues once there is space."""
    import moe_rl.runs.atomic as atomic

    real, saves = atomic.open_temp, []

    def full_at_second_checkpoint(fd, path):
        if Path(path).name == "latest.pt":
            saves.append(path)
            if len(saves) == 2:
                return _FullDisk(fd, "wb")
        return real(fd, path)

    run = tmp_path / "run"
    monkeypatch.setattr(atomic, "open_temp", full_at_second_checkpoint)
    argv = [*TRAIN[:-2], "--total-steps", "3", "--checkpoint-every", "1", "--out-dir", run]
    line = refused(cli(*argv), f"no space left on device while saving {run / 'checkpoints' / 'latest.pt'}", "--resume")
    assert "inline_container" not in line
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "no space left on device while saving" in manifest["reason"]
    assert "inline_container" not in manifest["reason"]
    assert torch.load(run / "checkpoints" / "latest.pt", weights_only=True)["step"] == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.pt"]
    monkeypatch.setattr(atomic, "open_temp", real)
    code, _, err = cli(*argv, "--resume")
    assert code == 0, err


# --- item 10: a corrupt cached kernel library -----------------------------------------------------------------------


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """An empty kernel cache folder and a fake compiler that 'builds' by copying this machine's compiled library, so
    the rebuild path runs without a real compile; native.library() is computed afresh inside the test and after it."""
    from moe_rl.kernels import native

    if native.library() is None:
        pytest.skip("no C kernels on this machine")
    good = native.build(native.ISA_CAPS[native.isa_cap()])
    compiler = tmp_path / "fake-cc"
    compiler.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp "{good}" "$2"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(compiler))
    native.library.cache_clear()
    cached = native.cache_folder() / good.name
    cached.parent.mkdir(parents=True)
    yield cached, good
    native.library.cache_clear()


@pytest.mark.parametrize("damage", [b"", b"\x7fELF" + os.urandom(200), b"not a library\n"])
def test_a_corrupt_cached_kernel_library_is_rebuilt_once(kernel_cache, capsys, damage):
    from moe_rl.kernels import native

    cached, good = kernel_cache
    cached.write_bytes(damage)
    assert native.library() is not None and native.why_none() == ""
    assert cached.read_bytes() == good.read_bytes()
    assert capsys.readouterr().err == ""


def test_a_failed_rebuild_of_a_corrupt_kernel_library_is_said(kernel_cache, capsys, monkeypatch):
    from moe_rl.kernels import native

    cached, _ = kernel_cache
    cached.write_bytes(b"")
    monkeypatch.setenv("CC", "false")
    assert native.library() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the cached kernel library {cached} does not load" in err
    assert "building it again failed (false exited with status 1)" in err and "torch code runs instead" in err
    assert "does not load" in native.why_none() and "no C kernels built" not in native.why_none()


# --- item 11: a model vocabulary the task tokenizer does not cover ------------------------------------------------


@pytest.fixture(scope="module")
def hf_without_tokenizer(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint directory with a 128-token vocabulary and no tokenizer files."""
    pytest.importorskip("transformers")
    from moe_rl.model import ModelConfig
    from moe_rl.model.hf import build_hf_model

    path = tmp_path_factory.mktemp("hf") / "qwen"
    model = build_hf_model(ModelConfig(backend="hf", hf_config="qwen3_moe", d_model=32, n_layers=2, n_heads=4,
                                       n_kv_heads=2, n_experts=4, top_k=2, d_expert=32, d_dense=64, vocab_size=128))
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
        model.hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("command", ["train", "sft"])
def test_an_hf_folder_without_tokenizer_whose_vocabulary_differs_is_refused_at_set_up(hf_without_tokenizer,
                                                                                       tmp_path, command):
    argv = ["train", "--rollout.prompts-per-step", "2", "--rollout.group-size", "2", "--minibatches", "1",
            "--total-steps", "1"] if command == "train" else ["sft", "--total-steps", "1", "--batch-size", "2"]
    refused(cli(*argv, "--model.backend", "hf", "--model.hf-path", hf_without_tokenizer, "--out-dir",
                tmp_path / "run", "--quiet"),
            f"hf_path={hf_without_tokenizer}: the directory has no tokenizer files", "(99 ids)", "vocab_size is 128")
    assert not (tmp_path / "run").exists()


def test_a_native_vocabulary_larger_than_the_tokenizer_is_refused(tmp_path):
    """It used to crash in the first rollout: `token id 123 is outside the vocabulary [0, 99)`."""
    refused(cli(*TRAIN, "--out-dir", tmp_path / "run", "--model.vocab-size", "128"),
            "model.vocab_size=128 is larger than the tokenizer's vocabulary (99 tokens)", "--model.vocab-size 99")
    assert not (tmp_path / "run").exists()


# --- item 12: engine traces -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".parquet"])
def test_a_trace_with_two_requests_of_one_id_is_refused(tmp_path, suffix):
    from moe_rl.routing.engine_traces import EngineRequest, write_engine_trace

    ids_RLK = np.zeros((4, 2, 2), np.int16)
    ids_RLK[..., 1] = 1
    requests = [EngineRequest(rid, [5, 6, 7], [8, 9], ids_RLK) for rid in ("a", "b", "a")]
    trace = write_engine_trace(tmp_path / f"trace{suffix}", requests)
    refused(cli("probe", *TINY, "--trace", trace, "--out", tmp_path / "p"),
            f"{trace}: request_id 'a' appears twice (entries 0 and 2)")
    assert not (tmp_path / "p").exists()


# --- further cases nobody listed ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, named", [
    ("sidecar not JSON", "t.json: the sidecar of t.npy cannot be read as JSON"),
    ("sidecar a list", "t.json: expected a JSON object with request_id"),
    ("object array", "t.npy cannot be read as a .npy integer array (Object arrays cannot be loaded"),
    ("cut short", "t.npy cannot be read as a .npy integer array (EOF"),
    ("ids as text", "t.npy: entry 0: prompt_token_ids must be a list of integer token ids"),
])
def test_a_broken_npy_trace_or_sidecar_is_one_line(tmp_path, case, named):
    ids_RLK = np.zeros((4, 2, 2), np.int16)
    ids_RLK[..., 1] = 1
    sidecar = {"request_id": "a", "prompt_token_ids": [5, 6, 7], "output_token_ids": [8, 9]}
    np.save(tmp_path / "t.npy", ids_RLK)
    if case == "sidecar not JSON":
        (tmp_path / "t.json").write_text("{request_id: a")
    elif case == "sidecar a list":
        (tmp_path / "t.json").write_text("[5, 6, 7]")
    else:
        (tmp_path / "t.json").write_text(json.dumps({**sidecar, "prompt_token_ids": "5 6 7"} if case == "ids as text"
                                                    else sidecar))
    if case == "object array":
        np.save(tmp_path / "t.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif case == "cut short":
        (tmp_path / "t.npy").write_bytes((tmp_path / "t.npy").read_bytes()[:90])
    refused(cli("probe", *TINY, "--trace", tmp_path / "t.npy", "--out", tmp_path / "p"), named)
    assert not (tmp_path / "p").exists()


def test_a_long_prompt_deep_in_a_task_file_is_refused_at_set_up(tmp_path):
    """check_task_fits looked at the first 64 problems only: a file's long prompt further down crashed the run when
    the sampler reached it. Every row of a file is checked now."""
    rows = [*PROBLEMS * 100, {"prompt": "1+" * 40 + "1=", "answer": "41"}]
    data = jsonl(tmp_path / "f.jsonl", rows)
    refused(cli(*TRAIN, "--out-dir", tmp_path / "run", "--task.source", "file", "--task.path", data,
                "--task.eval-fraction", "0.01", "--model.max-seq-len", "48"),
            "model.max_seq_len=48 is too short", "takes 83 tokens")
    assert not (tmp_path / "run").exists()


class _FillsUp(io.StringIO):
    """metrics.jsonl on a disk that fills up after `room` lines: the flush of the next one fails with ENOSPC, and so
    does the flush at close (as a real file's would), since the line is still in the buffer."""

    def __init__(self, path, room: int):
        super().__init__()
        self.file, self.room, self.written = open(path, "a", encoding="utf-8"), room, 0

    def flush(self):
        if self.written + self.getvalue().count("\n") > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += self.getvalue().count("\n")
        self.file.write(self.getvalue())
        self.file.flush()
        self.seek(0)
        self.truncate()

    def fileno(self):
        return self.file.fileno()

    def close(self):
        try:
            self.flush()
        finally:
            self.file.close()


def test_a_full_disk_while_appending_metrics_names_the_file(tmp_path, monkeypatch):
    """It was 'No space left on device' without the file; the buffered rest must not fail again at close."""
    import moe_rl.runs.jsonlog as jsonlog

    run = tmp_path / "run"
    monkeypatch.setattr(jsonlog, "open", lambda path, *a, **k: _FillsUp(path, room=2), raising=False)
    refused(cli(*TRAIN[:-2], "--total-steps", "3", "--out-dir", run),
            f"no space left on device while saving {run / 'metrics.jsonl'}")
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"


def test_a_bad_moe_rl_isa_is_one_line_before_the_run_directory_is_made(tmp_path, monkeypatch):
    """It was a ValueError traceback from inside the manifest's writer, after the run directory was claimed."""
    monkeypatch.setenv("MOE_RL_ISA", "sse9")
    refused(cli(*TRAIN, "--out-dir", tmp_path / "run"), "MOE_RL_ISA='sse9': must be one of avx512, avx2, baseline")
    assert not (tmp_path / "run").exists()


def test_probe_into_a_closed_pipe_writes_its_table_and_exits_0(tmp_path):
    """`moe-rl probe ... | head -0`: the reader is gone before the table is printed; probe.json is written first, so
    the command succeeded (it used to exit 0 by luck; a closed pipe in the middle of a run now exits 1)."""
    from moe_rl.routing.engine_traces import EngineRequest, write_engine_trace

    ids_RLK = np.zeros((4, 2, 2), np.int16)
    ids_RLK[..., 1] = 1
    trace = write_engine_trace(tmp_path / "t.pt", [EngineRequest("a", [5, 6, 7], [8, 9], ids_RLK)])
    child = subprocess.Popen([sys.executable, "-m", "moe_rl.cli", "probe", *TINY, "--trace", str(trace), "--out",
                              str(tmp_path / "p")], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    child.stdout.close()
    err = child.stderr.read()
    assert child.wait(timeout=300) == 0 and err == "", err
    assert json.loads((tmp_path / "p" / "probe.json").read_text())["rows"]
