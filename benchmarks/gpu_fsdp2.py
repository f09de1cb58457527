"""Part 4 of the GPU check (benchmarks/gpu_check.py): an FSDP2 run of the real command under torchrun, and what it
left in its run directory. The ranks run `python -m benchmarks.gpu_check --fsdp2-worker ...`, which calls
`fsdp2_worker` here."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# Part 4's run: small, so that the time goes to torchrun, NCCL and FSDP2, not to the model.
FSDP2_ARGS = ("--minibatches", "2", "--routing-mode", "R2", "--model.d-model", "64", "--model.n-layers", "4",
              "--model.n-experts", "16", "--model.top-k", "4", "--model.d-expert", "64", "--rollout.group-size", "4",
              "--rollout.sampling.max-new-tokens", "16", "--quiet")


def fsdp2_command(run_dir: Path, device: str, nproc: int, steps: int) -> list[str]:
    """torchrun over `nproc` processes, each `moe-rl train --parallel fsdp2` through this file's --fsdp2-worker."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "benchmarks.gpu_check", "--fsdp2-worker", "train", "--out-dir", str(run_dir), "--device", device,
            "--parallel", "fsdp2", "--total-steps", str(steps), "--rollout.prompts-per-step", str(4 * nproc),
            *FSDP2_ARGS]


def fsdp2_worker(cli_argv: list[str]) -> int:
    """One torchrun process of part 4: the `moe-rl` command (moe_rl.cli.main) on `cli_argv`. With a single process
    (WORLD_SIZE 1) moe_rl.rl.distributed forms no process group and `--parallel fsdp2` would do nothing, so the worker
    joins a group of one first (NCCL with --device cuda, else gloo); the command then uses that group."""
    import torch.distributed as dist

    from moe_rl.cli import main as cli_main

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return cli_main(cli_argv)
    cuda = "--device" in cli_argv and cli_argv[cli_argv.index("--device") + 1] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return cli_main(cli_argv)
    finally:
        dist.destroy_process_group()


def read_run(run_dir: Path) -> dict:
    """What part 4 checks in the run directory: the losses in metrics.jsonl, the manifest's status and whether the
    last checkpoint was saved sharded."""
    lines = []
    metrics = run_dir / "metrics.jsonl"
    for text in metrics.read_text().splitlines() if metrics.exists() else []:
        with contextlib.suppress(ValueError):  # a truncated last line
            lines.append(json.loads(text))
    losses = [float(line["loss/total"]) for line in lines if "loss/total" in line]
    manifest = run_dir / "manifest.json"
    status = json.loads(manifest.read_text()).get("status") if manifest.exists() else None
    checkpoint_path = run_dir / "checkpoints" / "latest.pt"
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True) if checkpoint_path.exists() else {}
    return {"metric_lines": len(lines), "losses": losses,
            "losses_finite": bool(losses) and all(math.isfinite(x) for x in losses), "status": status,
            "checkpoint_parallel": checkpoint.get("parallel", "none (unsharded)") if checkpoint else None,
            "checkpoint_world_size": checkpoint.get("world_size")}


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc; empty where there is none)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children


def stop_run(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM to torchrun, which passes it on to its ranks; SIGKILL to torchrun and the ranks if they are not gone
    after `grace_s`. torchrun starts each rank in a session of its own, so the ranks are found by parent pid."""
    ranks = child_pids(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        for pid in (proc.pid, *ranks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
            if not any(Path(f"/proc/{pid}").exists() for pid in ranks):
                return


def fsdp2_step(device: str, nproc: int, steps: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = fsdp2_command(Path(tmp) / "run", device, nproc, steps)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        log_path = Path(tmp) / "torchrun.log"
        t0 = time.perf_counter()
        with open(log_path, "w") as log:  # a file, not a pipe: a rank that outlives torchrun cannot block a read
            proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_run(proc)
        except BaseException:  # PartTimeout included
            stop_run(proc)
            raise
        seconds = time.perf_counter() - t0
        output = log_path.read_text(errors="replace")
        run = read_run(Path(tmp) / "run")
    shown = shlex.join(["python", *command[1:]]).replace(tmp, "$TMP")
    ok = proc.returncode == 0 and run["losses_finite"] and run["checkpoint_parallel"] == "fsdp2"
    return {"command": shown, "nproc": nproc, "exit_status": proc.returncode, "timed_out": timed_out,
            "run_seconds": seconds, **run, "output_tail": output[-(500 if ok else 4000):], "ok": ok}
