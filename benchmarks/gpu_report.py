"""The GPU check's report: the machine it ran on (`environment`) and results/bench/gpu.md and gpu.json from the
parts' results (`markdown`, `write_report`). Split from benchmarks/gpu_check.py, which runs the parts."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "host": platform.node(), "utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    with contextlib.suppress(Exception):
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    if device.type != "cuda":
        return env
    try:
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   cudnn=torch.backends.cudnn.version())
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:  # noqa: BLE001 -- a device that cannot even describe itself: the parts will say more
        env["gpu_error"] = f"{type(exc).__name__}: {exc}"
    return env


def verdict(result: dict | None) -> str:
    if result is None:
        return "not run"
    if "error" in result:
        return "ERROR"
    return "pass" if result.get("ok") else "FAIL"


def _md_train(r: dict) -> list[str]:
    return [f"| {r['shape']} | {r['tokens']} | {r['median_ms']:.2f} ms (min {r['min_ms']:.2f}, n {r['n']}) "
            f"| {r['loss_first']:.4f} -> {r['loss_last']:.4f} | {r['params_changed']} / {r['params']} "
            f"| {verdict(r)} |"]


def _md_replay(r: dict) -> list[str]:
    cell = lambda c: (f"{'equal' if c['logits_equal'] else 'differ'} ({c['logits_max_diff']:.3g}) "  # noqa: E731
                      f"/ {'equal' if c['grads_equal'] else 'differ'} ({c['grads_max_diff']:.3g})")
    lines = [f"| {r[mode]['kernels']} | {cell(r[mode]['replay'])} | {cell(r[mode]['native_again'])} "
             f"| {'; '.join(r[mode]['warnings']) or 'none'} |" for mode in ("default", "deterministic")]
    strict_error = r["deterministic"]["strict_error"]
    if strict_error:
        lines += ["", f"Strict deterministic mode failed, so warn-only ran: `{strict_error}`"]
    return lines + ["", f"Shape {r['shape']}, tokens {r['tokens']}. A replay of shifted ids (each id + 1 mod E) moves "
                        f"the logits by up to {r['shifted_replay_logits_max_diff']:.3g} (must be > 0). "
                        f"Verdict (deterministic replay bit-identical): **{verdict(r)}**."]


def _md_experts(r: dict) -> list[str]:
    return [f"| {r['shape']} | {r['tokens']:,} | {name} | {c['median_ms']:.3f} | {c['tflops']:.1f} "
            f"| {100 * c['of_dense']:.0f}% | {r['grouped_mm_calls_per_forward'] if 'experts' in name else ''} |"
            for name, c in r["contenders"].items()]


def _md_fsdp2(r: dict) -> list[str]:
    losses = ", ".join(f"{x:.4f}" for x in r["losses"])
    return [f"Command (in a temporary directory `$TMP`): `{r['command']}`  ",
            f"Exit status {r['exit_status']}{' (timed out)' if r['timed_out'] else ''} after {r['run_seconds']:.1f} s; "
            f"manifest status {r['status']}; {r['metric_lines']} metrics lines, losses [{losses}], finite: "
            f"{r['losses_finite']}; checkpoint saved by parallel={r['checkpoint_parallel']}, world size "
            f"{r['checkpoint_world_size']}. Verdict: **{verdict(r)}**.", "", "Last output:", "", "```",
            r["output_tail"].strip(), "```"]


def _md_rl_step(r: dict) -> list[str]:
    s = r["seconds"]
    total = sum(s[p] for p in r["phases"])
    return [f"{r['shape']}, {r['batch']}; medians of {r['measured_steps']} measured step(s) after one warm-up; losses "
            f"finite: {r['losses_finite']}.", "", "| " + " | ".join(r["phases"]) + " | sum | step wall |",
            "|" + "---|" * (len(r["phases"]) + 2),
            "| " + " | ".join(f"{s[p]:.3f} s" for p in r["phases"]) + f" | {total:.3f} s | {s['step wall']:.3f} s |"]


def _md_hf(r: dict) -> list[str]:
    cell = lambda c, key: f"{'equal' if c[key + '_equal'] else 'differ'} ({c[key + '_max_diff']:.3g})"  # noqa: E731
    d, s = r["default"], r["deterministic"]
    return [f"| {r['family']} | {cell(d, 'replay')} | {cell(d, 'again')} | {cell(s, 'replay')} | {cell(s, 'again')} "
            f"| {d['native_under_replay_is_recorded'] and s['native_under_replay_is_recorded']} "
            f"| {r['shifted_replay_logits_max_diff']:.3g} | {'; '.join(s['warnings']) or 'none'} | {verdict(r)} |"]


def _md_hf_train(r: dict) -> list[str]:
    losses = ", ".join(f"{x:.4f}" for x in r["losses"])
    churn = lambda xs: ", ".join(f"{x:.3g}" for x in xs) or "none"  # noqa: E731
    return [f"Command (in a temporary directory `$TMP`): `{r['command']}`  ",
            f"Exit status {r['exit_status']}; manifest status {r['status']}; {r['metric_lines']} metrics lines, "
            f"losses [{losses}]; replay churn at minibatch 0 [{churn(r['replay_churn_minibatch_0'])}], later "
            f"[{churn(r['replay_churn_later'])}]. Verdict: **{verdict(r)}**."]


SECTIONS = {  # part: (title, table header lines, row formatter)
    "train": ("1. bf16 training steps of the native model (fp32 weights, bf16 autocast, AdamW)",
              ["Per step: CUDA events around zero_grad, forward, backward and the AdamW step; median after warm-up. "
               "Loss: next-token cross-entropy plus router losses on one fixed random batch.", "",
               "| shape | tokens | per step | loss first -> last | parameters changed | result |",
               "|---|---|---|---|---|---|"], _md_train),
    "replay": ("2. Replay exactness under bf16 autocast (logits / router gradients: equal or not, max difference)",
               ["| kernels | record vs replay | native vs native again (floor) | warnings |", "|---|---|---|---|"],
               _md_replay),
    "experts": ("3. Expert throughput: `Experts` (dispatch 'grouped') vs dense matmuls of equal FLOPs, fwd+bwd",
                ["FLOPs 18 T K D F per forward+backward (both products, 2 per multiply-add, backward twice the "
                 "forward); median ms over interleaved calls; 'of dense' = dense time / this time.", "",
                 "| shape | tokens | contender | ms | TFLOP/s | of dense | torch._grouped_mm calls per forward |",
                 "|---|---|---|---|---|---|---|"], _md_experts),
    "fsdp2": ("4. FSDP2 under torchrun (`moe-rl train --parallel fsdp2 --device cuda`)", [], _md_fsdp2),
    "rl_step": ("5. The paper-shaped RL step (Trainer.rl_step), seconds per phase", [], _md_rl_step),
    "hf": ("6. The Hugging Face backend under bf16 autocast (tiny random models; logits equal or not, max difference)",
           ["| family | default: record vs replay | default: native again (floor) | deterministic: record vs replay "
            "| deterministic: native again | routers' choice under replay = recorded | shifted replay moves logits by "
            "| warnings (deterministic) | result |", "|---|---|---|---|---|---|---|---|---|"], _md_hf),
    "hf_train": ("7. `moe-rl train --model.backend hf --device cuda` (R2, two rollout steps)", [], _md_hf_train),
}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# GPU check", "", f"Command: `{report['command']}`  ",
             f"GPU: {env.get('gpu', 'none')} (x{env.get('gpus', 0)}, compute capability {env.get('capability')}, "
             f"{env.get('memory_gib')} GiB); torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env.get('cudnn')}, "
             f"NCCL {env.get('nccl')}; Python {env['python']}; git {env.get('git')}; {env['utc']}."
             + (f" Describing the GPU failed: `{env['gpu_error']}`." if "gpu_error" in env else ""), "",
             "| part | item | result | seconds |", "|---|---|---|---|"]
    for part, items in report["parts"].items():
        for item, r in items.items():
            seconds = f"{r['part_seconds']:.1f}" if r and "part_seconds" in r else ""
            lines.append(f"| {part} | {item} | {verdict(r)} | {seconds} |")
    for part, items in report["parts"].items():
        title, header, rows = SECTIONS[part]
        lines += ["", f"## {title}", "", *header]
        for item, r in items.items():
            lines += _md_item(item, r, rows, in_table=bool(header))
    return "\n".join(lines) + "\n"


def _md_item(item: str, r: dict | None, rows: Callable[[dict], list[str]], in_table: bool) -> list[str]:
    if r is None:
        return [f"| {item} | not run |" if in_table else f"{item}: not run."]
    if "error" in r:
        text = f"{item}: **error** `{r['error'].splitlines()[0]}` (traceback in gpu.json)"
        return [f"| {text} |" if in_table else text]
    try:
        return rows(r)
    except Exception as exc:  # noqa: BLE001 -- a formatter's bug must not hide the numbers: show them raw
        return ["", f"{item}: (formatting failed: {type(exc).__name__}: {exc}) raw: `{json.dumps(r, default=str)}`"]


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu.md").write_text(markdown(report))


def autocast(device: torch.device):
    """The trainer's numerics (moe_rl/model/layers.py, autocast_context, restated: that module may move): bf16
    autocast on CUDA, the routers opting out to fp32; fp32 without autocast on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
