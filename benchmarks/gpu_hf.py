"""Part 6 of the GPU check (benchmarks/gpu_check.py): the Hugging Face backend on a CUDA device.

Per family (tiny random models, nothing downloaded; moe_rl.model.hf.tiny_hf_model), under the trainer's bf16 autocast:
routing recorded on a forward, then replayed; the replay's logits against the recorded ones and against a second
native pass (the floor), with torch's default kernels and with deterministic ones (warn-only: an op without a
deterministic CUDA kernel only warns); the native routing computed under the replay must equal the recorded one, and a
replay of shifted ids must move the logits. Then `moe-rl train --model.backend hf --device cuda` for two rollout steps
under R2: finished with finite losses; its replay churn (replayed old-pass ids against the routers' own choice in the
same forward) is reported, not required to be 0: on CPU it is 0 at minibatch 0 bit for bit (tests/rl/test_hf_train.py),
on a GPU the old pass and the update's forward may round apart. The CPU tests (tests/model/test_hf_model.py,
tests/rl/test_hf_train.py) check the same contract in fp32 bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import warnings
from pathlib import Path

import torch

HF_SIZES = dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, d_expert=64, d_dense=128,
                init_std=0.1)
TRAIN_FAMILY = "qwen3_moe"


def padded_batch(device: torch.device, B: int = 4, S: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with left padding in row 0 and right padding in row 1 (the adapter's position rule is exercised)."""
    g = torch.Generator().manual_seed(1)
    ids_BS = torch.randint(3, 99, (B, S), generator=g)
    valid_BS = torch.ones(B, S, dtype=torch.bool)
    valid_BS[0, :5] = False
    valid_BS[1, -4:] = False
    return ids_BS.to(device), valid_BS.to(device)


def _logits(model, ids_BS, valid_BS, session=None) -> torch.Tensor:
    from benchmarks.gpu_report import autocast

    with session or contextlib.nullcontext(), torch.no_grad(), autocast(ids_BS.device):
        return model(ids_BS, valid_BS).logits_BSV.float()


def _passes(model, ids_BS, valid_BS) -> dict:
    """Recorded, again and replayed logits; whether the replay's native routing is the recorded one."""
    from moe_rl.routing.replay import record_routing, replay_routing

    with record_routing(model) as recording:
        recorded = _logits(model, ids_BS, valid_BS)
    trace = recording.trace()
    again = _logits(model, ids_BS, valid_BS)
    with replay_routing(model, trace, record_native=True) as replay:
        replayed = _logits(model, ids_BS, valid_BS)
    max_diff = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    return {"replay_equal": torch.equal(recorded, replayed), "replay_max_diff": max_diff(recorded, replayed),
            "again_equal": torch.equal(recorded, again), "again_max_diff": max_diff(recorded, again),
            "native_under_replay_is_recorded": torch.equal(replay.native_trace().ids_LBSK, trace.ids_LBSK),
            "trace": trace, "recorded": recorded}


def hf_replay(family: str, device: torch.device) -> dict:
    from moe_rl.model import ModelConfig
    from moe_rl.model.hf import tiny_hf_model
    from moe_rl.routing.replay import replay_routing
    from moe_rl.routing.trace import RoutingTrace

    torch.manual_seed(0)
    cfg = ModelConfig(backend="hf", hf_config=family, **HF_SIZES)
    model = tiny_hf_model(family, cfg).to(device)
    ids_BS, valid_BS = padded_batch(device)
    result: dict = {"family": family, "tokens": f"{ids_BS.shape[0]}x{ids_BS.shape[1]}"}
    default = _passes(model, ids_BS, valid_BS)
    was_on, was_warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            deterministic = _passes(model, ids_BS, valid_BS)
        finally:
            torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
    ids_LBSK = default["trace"].ids_LBSK
    shifted = RoutingTrace(((ids_LBSK.long() + 1) % cfg.n_experts).to(ids_LBSK.dtype))
    moved = _logits(model, ids_BS, valid_BS, replay_routing(model, shifted))
    result["shifted_replay_logits_max_diff"] = (moved - default["recorded"]).abs().max().item()
    for name, passes in (("default", default), ("deterministic", deterministic)):
        result[name] = {k: v for k, v in passes.items() if k not in ("trace", "recorded")}
    result["deterministic"]["warnings"] = sorted({str(w.message).splitlines()[0][:160] for w in caught})
    result["ok"] = (deterministic["replay_equal"] and deterministic["native_under_replay_is_recorded"]
                    and default["replay_max_diff"] <= default["again_max_diff"]
                    and result["shifted_replay_logits_max_diff"] > 0)
    return result


def hf_train(device: torch.device, steps: int = 2) -> dict:
    """`moe-rl train` with the HF backend on this device, in-process (the flags parsed as on the shell)."""
    from moe_rl.cli import main
    from moe_rl.runs.runlog import read_manifest, read_metrics

    sizes = [f"--model.{key.replace('_', '-')}={value}" for key, value in HF_SIZES.items() if key != "init_std"]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        args = ["train", "--out-dir", str(run), "--device", device.type, "--routing-mode", "R2", "--model.backend",
                "hf", "--model.hf-config", TRAIN_FAMILY, *sizes, "--total-steps", str(steps), "--minibatches", "2",
                "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--rollout.sampling.max-new-tokens",
                "16", "--quiet"]
        status = main(args)
        lines, manifest = read_metrics(run), read_manifest(run)
    losses = [line["loss/total"] for line in lines if "loss/total" in line]
    churn = lambda first: [line["routing/replay/churn"] for line in lines  # noqa: E731
                           if "routing/replay/churn" in line and (line.get("minibatch") == 0) == first]
    return {"command": "moe-rl " + " ".join(args[:1] + ["--out-dir", "$TMP/run"] + args[3:]), "exit_status": status,
            "status": manifest.get("status"), "metric_lines": len(lines), "losses": losses,
            "replay_churn_minibatch_0": churn(True), "replay_churn_later": churn(False),
            "ok": status == 0 and manifest.get("status") == "finished" and bool(losses)
            and all(math.isfinite(x) for x in losses)}
