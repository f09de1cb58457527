"""Refactors change no number: digests of the bench models' logits and gradients and of short RL runs, recorded on
this CPU, must come out the same.

The numbers depend on the CPU (its vector width decides how MKL and the C kernels round), so the recorded digests
are kept per CPU (tests/assets/same_numbers.json, keyed by model name, ISA, torch version and the instruction-set
caps in force); on a CPU with no record the test skips and says how to record one. Every kernel family is forced on,
or forced off, so the digest does not depend on what this machine's measurement chose.

Record (only at a commit whose numbers are known to be right, and say so in the commit):

    python tests/test_same_numbers.py --record
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

ASSETS = Path(__file__).resolve().parent / "assets" / "same_numbers.json"

COMMON = dict(d_model=64, n_heads=4, n_kv_heads=2, vocab_size=99, max_seq_len=256)
BENCH_MODELS = {  # the three shapes of benchmarks/bench_model.py: (ModelConfig kwargs, batch, sequence length)
    "tiny": (dict(COMMON, n_layers=4, n_experts=8, top_k=2, d_expert=64), 4, 32),
    "E128": (dict(COMMON, n_layers=8, n_experts=128, top_k=8, d_expert=32), 4, 32),
    "d256": (dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, n_experts=16, top_k=4,
                  d_expert=256, max_seq_len=256), 2, 64),
}
RL_RUNS = {  # a 3-step run of `moe-rl train` under each routing mode and replay variant, and two sampler arms
    "native": [],
    "R2": ["--routing-mode", "R2"],
    "R3": ["--routing-mode", "R3"],
    "R3 gate weights": ["--routing-mode", "R3", "--replay.gate-weights"],
    "R2 margin": ["--routing-mode", "R2", "--replay.margin-threshold", "0.05"],
    "R3 bf16 sampler": ["--routing-mode", "R3", "--rollout.sampling.precision", "bf16"],
    "R2 exact sampler": ["--routing-mode", "R2", "--rollout.sampling.precision", "exact"],
}
RL_ARGS = ["--total-steps", "3", "--model.n-layers", "3", "--rollout.prompts-per-step", "4",
           "--rollout.group-size", "4", "--quiet"]
CLOCK_FIELDS = ("wall_time",)  # and every "time/..." field


def cpu_key() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name", platform.processor())
    cpu = f"{name} family {fields.get('cpu family')} model {fields.get('model')}"
    isa = "avx512" if " avx512f" in info else "avx2" if " avx2" in info else "other"
    caps = ",".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                   "ONEDNN_MAX_CPU_ISA", "MOE_RL_ISA") if k in os.environ)
    return f"{cpu} | {isa} | torch {torch.__version__} | {caps or 'uncapped'}"


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def kernels_all(on: bool):
    from moe_rl import kernels

    return kernels.forced(**{family: on for family in kernels.FAMILIES})


def model_digest(name: str, kernels_on: bool) -> str:
    from moe_rl import kernels
    from moe_rl.model import ModelConfig, MoETransformer

    kwargs, batch, seq = BENCH_MODELS[name]
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**kwargs), kernels=kernels.machine() if kernels_on else None)
    ids = torch.randint(0, kwargs["vocab_size"], (batch, seq))
    out = model(ids)
    (out.logits_BSV.logsumexp(-1).mean() + out.aux_loss).backward()
    return digest([out.logits_BSV, out.aux_loss] + [p.grad for p in model.parameters() if p.grad is not None])


def rl_digest(name: str, out_dir: Path) -> str:
    from moe_rl.cli import main

    status = main(["train", "--out-dir", str(out_dir)] + RL_ARGS + RL_RUNS[name])
    assert status == 0, f"{name}: moe-rl train exited {status}"
    lines = []
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        lines.append({k: v for k, v in metrics.items() if k not in CLOCK_FIELDS and not k.startswith("time/")})
    weights = torch.load(out_dir / "checkpoints" / "latest.pt", weights_only=True)["model"]
    h = hashlib.sha256(json.dumps(lines, sort_keys=True).encode())
    h.update(digest([weights[k] for k in sorted(weights)]).encode())
    return h.hexdigest()[:16]


def all_digests(tmp: Path) -> dict[str, str]:
    out = {}
    for on in (True, False):
        with kernels_all(on):
            for name in BENCH_MODELS:
                out[f"model {name}, kernels {'on' if on else 'off'}"] = model_digest(name, on)
    with kernels_all(True):
        for name in RL_RUNS:
            out[f"rl {name}"] = rl_digest(name, tmp / name.replace(" ", "_"))
    return out


def recorded() -> dict[str, str] | None:
    return json.loads(ASSETS.read_text()).get(cpu_key()) if ASSETS.exists() else None


@pytest.mark.slow
def test_the_numbers_are_the_recorded_ones(tmp_path):
    expected = recorded()
    if expected is None:
        pytest.skip(f"no digests recorded for this CPU ({cpu_key()}): python tests/test_same_numbers.py --record")
    got = all_digests(tmp_path)
    differ = {k: (expected.get(k), v) for k, v in got.items() if expected.get(k) != v}
    assert not differ, f"numbers changed (recorded, now): {differ}"


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        digests = all_digests(Path(tmp))
    table = json.loads(ASSETS.read_text()) if ASSETS.exists() else {}
    table[cpu_key()] = digests
    ASSETS.parent.mkdir(exist_ok=True)
    ASSETS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(json.dumps(digests, indent=1))
