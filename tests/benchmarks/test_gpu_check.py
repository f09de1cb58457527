"""benchmarks/gpu_check.py on CPU: without CUDA it prints one line, exits 0 and writes nothing; `--help` works; its
bookkeeping (FLOP count, time limits, the report from a result dict, the run loop) is right; and its parts run on CPU
at tiny sizes (the device is a parameter), so their calls into moe_rl are checked here. None of this measures a GPU."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, gpu_fsdp2, gpu_hf  # noqa: E402
from moe_rl.model.hf import FAMILIES as HF_FAMILIES  # noqa: E402

CPU = torch.device("cpu")
TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=99, n_experts=8, top_k=2, d_expert=16,
            max_seq_len=64)


def test_without_cuda_it_prints_one_line_exits_0_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert gpu_check.main(["--quick", "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out == (gpu_check.NO_CUDA + "\n") * 2
    assert list(tmp_path.iterdir()) == []


def test_help_documents_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "python -m benchmarks.gpu_check --quick" in out and "results/bench/gpu.md" in out
    assert "--fsdp2-worker" not in out.split("options:")[-1]  # an internal flag (part 4's ranks)


def test_expert_flops_counts_both_products_forward_and_backward():
    T, K, D, F = 16_384, 8, 1024, 512
    macs_forward = T * K * D * (2 * F) + T * K * F * D  # gate-up, then down, per token-slot
    assert gpu_check.expert_flops(T, K, D, F) == 2 * 3 * macs_forward  # backward: input and weight gradients
    assert gpu_check.expert_flops(T, K, D, F) == 18 * T * K * D * F


def test_time_limit_stops_a_part_and_run_part_reports_errors():
    with pytest.raises(gpu_check.PartTimeout):
        with gpu_check.time_limit(0.1):
            while True:
                time.sleep(0.01)
    late = gpu_check.run_part(lambda: time.sleep(5), budget=0.2)
    assert late["error"].startswith("PartTimeout") and not late["ok"] and late["part_seconds"] < 2
    failed = gpu_check.run_part(lambda: 1 / 0, budget=5)
    assert failed["error"] == "ZeroDivisionError: division by zero" and "traceback" in failed
    assert gpu_check.run_part(lambda: {"ok": True}, budget=5)["ok"]


def test_time_ms_interleaves_and_stops_at_the_deadline():
    calls = []
    times = gpu_check.time_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, CPU, warmup=1,
                              repeat=3, seconds=60)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"] and all(len(t) == 3 for t in times.values())
    assert len(gpu_check.time_ms({"slow": lambda: time.sleep(0.02)}, CPU, 0, 100, seconds=0.01)["slow"]) == 1
    assert gpu_check.summary_ms([3.0, 1.0, 2.0]) == {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "n": 3}


ENV = {"torch": "2.13.0+cu128", "cuda": "12.8", "python": "3.11.9", "host": "h", "utc": "2026-12-01 10:00 UTC",
       "gpu": "NVIDIA H200", "gpus": 1, "capability": "9.0", "memory_gib": 139.8, "cudnn": 91000, "nccl": "2.27.3",
       "git": "abc1234"}
SAME = {"logits_equal": True, "logits_max_diff": 0.0, "grads_equal": True, "grads_max_diff": 0.0}


def _fake_report() -> dict:
    train = {"shape": "d64 L8 E128 K8 F32", "tokens": "64x128", "median_ms": 12.345, "min_ms": 12.0, "max_ms": 13.0,
             "n": 10, "loss_first": 4.6, "loss_last": 4.1, "losses_finite": True, "params_changed": 66, "params": 66,
             "ok": True, "part_seconds": 3.2}
    replay = {"shape": "d64 L8 E128 K8 F32", "tokens": "16x64", "shifted_replay_logits_max_diff": 0.5, "ok": True,
              "default": {"kernels": "default", "replay": {**SAME, "grads_equal": False, "grads_max_diff": 1.5e-8},
                          "native_again": {**SAME, "grads_equal": False, "grads_max_diff": 2e-8}, "warnings": [],
                          "strict_error": None},
              "deterministic": {"kernels": "deterministic, warn only", "replay": SAME, "native_again": SAME,
                                "warnings": ["an op warned"], "strict_error": "index_copy has no deterministic"}}
    contenders = {"experts (bfloat16 weights)": {"median_ms": 4.0, "tflops": 309.2, "of_dense": 0.5},
                  "dense matmuls": {"median_ms": 2.0, "tflops": 618.5, "of_dense": 1.0}}
    experts = {"shape": "E128 K8 D1024 F512", "tokens": 16384, "flops": 1, "grouped_mm_calls_per_forward": 2,
               "contenders": contenders, "ok": True}
    fsdp2 = {"command": "python -m torch.distributed.run ...", "nproc": 1, "exit_status": 0, "timed_out": False,
             "run_seconds": 41.5, "metric_lines": 4, "losses": [0.01, 0.02], "losses_finite": True,
             "status": "finished", "checkpoint_parallel": "fsdp2", "checkpoint_world_size": 1, "output_tail": "ok\n",
             "ok": True}
    phases = ["sample", "old pass", "updates", "optimizer", "probes"]
    rl = {"shape": "d64 L48 E128 K8 F32", "batch": "16 prompts x 8 completions, 4 minibatches", "phases": phases,
          "seconds": {**dict.fromkeys(phases, 0.25), "step wall": 1.3}, "measured_steps": 3, "losses_finite": True,
          "ok": False}
    passes = {"replay_equal": True, "replay_max_diff": 0.0, "again_equal": False, "again_max_diff": 0.00049,
              "native_under_replay_is_recorded": True}
    hf = {"family": "qwen3_moe", "tokens": "4x32", "shifted_replay_logits_max_diff": 0.02, "ok": True,
          "default": passes, "deterministic": {**passes, "again_equal": True, "again_max_diff": 0.0, "warnings": []}}
    hf_train = {"command": "moe-rl train ...", "exit_status": 0, "status": "finished", "metric_lines": 4,
                "losses": [0.5, 0.25], "replay_churn_minibatch_0": [0.0, 0.0], "replay_churn_later": [0.125],
                "ok": True}
    return {"command": "python -m benchmarks.gpu_check", "environment": ENV, "parts": {
        "train": {"d64 L8 E128 K8 F32": train, "d256 L4 E16 K4 F256": {"error": "OutOfMemoryError: CUDA out of\n",
                                                                       "ok": False, "part_seconds": 1.0}},
        "replay": {"d64 L8 E128 K8 F32": replay}, "experts": {"E128 K8 D1024 F512": experts, "other": None},
        "fsdp2": {"1 process(es)": fsdp2}, "rl_step": {"L48": rl, "broken": {"ok": True, "surprise": 1}},
        "hf": {"qwen3_moe": hf}, "hf_train": {"qwen3_moe R2": hf_train}}}


def test_the_report_names_the_gpu_and_every_result_or_error():
    md = gpu_check.markdown(_fake_report())
    assert "GPU: NVIDIA H200 (x1, compute capability 9.0, 139.8 GiB); torch 2.13.0+cu128, CUDA 12.8" in md
    assert "| train | d64 L8 E128 K8 F32 | pass | 3.2 |" in md and "| train | d256 L4 E16 K4 F256 | ERROR | 1.0 |" in md
    assert "| d64 L8 E128 K8 F32 | 64x128 | 12.35 ms (min 12.00, n 10) | 4.6000 -> 4.1000 | 66 / 66 | pass |" in md
    assert "d256 L4 E16 K4 F256: **error** `OutOfMemoryError: CUDA out of`" in md
    assert "| default | equal (0) / differ (1.5e-08) | equal (0) / differ (2e-08) | none |" in md
    assert "| deterministic, warn only | equal (0) / equal (0) | equal (0) / equal (0) | an op warned |" in md
    assert "Strict deterministic mode failed, so warn-only ran: `index_copy has no deterministic`" in md
    assert "| E128 K8 D1024 F512 | 16,384 | experts (bfloat16 weights) | 4.000 | 309.2 | 50% | 2 |" in md
    assert "| E128 K8 D1024 F512 | 16,384 | dense matmuls | 2.000 | 618.5 | 100% |  |" in md
    assert "| experts | other | not run |  |" in md and "| other | not run |" in md
    assert "checkpoint saved by parallel=fsdp2, world size 1. Verdict: **pass**." in md
    assert "| 0.250 s | 0.250 s | 0.250 s | 0.250 s | 0.250 s | 1.250 s | 1.300 s |" in md
    assert "| rl_step | L48 | FAIL |  |" in md
    assert "broken: (formatting failed: KeyError: 'seconds') raw:" in md  # a formatter's bug shows the raw numbers
    assert ("| qwen3_moe | equal (0) | differ (0.00049) | equal (0) | equal (0) | True | 0.02 | none | pass |") in md
    assert ("losses [0.5000, 0.2500]; replay churn at minibatch 0 [0, 0], later [0.125]. Verdict: **pass**.") in md


def test_the_run_loop_writes_after_every_part_and_fails_when_a_part_does(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "environment", lambda device: ENV)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    seen = []

    def second():
        seen.append(json.loads((tmp_path / "gpu.json").read_text())["parts"])  # the first part is on disk already
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "plan", lambda sizes, device, parts: [
        ("train", "a", lambda: {"ok": True}, 5), ("replay", "b", second, 5)])
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert seen == [{"train": {"a": {"ok": True, "part_seconds": seen[0]["train"]["a"]["part_seconds"]}},
                     "replay": {"b": None}}]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["parts"]["replay"]["b"]["error"] == "RuntimeError: boom"
    assert "| replay | b | ERROR |" in (tmp_path / "gpu.md").read_text()
    monkeypatch.setattr(gpu_check, "plan", lambda sizes, device, parts: [("train", "a", lambda: {"ok": True}, 5)])
    assert gpu_check.main(["--out", str(tmp_path), "--quick", "--parts", "train"]) == 0
    assert json.loads((tmp_path / "gpu.json").read_text())["command"] == \
        "python -m benchmarks.gpu_check --quick --parts train"


def test_the_default_plan_fits_the_device_time_and_names_every_item():
    steps = gpu_check.plan(gpu_check.DEFAULT, CPU, list(gpu_check.PARTS))
    assert [(part, item) for part, item, _, _ in steps] == [
        ("train", "d64 L8 E128 K8 F32"), ("train", "d256 L4 E16 K4 F256"), ("replay", "d64 L8 E128 K8 F32"),
        ("experts", "E128 K8 D1024 F512"), ("experts", "E128 K8 D2048 F768 (Qwen3-30B-A3B)"),
        ("fsdp2", "2 process(es)"), ("rl_step", "L48"), *(("hf", family) for family in HF_FAMILIES),
        ("hf_train", "qwen3_moe R2")]
    assert sum(budget for *_, budget in steps) <= 10 * 60  # one device call has 10 minutes at most
    quick = gpu_check.plan(gpu_check.QUICK, CPU, ["replay", "rl_step"])
    assert [(part, item) for part, item, _, _ in quick] == [("replay", "d64 L8 E128 K8 F32"), ("rl_step", "L8")]


# --- the parts themselves, on CPU at tiny sizes (fp32, no autocast: a check of the calls, not of a GPU) -----------


def test_training_steps_on_cpu_change_every_parameter():
    r = gpu_check.train_steps("tiny", TINY, batch=2, seq_len=8, steps=2, warmup=1, device=CPU, seconds=30)
    assert r["ok"] and r["params_changed"] == r["params"] > 0 and r["n"] == 2 and math.isfinite(r["loss_last"])


def test_replay_is_exact_on_cpu_and_a_shifted_replay_is_not():
    r = gpu_check.replay_exactness("tiny", TINY, batch=2, seq_len=8, device=CPU)
    assert r["ok"] and r["deterministic"]["replay"] == SAME and r["default"]["native_again"] == SAME
    assert r["deterministic"]["kernels"] == "deterministic, strict, SDPA flash or math"
    assert r["deterministic"]["strict_error"] is None
    assert r["shifted_replay_logits_max_diff"] > 0


def test_expert_throughput_on_cpu_counts_flops_for_every_contender():
    r = gpu_check.expert_throughput("tiny", 8, 2, 32, 16, tokens=64, repeat=2, device=CPU, seconds=30)
    assert r["flops"] == gpu_check.expert_flops(64, 2, 32, 16)
    assert set(r["contenders"]) == {"experts (float32 weights)", "experts (fp32 weights, autocast)", "dense matmuls"}
    assert r["contenders"]["dense matmuls"]["of_dense"] == 1.0
    assert all(c["tflops"] > 0 and c["n"] == 2 for c in r["contenders"].values())


@pytest.mark.slow
def test_rl_step_phases_on_cpu_restore_the_trainers_clock():
    import moe_rl.rl.trainer

    clock = moe_rl.rl.trainer.time
    r = gpu_check.rl_step_phases(n_layers=2, steps=1, device=CPU, seconds=60)
    assert moe_rl.rl.trainer.time is clock
    assert r["ok"] and r["measured_steps"] == 1 and set(r["seconds"]) == {*r["phases"], "step wall"}


@pytest.mark.slow
def test_fsdp2_step_on_cpu_shards_even_a_world_of_one():
    r = gpu_fsdp2.fsdp2_step("cpu", nproc=1, steps=1, timeout_s=150)
    assert r["ok"], r["output_tail"]
    assert r["exit_status"] == 0 and r["checkpoint_parallel"] == "fsdp2" and r["checkpoint_world_size"] == 1
    assert r["metric_lines"] == 2 and r["status"] == "finished"


def test_replay_falls_back_to_warn_only_when_strict_determinism_refuses(monkeypatch):
    real = gpu_check.routed_pass

    def refuse_strict(*args, **kwargs):
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError("some_op does not have a deterministic implementation\nmore")
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_check, "routed_pass", refuse_strict)
    r = gpu_check.replay_exactness("tiny", TINY, batch=2, seq_len=8, device=CPU)
    assert r["deterministic"]["kernels"] == "deterministic, warn only, SDPA flash or math" and r["ok"]
    assert r["deterministic"]["strict_error"] == "some_op does not have a deterministic implementation"
    assert not torch.are_deterministic_algorithms_enabled()


def test_stop_run_ends_a_launcher_and_the_children_it_started_in_their_own_sessions(tmp_path):
    launcher = tmp_path / "launcher.py"  # like torchrun: a child in a session of its own, SIGTERM passed on to it
    launcher.write_text("import signal, subprocess, sys, time\n"
                        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                        "start_new_session=True)\n"
                        "signal.signal(signal.SIGTERM, lambda *a: (child.terminate(), sys.exit(1)))\n"
                        "print(child.pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert gpu_fsdp2.child_pids(proc.pid) == [child]
    t0 = time.perf_counter()
    gpu_fsdp2.stop_run(proc, grace_s=10)
    assert proc.returncode is not None and time.perf_counter() - t0 < 5
    for _ in range(50):  # the child is reaped by init once gone
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1][:3]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the launcher's child outlived stop_run")


def test_the_expert_split_without_cuda_prints_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from benchmarks import gpu_experts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_experts.main(["--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out == gpu_check.NO_CUDA + "\n"
    assert list(tmp_path.iterdir()) == []


def test_the_expert_split_contenders_run_forward_and_backward_on_cpu():
    # on CPU only the bookkeeping is checked: each contender runs and leaves a gradient on an input it reads
    from benchmarks import gpu_experts

    fns = gpu_experts.contenders(n_experts=8, top_k=2, d_model=32, d_expert=16, tokens=64, device=CPU)
    assert list(fns) == ["Experts module", "grouped products + SwiGLU", "grouped products alone", "dense matmuls"]
    for name, fn in fns.items():
        inputs = [cell.cell_contents for cell in (fn.__closure__ or ()) if isinstance(cell.cell_contents, torch.Tensor)
                  and cell.cell_contents.requires_grad]
        fn()
        assert inputs and all(t.grad is not None and t.grad.abs().sum() > 0 for t in inputs), name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_hf_replay_part_on_cpu_is_exact_and_a_shifted_replay_is_not(family):
    r = gpu_hf.hf_replay(family, CPU)
    assert r["ok"], r
    for kernels in ("default", "deterministic"):
        assert r[kernels]["replay_equal"] and r[kernels]["again_equal"] and r[kernels]["replay_max_diff"] == 0.0
        assert r[kernels]["native_under_replay_is_recorded"]
    assert r["shifted_replay_logits_max_diff"] > 0


@pytest.mark.slow
def test_the_hf_train_part_on_cpu_finishes_with_replay_churn_0_at_minibatch_0():
    r = gpu_hf.hf_train(CPU)
    assert r["ok"] and r["exit_status"] == 0 and r["status"] == "finished" and len(r["losses"]) == 4
    assert r["replay_churn_minibatch_0"] == [0.0, 0.0]  # on CPU the replayed old pass is the routers' own choice
    assert "--device cpu" in r["command"] and "$TMP/run" in r["command"]
